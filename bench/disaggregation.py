"""Prefill/decode separation against unified runners: what long prompts arriving do to the
decodes already running, in one run on the broker of `sluice stack up`; and what handing a
prompt's KV over costs, per token.

    .venv/bin/python -m bench.disaggregation          # 8 decodes of 192 tokens, 6 of ~1000 in
    .venv/bin/python -m bench.disaggregation --quick  # 4 decodes of 96 tokens, 3 long prompts

Two deployments in turn, each with a tokenizer, a scheduler and a streamer (`--routing kv`) and
two runner processes of one thread each, so both use the same cores:
  unified  two unified runners: a long prompt's prefill chunks share steps with the decodes of
           the runner it lands on;
  pd       a prefill runner and a decode runner: every request is prefilled on the first and
           decoded on the second, which adopts its prompt's KV through shared memory.
Workload: --decodes requests with short prompts and --decode-tokens tokens out start first; once
each has streamed a token, --longs prompts of about --long-tokens tokens (4 tokens out) arrive,
one every --long-every seconds. Reported: the gaps between consecutive tokens of the decodes (their
events' producer timestamps: when the runner handed each over) while the long prompts are in
flight, p50/p99 and the decodes' mean TPOT, and the long prompts' TTFT.

On one machine the two deployments share its cores: this shows the interference prefills cause
decodes and that separation removes it from the decode runner's steps, not the speed-up of a
deployment whose prefill and decode runners have machines (or GPUs) of their own.

Then, in this process, the handoff itself for prompts of several lengths: export of the prompt's
blocks from one engine, the file written and read back (`KvFiles`, in the default transfer
directory), and their import into another engine; per prompt token, against computing the prompt.
Writes bench/results/disaggregation.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

from bench.cluster import ROOT, Client, Cluster, cpu_model, log, percentile

RESULTS = ROOT / "bench" / "results" / "disaggregation.json"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
WORDS = "amber basin cedar delta ember fjord grove heron inlet juniper kestrel lagoon".split()
TOPOLOGIES = {
    "unified": [("runner-a", "runner"), ("runner-b", "runner")],
    "pd": [("prefill-1", "prefill"), ("decode-1", "decode")],
}


def long_prompt(i: int, words: int) -> str:
    rng = random.Random(1000 + i)
    return f"Report {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def run_topology(args, topology: str) -> dict:
    engine_args = ["--dtype", args.dtype, "--kv-cache-mb", str(args.kv_cache_mb)]
    cluster = Cluster(args.bootstrap_servers, engine_args)
    routing = ["--routing", "kv", "--kv-transfer-dir", tempfile.mkdtemp(prefix="sluice-kv-")]
    try:
        for name, role in TOPOLOGIES[topology]:
            cluster.start(name, role, *routing, "--runner-id", name, env=ONE_THREAD)
        cluster.start("tokenizer", "tokenizer")
        cluster.start("streamer", "streamer")
        cluster.start("scheduler", "scheduler", *routing[:2])
        cluster.wait_ready()
        await cluster.wait_runners("scheduler", 2)
        await asyncio.sleep(2)  # the prefill runner hears the decode runner too
        async with Client(args.bootstrap_servers, cluster.prefix) as client:
            warm = [{"request_id": f"warm-{i}", "prompt": "Hello", "max_tokens": 3} for i in "ab"]
            await client.publish(warm)
            await client.wait({b["request_id"] for b in warm})
            decodes = [
                {
                    "request_id": f"decode-{i}",
                    "prompt": f"Write a long story about the {WORDS[i % len(WORDS)]}.",
                    "max_tokens": args.decode_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                for i in range(args.decodes)
            ]
            longs = [
                {
                    "request_id": f"long-{i}",
                    "prompt": long_prompt(i, args.long_tokens * 2 // 3),
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                for i in range(args.longs)
            ]
            log(f"{topology}: {len(decodes)} decodes, then {len(longs)} long prompts")
            await client.publish(decodes)
            decode_ids = {b["request_id"] for b in decodes}
            waiting = client.wait(decode_ids | {b["request_id"] for b in longs})
            reader = asyncio.ensure_future(waiting)
            while not all(len(client.streams[rid].token_times) >= 2 for rid in decode_ids):
                if reader.done():
                    reader.result()
                await asyncio.sleep(0.05)
            window_start = time.time()
            for body in longs:
                await client.publish([body])
                await asyncio.sleep(args.long_every)
            await reader
    finally:
        await cluster.stop()
    window_end = max(client.streams[b["request_id"]].final_read for b in longs)
    gaps, tpots, late = [], [], 0
    for rid in decode_ids:
        times = sorted(client.streams[rid].token_times)
        tpots.append((times[-1] - times[0]) / (len(times) - 1))
        for a, b in zip(times, times[1:]):
            if window_start <= b <= window_end:
                gaps.append(b - a)
        late += times[-1] < window_end
    long_ttft = [client.streams[b["request_id"]].final["timings"]["ttft_s"] for b in longs]
    return {
        "topology": topology,
        "gaps_in_window": len(gaps),
        "decode_gap_p50_s": percentile(gaps, 0.5),
        "decode_gap_p99_s": percentile(gaps, 0.99),
        "decode_tpot_mean_s": sum(tpots) / len(tpots),
        "long_ttft_p50_s": percentile(long_ttft, 0.5),
        "long_ttft_max_s": max(long_ttft),
        "decodes_done_before_the_longs": len(decode_ids) - late,
    }


def handoff_cost(args) -> list[dict]:
    """Export, file round trip and import of a prompt's KV, per prompt token, against computing
    the prompt (a prefill of it with one token out)."""
    from sluice.actors.kv_handoff import KvFiles, default_transfer_dir
    from sluice.engine import EngineConfig, LLMEngine, SamplingParams
    from sluice.engine.kv_transfer import export_prefix, import_prefix

    config = EngineConfig(dtype=args.dtype, kv_cache_bytes=args.kv_cache_mb << 20)
    prefill, decode = LLMEngine(config=config), LLMEngine(config=config)
    files = KvFiles(default_transfer_dir(), owner="bench-disaggregation")
    one = SamplingParams(temperature=0, max_tokens=1)
    out = []
    for n, length in enumerate((256, 512, 1024, 1536)):
        ids = prefill.tokenizer.encode(long_prompt(100 + n, length))[:length]
        start = time.perf_counter()
        prefill.generate(prompt_token_ids=[ids], params=one)
        compute = time.perf_counter() - start
        t0 = time.perf_counter()
        kv = export_prefix(prefill, ids, None)
        t1 = time.perf_counter()
        name = files.write(kv)
        t2 = time.perf_counter()
        back = files.take(name)
        t3 = time.perf_counter()
        adopted = import_prefix(decode, back)
        t4 = time.perf_counter()
        assert adopted == kv.num_tokens, (adopted, kv.num_tokens)
        total = t4 - t0
        out.append(
            {
                "prompt_tokens": len(ids),
                "kv_tokens": kv.num_tokens,
                "kv_bytes": kv.nbytes,
                "export_s": t1 - t0,
                "write_s": t2 - t1,
                "read_s": t3 - t2,
                "import_s": t4 - t3,
                "handoff_us_per_token": total / kv.num_tokens * 1e6,
                "prefill_us_per_token": compute / len(ids) * 1e6,
            }
        )
    return out


def tables(results: list[dict], handoff: list[dict]) -> str:
    base = results[0]
    lines = [
        "| runners | decode token gap p50 ms | p99 ms | p99 vs unified | decode TPOT mean ms "
        "| long-prompt TTFT p50 s | max s | gaps measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['topology']} | {r['decode_gap_p50_s'] * 1e3:.1f} "
            f"| {r['decode_gap_p99_s'] * 1e3:.1f} "
            f"| {r['decode_gap_p99_s'] / base['decode_gap_p99_s']:.2f}x "
            f"| {r['decode_tpot_mean_s'] * 1e3:.1f} | {r['long_ttft_p50_s']:.2f} "
            f"| {r['long_ttft_max_s']:.2f} | {r['gaps_in_window']} |"
        )
    lines += [
        "",
        "| prompt tokens | KV MiB | export ms | write ms | read ms | import ms "
        "| handoff us/token | prefill us/token | handoff / prefill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for h in handoff:
        lines.append(
            f"| {h['prompt_tokens']} | {h['kv_bytes'] / 2**20:.1f} | {h['export_s'] * 1e3:.1f} "
            f"| {h['write_s'] * 1e3:.1f} | {h['read_s'] * 1e3:.1f} | {h['import_s'] * 1e3:.1f} "
            f"| {h['handoff_us_per_token']:.1f} | {h['prefill_us_per_token']:.1f} "
            f"| {h['handoff_us_per_token'] / h['prefill_us_per_token']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.disaggregation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
    )
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=192)
    parser.add_argument("--longs", type=int, default=6)
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--long-every", type=float, default=1.0, help="seconds")
    parser.add_argument("--kv-cache-mb", type=int, default=256, help="each runner's")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.decodes, args.decode_tokens, args.longs = 4, 96, 3
    results = [asyncio.run(run_topology(args, t)) for t in TOPOLOGIES]
    log("the handoff, in this process")
    handoff = handoff_cost(args)
    cpu = cpu_model()
    print(
        f"\nprefill/decode separation, two runners of 1 thread each, {args.dtype}; {cpu}, "
        f"{os.cpu_count()} cores (shared by both runners, the broker and this client)\n"
    )
    print(tables(results, handoff))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "cpu": cpu,
                "cores": os.cpu_count(),
                "args": vars(args),
                "results": results,
                "handoff": handoff,
            },
            indent=1,
        )
    )
    print(f"\nwritten to {RESULTS.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
