"""Routing among two runners: KV-aware against round-robin and session-only, on a shared-prefix
workload, in one run on the broker of `sluice stack up`.

    .venv/bin/python -m bench.routing            # 8 prefixes of ~500 tokens x 12 rounds
    .venv/bin/python -m bench.routing --quick    # 4 prefixes x 4 rounds

For each routing policy in turn, a fresh deployment under a topic prefix of its own: a tokenizer,
a scheduler, a streamer and two runners (one thread each, so that the two share the machine's
cores evenly), each with room in its KV cache for about 5 of the 8 prefixes (`--kv-cache-mb`).
Every round publishes each prefix once, in a new order, with a question of its own after it, and
waits for the round's final events before the next. Reported per policy: prompt tokens the final
events count as cached, against the ideal (each prefix computed once: every later request finds
its shared blocks), prompt tokens computed, the requests each runner finished, wall time from the
first publish to the last final event, requests and output tokens per second, and TTFT p50/p95
(the final events' timings, from publish). Writes bench/results/routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

from bench.cluster import ROOT, Client, Cluster, cpu_model, log, metrics, percentile, total

RESULTS = ROOT / "bench" / "results" / "routing.json"
POLICIES = ("kv", "round-robin", "session")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
WORDS = (
    "river stone cloud lamp paper orange window garden silver engine bridge forest candle "
    "market harbor pencil thunder violet meadow anchor basket copper desert feather glacier"
).split()


def shared_prefix(i: int) -> str:
    """About 500 tokens of text, different for each i."""
    rng = random.Random(i)
    return f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(480)) + "."


def rounds(prefixes: int, count: int, max_tokens: int) -> list[list[dict]]:
    rng = random.Random(7)
    out = []
    for r in range(count):
        out.append(
            [
                {
                    "request_id": f"p{p}-r{r}",
                    "prompt": shared_prefix(p) + f"\nQuestion {r}: what comes next?",
                    "temperature": 0,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                }
                for p in rng.sample(range(prefixes), prefixes)
            ]
        )
    return out


def finished_per_runner(cluster: Cluster, runners: list[str]) -> dict[str, float]:
    return {
        name: total(metrics(cluster.processes[name].port), "sluice_runner_finished_requests_total")
        for name in runners
    }


async def run_policy(args, policy: str) -> dict:
    engine_args = ["--dtype", args.dtype, "--kv-cache-mb", str(args.kv_cache_mb)]
    cluster = Cluster(args.bootstrap_servers, engine_args)
    routing = ["--routing", policy]
    runners = ["runner-a", "runner-b"]
    try:
        for name in runners:
            cluster.start(name, "runner", *routing, "--runner-id", name, env=ONE_THREAD)
        cluster.start("tokenizer", "tokenizer")
        cluster.start("streamer", "streamer")
        cluster.start("scheduler", "scheduler", *routing)
        cluster.wait_ready()
        if policy != "session":
            await cluster.wait_runners("scheduler", len(runners))
        async with Client(args.bootstrap_servers, cluster.prefix) as client:
            warm = [{"request_id": f"warm-{i}", "prompt": "Hello", "max_tokens": 2} for i in "ab"]
            await client.publish(warm)
            await client.wait({b["request_id"] for b in warm})
            before = finished_per_runner(cluster, runners)
            log(f"{policy}: {args.prefixes} prefixes x {args.rounds} rounds")
            start = time.time()
            ids: list[str] = []
            for batch in rounds(args.prefixes, args.rounds, args.max_tokens):
                await client.publish(batch)
                ids += [b["request_id"] for b in batch]
                await client.wait({b["request_id"] for b in batch})
            wall = max(client.streams[rid].final_read for rid in ids) - start
        after = finished_per_runner(cluster, runners)
    finally:
        await cluster.stop()
    finals = [client.streams[rid].final for rid in ids]
    cached = sum(f["usage"]["cached_tokens"] for f in finals)
    prompt = sum(f["usage"]["prompt_tokens"] for f in finals)
    # The ideal: per prefix, the most any of its requests found cached (its shared blocks), found
    # by every request after its first.
    ideal = 0
    for p in range(args.prefixes):
        mine = [client.streams[rid].final for rid in ids if rid.startswith(f"p{p}-")]
        ideal += max(f["usage"]["cached_tokens"] for f in mine) * (len(mine) - 1)
    ttft = [f["timings"]["ttft_s"] for f in finals]
    out_tokens = sum(f["usage"]["completion_tokens"] for f in finals)
    return {
        "policy": policy,
        "requests": len(ids),
        "cached_tokens": cached,
        "ideal_cached_tokens": ideal,
        "prompt_tokens": prompt,
        "computed_tokens": prompt - cached,
        "finished_per_runner": {name: after[name] - before[name] for name in runners},
        "wall_s": wall,
        "requests_per_s": len(ids) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
    }


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["policy"] == "round-robin"), results[0])
    lines = [
        "| routing | cached / ideal | prompt tokens computed | requests per runner "
        f"| wall s | req/s | vs {base['policy']} | TTFT p50 s | TTFT p95 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        split = " / ".join(f"{v:.0f}" for v in r["finished_per_runner"].values())
        ratio = r["cached_tokens"] / r["ideal_cached_tokens"] if r["ideal_cached_tokens"] else 0
        lines.append(
            f"| {r['policy']} | {r['cached_tokens']:,} / {r['ideal_cached_tokens']:,} "
            f"({ratio:.0%}) | {r['computed_tokens']:,} | {split} | {r['wall_s']:.1f} "
            f"| {r['requests_per_s']:.2f} | {r['requests_per_s'] / base['requests_per_s']:.2f}x "
            f"| {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-mb", type=int, default=128, help="each runner's (float32)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="4 prefixes x 4 rounds")
    args = parser.parse_args()
    if args.quick:
        args.prefixes, args.rounds = 4, 4
    results = []
    for policy in args.policies.split(","):
        if policy not in POLICIES:
            raise SystemExit(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        results.append(asyncio.run(run_policy(args, policy)))
    cpu = cpu_model()
    print(
        f"\nrouting, two runners of 1 thread each, {args.dtype}, KV cache "
        f"{args.kv_cache_mb} MiB each; {cpu}, {os.cpu_count()} cores\n"
    )
    print(table(results))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"cpu": cpu, "cores": os.cpu_count(), "args": vars(args), "results": results}, indent=1
        )
    )
    print(f"\nwritten to {RESULTS.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
