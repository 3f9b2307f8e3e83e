"""KV-aware routing over the real broker: a tokenizer, a scheduler, a streamer and two runner
processes, each runner reading a work topic of its own and reporting its cached blocks on
PREFIX.kv-events. Eight ~250-token shared prefixes, six requests each, arrive interleaved
(rounds of the eight in a new order each time); the cached prompt tokens the final events report
are compared with the ideal (each prefix computed once) and with round-robin routing of the same
workload in the same test."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

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

# Room for about 1450 tokens (float32) on each runner: five or six of the eight prefixes, so a
# runner that is sent all eight evicts what it will need again, and one sent half keeps them.
KV_CACHE_MB = 64
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PREFIXES, ROUNDS = 8, 6
PREFIX_WORDS = 240
WORDS = (
    "river stone cloud lamp paper orange window garden silver engine bridge forest candle "
    "market harbor pencil thunder violet meadow anchor basket copper desert feather glacier"
).split()


def shared_prefix(i: int) -> str:
    """About 250 tokens of text, different for each i."""
    rng = random.Random(i)
    return f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS)) + "."


def workload(tenant: str) -> list[list[tuple[str, tuple[bytes, bytes]]]]:
    """Rounds of requests: each round the eight prefixes in a new order, each with a question of
    its own after it."""
    rng = random.Random(7)
    rounds = []
    for r in range(ROUNDS):
        order = rng.sample(range(PREFIXES), PREFIXES)
        batch = []
        for p in order:
            rid = f"{tenant}-p{p}-r{r}"
            prompt = shared_prefix(p) + f"\nQuestion {r}: what comes next?"
            batch.append(
                (rid, request(rid, prompt=prompt, tenant=tenant, temperature=0, max_tokens=2))
            )
        rounds.append(batch)
    return rounds


async def serve(bootstrap: str, prefix: str, tenant: str) -> dict[str, dict]:
    """Publish the workload round by round (each once the round before it answered); the final
    event of every request."""
    finals: dict[str, dict] = {}
    async with Watcher(bootstrap, prefix) as watcher:
        for batch in workload(tenant):
            await publish(bootstrap, f"{prefix}.requests", [message for _, message in batch])
            ids = {rid for rid, _ in batch}
            streams = await watcher.wait_finals(ids, timeout=240)
            for rid in ids:
                (final,) = streams.finals(rid)
                assert final["type"] == "final", final
                finals[rid] = final
    return finals


def cached_tokens(finals: dict[str, dict], cacheable: dict[int, int]) -> tuple[int, int]:
    """(cached prompt tokens over all requests, the ideal: every prefix computed once, each of its
    other requests finding all of its `cacheable` tokens cached)."""
    total = sum(f["usage"]["cached_tokens"] for f in finals.values())
    ideal = sum(cacheable[p] * (ROUNDS - 1) for p in range(PREFIXES))
    return total, ideal


def cacheable_tokens(finals: dict[str, dict]) -> dict[int, int]:
    """Per prefix, the most cached tokens any of its requests found: its shared part in whole
    blocks (the same prompts under another tenant give the same length)."""
    cacheable = {}
    for p in range(PREFIXES):
        group = [f for rid, f in finals.items() if f"-p{p}-" in rid]
        cacheable[p] = max(f["usage"]["cached_tokens"] for f in group)
        assert cacheable[p] >= PREFIX_WORDS - 16, (p, cacheable[p])  # (all but its last block)
    return cacheable


async def runners_heard(port: int, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while value(scrape(port), "sluice_runners_live", default=0.0) < count:
        assert time.monotonic() < deadline, f"the scheduler did not hear {count} runners"
        await asyncio.sleep(0.3)


def routed(port: int) -> dict[str, float]:
    """Requests the scheduler sent to each runner."""
    per_runner: dict[str, float] = {}
    for labels, count in scrape(port).get("sluice_routed_requests_total", []):
        per_runner[labels["runner"]] = per_runner.get(labels["runner"], 0.0) + count
    return per_runner


async def test_kv_routing_finds_cached_prefixes(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    procs: list[PipelineProcess] = []

    def start(role: str, *extra: str, name: str | None = None, env=None) -> PipelineProcess:
        process = PipelineProcess(
            bootstrap_servers,
            None,
            prefix,
            tmp_path,
            "--role",
            role,
            "--dtype",
            "float32",
            "--quantization",
            "none",
            "--kv-cache-mb",
            str(KV_CACHE_MB),
            *extra,
            name=name or role,
            env=env,
        )
        procs.append(process)
        return process

    routing = ("--routing", "kv")
    for c in "ab":
        start("runner", *routing, "--runner-id", f"runner-{c}", name=f"runner-{c}", env=ONE_THREAD)
    start("tokenizer")
    start("streamer")
    kv_port, rr_port = free_port(), free_port()
    scheduler = start("scheduler", *routing, "--metrics-port", str(kv_port))
    try:
        for process in procs:
            process.wait_ready(timeout=180)
        await runners_heard(kv_port, 2)
        kv = await serve(bootstrap_servers, prefix, "kv")
        kv_split = routed(kv_port)
        # The same workload under another tenant (so nothing of it is cached yet), routed by turns.
        assert scheduler.stop() == 0, scheduler.tail()
        procs.remove(scheduler)
        start("scheduler", "--routing", "round-robin", "--metrics-port", str(rr_port))
        procs[-1].wait_ready(timeout=120)
        await runners_heard(rr_port, 2)
        rr = await serve(bootstrap_servers, prefix, "rr")
        rr_split = routed(rr_port)
    finally:
        codes = {p.name: p.stop() for p in procs}
    assert all(code == 0 for code in codes.values()), (codes, "\n".join(p.tail(30) for p in procs))

    cacheable = cacheable_tokens(kv)
    kv_cached, kv_ideal = cached_tokens(kv, cacheable)
    rr_cached, rr_ideal = cached_tokens(rr, cacheable)
    print(
        f"cached prompt tokens: kv {kv_cached} of ideal {kv_ideal} ({kv_cached / kv_ideal:.3f}), "
        f"round-robin {rr_cached} of {rr_ideal} ({rr_cached / rr_ideal:.3f}); "
        f"requests per runner: kv {kv_split}, round-robin {rr_split}"
    )
    assert kv_cached >= 0.9 * kv_ideal, (kv_cached, kv_ideal)
    assert kv_cached > rr_cached + 0.1 * rr_ideal, (kv_cached, rr_cached, rr_ideal)
    # Both runners served; neither more than 65 % of the requests.
    total = PREFIXES * ROUNDS
    assert sorted(kv_split) == ["runner-a", "runner-b"], kv_split
    assert sum(kv_split.values()) == total and max(kv_split.values()) <= 0.65 * total, kv_split
