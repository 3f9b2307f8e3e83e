"""Harnesses that the tests and the benchmarks share (`python -m bench.chaos` drives the same
pipeline processes as tests/integration), importable without editing sys.path.

- `pipeline_harness`: `sluice run` processes against a real broker, and a plain aiokafka client
  to talk to them (not sluice's connectors: the pipeline is checked from outside).
- `bad_messages`: malformed requests, each with the error it must get (the fuzz test, the chaos
  benchmark).
- `openai_bodies`: the request bodies the official `openai` client sends (needs the dev extra).

Nothing in sluice itself imports this package; it may import the rest of sluice.
"""
