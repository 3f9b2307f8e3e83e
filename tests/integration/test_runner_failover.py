"""Runner failover on the real broker: two routed runner processes (`--routing kv`), one of them
SIGKILLed while it generates. Every request completes, with one consistent stream (a seq never
carries two contents, the texts in seq order are the final's), none lost; the dead runner's
unfinished requests are moved to the live one and resumed there; and within the configured time
the scheduler stops choosing the dead runner."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_crash_resume import assert_one_consistent_stream

from sluice.testing.pipeline_harness import (
    PipelineProcess,
    Watcher,
    free_port,
    new_prefix,
    publish,
    request,
    scrape,
    value,
)

pytestmark = pytest.mark.integration

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DEAD_AFTER_S = 3.0
MAX_TOKENS = 40
TOPICS = ["rivers", "owls", "bread", "comets", "chess", "ferns", "glass", "kites", "salt", "tides"]


def bodies(batch: str, count: int) -> list[dict]:
    out = []
    for i in range(count):
        body = {
            "request_id": f"{batch}-{i:02d}",
            "prompt": f"{batch} {i}: tell me about {TOPICS[i % len(TOPICS)]}.",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
        }
        if i % 2:
            body |= {"temperature": 1.0, "seed": 100 + i}
        else:
            body["temperature"] = 0
        out.append(body)
    return out


def routed_to(port: int, runner: str) -> float:
    """Requests the scheduler chose `runner` for (moves of a dead runner's requests excluded)."""
    samples = scrape(port).get("sluice_routed_requests_total", [])
    return sum(
        v for labels, v in samples if labels["runner"] == runner and labels["why"] != "failover"
    )


async def test_sigkill_of_a_routed_runner_moves_its_requests(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    port = free_port()
    procs: dict[str, PipelineProcess] = {}
    routing = ("--routing", "kv", "--runner-dead-after-s", str(DEAD_AFTER_S))

    def start(name: str, role: str, *extra: str, env=None) -> None:
        procs[name] = PipelineProcess(
            bootstrap_servers, None, prefix, tmp_path, "--role", role, *extra, name=name, env=env
        )

    for runner in ("runner-a", "runner-b"):
        start(runner, "runner", *routing, "--runner-id", runner, env=ONE_THREAD)
    start("tokenizer", "tokenizer")
    start("streamer", "streamer")
    start("scheduler", "scheduler", *routing, "--metrics-port", str(port))
    first, second, third = bodies("first", 10), bodies("second", 4), bodies("third", 4)
    try:
        for process in procs.values():
            process.wait_ready(timeout=180)
        deadline = time.monotonic() + 60
        while value(scrape(port), "sluice_runners_live", default=0.0) < 2:
            assert time.monotonic() < deadline, "the scheduler did not hear both runners"
            await asyncio.sleep(0.3)

        async with Watcher(bootstrap_servers, prefix) as watcher:
            await publish(
                bootstrap_servers,
                f"{prefix}.requests",
                [request(**b) for b in first],
            )
            # Kill runner-a once it is in the middle of its share: some of its streams begun.
            await watcher.wait_for(
                lambda s: sum(1 for b in first if len(s.events[b["request_id"]]) >= 3) >= 8,
                timeout=120,
                what="most streams begun",
            )
            assert routed_to(port, "runner-a") >= 3, "runner-a was given no share to lose"
            procs["runner-a"].kill()
            killed_at = time.monotonic()
            unfinished = [
                b["request_id"] for b in first if not watcher.streams.finals(b["request_id"])
            ]
            assert unfinished, "everything finished before the kill"
            # Arriving before the death is noticed, some of these may be sent to runner-a's topic:
            # they are moved too.
            await publish(bootstrap_servers, f"{prefix}.requests", [request(**b) for b in second])

            await asyncio.sleep(max(0.0, killed_at + DEAD_AFTER_S + 2.0 - time.monotonic()))
            chosen_a = routed_to(port, "runner-a")
            await publish(bootstrap_servers, f"{prefix}.requests", [request(**b) for b in third])
            everything = first + second + third
            streams = await watcher.wait_finals({b["request_id"] for b in everything}, timeout=240)
            samples = scrape(port)
        # Past the configured time, runner-a is never chosen again.
        assert routed_to(port, "runner-a") == chosen_a
        assert value(samples, "sluice_runners_live") == 1
        moved = value(samples, "sluice_failover_moved_requests_total", runner="runner-a")
        assert moved >= 1
        for body in everything:
            rid = body["request_id"]
            assert_one_consistent_stream(streams.events[rid], rid, MAX_TOKENS)
    finally:
        codes = {name: p.stop() for name, p in procs.items()}
    tails = "\n".join(p.tail(40) for p in procs.values())
    assert codes.pop("runner-a") == -9
    assert all(code == 0 for code in codes.values()), (codes, tails)
    assert "moved from runner runner-a to runner-b" in procs["scheduler"].text(), tails
    assert "resumes after its" in procs["runner-b"].text(), tails
