"""Prefill/decode separation on the real broker: a prefill runner and a decode runner (with a
tokenizer, a scheduler and a streamer, one process each) give the greedy tokens of one engine
serving each request whole (float32), for 18 requests including chunked prefills (prompts longer
than the token budget) and prefix hits; every request is finished by the decode runner, which
adopted its prompt's KV instead of computing it, and reports it as cached: the KV through a
shared directory, or from the prefill runner's file server as a decode runner on another host
gets it."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from sluice.engine import EngineConfig, LLMEngine, SamplingParams
from sluice.engine.outputs import GenerateResult
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

MAX_TOKENS = 10
BLOCK = 16
WORDS = "amber basin cedar delta ember fjord grove heron inlet juniper kestrel lagoon".split()


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def bodies() -> tuple[list[dict], list[dict]]:
    """Two waves: the second's prompts share prefixes with the first's (prefix hits)."""
    first, second = [], []
    for i in range(2):  # longer than the 512-token budget: prefilled in chunks
        first.append({"request_id": f"long-{i}", "prompt": f"Story {i}: " + text(i, 420)})
    for i in range(6):
        first.append({"request_id": f"short-{i}", "prompt": f"Say something about {WORDS[i]}."})
    for p in range(2):
        shared = f"Notes {p}: " + text(100 + p, 150)
        first.append({"request_id": f"shared-{p}-0", "prompt": shared + " First question?"})
        for q in range(1, 5):
            second.append({"request_id": f"shared-{p}-{q}", "prompt": shared + f" Question {q}?"})
    for body in first + second:
        body |= {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return first, second


@pytest.fixture(scope="module")
def reference() -> dict[str, GenerateResult]:
    """Each request's output from one engine serving it whole, one after another (once for both
    transfers)."""
    engine = LLMEngine(config=EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=512))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first, second = bodies()
    return {b["request_id"]: engine.generate([b["prompt"]], params)[0] for b in first + second}


# The KV through a directory both runners see (one host), or, as between hosts, through the
# prefill runner's file server to a decode runner with a directory of its own.
@pytest.mark.parametrize("transfer", ["shared-dir", "file-server"])
async def test_prefill_and_decode_runners_give_the_tokens_of_one(
    bootstrap_servers, tmp_path, reference, transfer
):
    prefix = new_prefix()
    routing = ("--routing", "kv")
    prefill_kv = ("--kv-transfer-dir", str(tmp_path / "kv"))
    decode_kv = prefill_kv
    if transfer == "file-server":
        prefill_kv += ("--kv-transfer-address", "127.0.0.1:0")
        decode_kv = ("--kv-transfer-dir", str(tmp_path / "decode-kv"))
    port = free_port()
    procs = {
        name: PipelineProcess(
            bootstrap_servers, None, prefix, tmp_path, "--role", role, *extra, name=name
        )
        for name, role, extra in (
            (
                "prefill-1",
                "prefill",
                (*routing, *prefill_kv, "--runner-id", "prefill-1", "--metrics-port", str(port)),
            ),
            ("decode-1", "decode", (*routing, *decode_kv, "--runner-id", "decode-1")),
            ("tokenizer", "tokenizer", ()),
            ("scheduler", "scheduler", routing),
            ("streamer", "streamer", ()),
        )
    }
    first, second = bodies()
    try:
        for process in procs.values():
            process.wait_ready(timeout=180)
        deadline = time.monotonic() + 60
        while value(scrape(port), "sluice_runners_live", default=0.0) < 2:
            assert time.monotonic() < deadline, "the prefill runner did not hear the decode runner"
            await asyncio.sleep(0.3)
        async with Watcher(bootstrap_servers, prefix) as watcher:
            for wave in (first, second):
                await publish(bootstrap_servers, f"{prefix}.requests", [request(**b) for b in wave])
                streams = await watcher.wait_finals({b["request_id"] for b in wave}, timeout=240)
        passed_on = value(
            scrape(port), "sluice_runner_passed_on_requests_total", runner="prefill-1"
        )
    finally:
        codes = {name: p.stop() for name, p in procs.items()}
    tails = "\n".join(p.tail(30) for p in procs.values())
    assert all(code == 0 for code in codes.values()), (codes, tails)

    for body in first + second:
        rid = body["request_id"]
        (final,) = streams.finals(rid)
        assert final["type"] == "final", final
        seqs = [e["seq"] for e in streams.events[rid] if e["type"] == "token"]
        assert seqs == list(range(final["seq"])), (rid, seqs)  # each token event once
        alone = reference[rid]
        assert final["text"] == alone.text, rid
        # The prompt's full blocks came with the request: cached, not computed again.
        full = len(alone.prompt_token_ids) // BLOCK * BLOCK
        assert final["usage"]["cached_tokens"] >= full, (rid, final["usage"], full)
    decode_log = procs["decode-1"].text()
    # Every request passed on; those with a full block of prompt passed on with its KV.
    assert decode_log.count("resumes after its 1 published token") == len(first + second), tails
    assert passed_on == len(first + second)
    with_blocks = [b for b in first + second if not b["request_id"].startswith("short")]
    assert decode_log.count(" adopted") == len(with_blocks), tails
    assert not list(tmp_path.glob("*kv/*.kv")), "KV files left behind"
    if transfer == "file-server":
        assert "and to other hosts from 127.0.0.1:" in procs["prefill-1"].text()
