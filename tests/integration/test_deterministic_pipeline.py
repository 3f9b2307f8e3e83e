"""Deterministic mode through the pipeline on the real broker: `sluice run --deterministic`,
SIGKILLed in the middle of generation and started again (its requests resumed from the progress
changelog), serves sampled requests whose token ids and logprobs are, bit for bit, what an
in-process engine makes of each request alone with the seed its final event reports; and `sluice
replay --request-id` finds a request's events and the request itself on Kafka and reports it
identical."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.engine import EngineConfig, LLMEngine, SamplingParams
from sluice.testing.pipeline_harness import (
    PipelineProcess,
    Streams,
    Watcher,
    new_prefix,
    publish,
    request,
)

pytestmark = pytest.mark.integration

TOPICS = ["lighthouses", "a river at night", "bread", "old maps", "snow", "the first computer"]


def sampled_requests() -> list[dict]:
    out = []
    for i in range(12):
        body = {
            "request_id": f"det-{i:02d}",
            "prompt": f"Item {i}. Tell me something about {TOPICS[i % len(TOPICS)]}:",
            "max_tokens": 8 + 4 * i,
            "ignore_eos": True,
            "temperature": 1.0,
            "top_p": 0.9,
            "logprobs": 2,
        }
        if i % 2:
            body["seed"] = 7000 + i  # the others are given one, and told which
        out.append(body)
    return out


def served(events: list[dict]) -> tuple[list[int], list[tuple[float, list]]]:
    """Token ids and (logprob, top) per position, in seq order, each seq once."""
    by_seq = {e["seq"]: e for e in events if e["type"] == "token"}
    ids: list[int] = []
    logprobs: list[tuple[float, list]] = []
    for seq in sorted(by_seq):
        ids += by_seq[seq]["token_ids"]
        logprobs += [
            (lp["logprob"], [(t["token_id"], t["logprob"]) for t in lp["top"]])
            for lp in by_seq[seq]["logprobs"]
        ]
    return ids, logprobs


def alone(engine: LLMEngine, body: dict, seed: int) -> tuple[list[int], list[tuple[float, list]]]:
    fields = ("temperature", "top_p", "max_tokens", "ignore_eos", "logprobs")
    params = SamplingParams(**{k: body[k] for k in fields}, seed=seed)
    result = engine.generate([body["prompt"]], params)[0]
    logprobs = [(lp.logprob, [(t, v) for t, v in lp.top]) for lp in result.samples[0].logprobs]
    return result.token_ids, logprobs


async def test_a_sigkill_and_resume_change_no_bit_of_what_is_served(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    bodies = sampled_requests()
    ids = {b["request_id"] for b in bodies}
    processes: list[PipelineProcess] = []

    def start(name: str) -> PipelineProcess:
        process = PipelineProcess(
            bootstrap_servers,
            None,
            prefix,
            tmp_path,
            "--deterministic",
            "--delivery",
            "exactly-once",
            name=name,
        )
        processes.append(process)
        process.wait_ready()
        return process

    try:
        first = start("first")
        async with Watcher(bootstrap_servers, prefix, "read_committed") as watcher:
            await publish(
                bootstrap_servers,
                f"{prefix}.requests",
                [
                    request(b["request_id"], **{k: v for k, v in b.items() if k != "request_id"})
                    for b in bodies
                ],
            )

            def some_finished(s: Streams) -> bool:
                return sum(1 for rid in ids if s.finals(rid)) >= 4

            await watcher.wait_for(some_finished, 300, "4 finals")
            first.kill()
            second = start("after-kill")
            streams = await watcher.wait_finals(ids, timeout=400)
        log = second.text()
        replayed = subprocess.run(
            [sys.executable, "-m", "sluice", "replay", "--request-id", "det-11"]
            + ["--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix]
            + ["--kv-cache-mb", "128"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.stop() == 0, second.tail()
    finally:
        for process in processes:
            process.kill()
    assert "resumes after its" in log, "the restarted pipeline resumed nothing"
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "identical: 52 tokens and logprobs of det-11" in replayed.stdout, replayed.stdout

    engine = LLMEngine(config=EngineConfig(kv_cache_bytes=256 << 20, deterministic=True))
    for body in bodies:
        rid = body["request_id"]
        final = streams.finals(rid)[0]
        assert final["provenance"]["deterministic"] is True, rid
        if "seed" in body:
            assert final["seed"] == body["seed"], rid
        assert served(streams.events[rid]) == alone(engine, body, final["seed"]), rid


async def test_a_session_turn_replays_from_the_sessions_record(
    bootstrap_servers, redis_url, tmp_path
):
    """Each turn of a chat session replays identically: its conversation before it comes from the
    session's record in Redis, as the pipeline's tokenizer built it. A session Redis does not
    hold is a clear error."""
    prefix = new_prefix()
    session = f"{prefix}-chat"
    turns = [
        {"request_id": "turn-1", "messages": [{"role": "user", "content": "Name a colour."}]},
        {"request_id": "turn-2", "messages": [{"role": "user", "content": "And a fruit?"}]},
    ]
    process = PipelineProcess(
        bootstrap_servers, redis_url, prefix, tmp_path, "--deterministic", name="sessions"
    )
    try:
        process.wait_ready()
        async with Watcher(bootstrap_servers, prefix) as watcher:
            for turn in turns:
                body = {k: v for k, v in turn.items() if k != "request_id"}
                message = request(
                    turn["request_id"], **body, session_id=session, temperature=1.0,
                    max_tokens=12, ignore_eos=True, logprobs=1,
                )  # fmt: skip
                await publish(bootstrap_servers, f"{prefix}.requests", [message])
                streams = await watcher.wait_finals({turn["request_id"]}, timeout=120)
    finally:
        assert process.stop() == 0, process.tail()
    second = streams.finals("turn-2")[0]
    assert second["usage"]["cached_tokens"] > 0  # it continued the first turn's conversation

    def replay(rid: str, url: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "sluice", "replay", "--request-id", rid, "--redis-url", url]
            + ["--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix]
            + ["--kv-cache-mb", "128"],
            capture_output=True,
            text=True,
            timeout=300,
        )

    for rid in ("turn-1", "turn-2"):
        replayed = replay(rid, redis_url)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        assert f"identical: 12 tokens and logprobs of {rid}" in replayed.stdout, replayed.stdout
    elsewhere = replay("turn-2", redis_url.rsplit("/", 1)[0] + "/9")  # another database
    assert elsewhere.returncode == 2
    assert f"session '{session}' is not in Redis" in elsewhere.stderr, elsewhere.stderr
