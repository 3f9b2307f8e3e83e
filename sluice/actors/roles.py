"""The roles a pipeline process can take (`sluice run --role ROLE`), in the order a request meets
them."""

ROLES = ("tokenizer", "scheduler", "runner", "streamer", "prefill", "decode")
# Runners: "runner" serves a request whole; with prefill/decode separation a "prefill" runner
# computes prompts and passes each request on to a "decode" runner (`kv_handoff.py`).
RUNNER_ROLES = ("runner", "prefill", "decode")
