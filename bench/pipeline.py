"""The pipeline through Kafka against the engine in-process, on the same workload, in one run.

    .venv/bin/python -m bench.pipeline            # 64 requests, prompts of 32..512 tokens, 128 out
    .venv/bin/python -m bench.pipeline --quick    # 16 requests, 32..128 tokens, 32 out
    .venv/bin/python -m bench.pipeline --delivery both   # the kafka phase once per delivery mode
    .venv/bin/python -m bench.pipeline --quantization int4   # int4 weights, as stored, both sides
    .venv/bin/python -m bench.pipeline --repeats 5   # engine, kafka, engine, ...: median ratio
    .venv/bin/python -m bench.pipeline --engine-cpus 0   # the engine on CPU 0, the rest elsewhere

Phases, one after the other on this machine:
  engine   LLMEngine in this process: all requests added at once, stepped until done; TTFT and
           TPOT from the engine's own per-request timings.
  kafka    `sluice run` (all actors in one process, the real broker from `sluice stack up`) with the
           same engine settings, `--delivery` at-least-once (default), exactly-once, or both
           (one after the other, compared); a plain aiokafka client publishes all requests at
           once and reads the tokens topic (read_committed); TTFT and TPOT are measured by the
           client (publish -> first token event; first -> final event), so they include Kafka
           both ways.
Each phase then sends 8 other prompts of 64 tokens one at a time (4 tokens out): their TTFT is the
latency the Kafka path adds to a request that does not queue behind others. During each timed phase
the cores other processes kept busy are measured ("others"): on one machine the broker, Redis and
the benchmark's client take CPU from the engine, which a deployment would not.
With --engine-cpus LIST both sides' engine computes on those CPUs alone (one thread each), and the
broker, Redis, this client and `sluice run`'s event loop keep to the others: what serving the queue
costs when it does not take the engine's cores, as where the broker runs on other machines.
With --repeats N the two phases alternate N times (a fresh engine and a fresh `sluice run` each
time, the same prompts): on two shared cores one pair's ratio moved between 0.76 and 0.93 from run
to run, so the ratio reported is the median of the pairs', and the table shows the median pair.
Prompts are text (seeded random tokens decoded), so both sides tokenize the same strings. Greedy,
ignore_eos: every request produces exactly --output-len tokens on both sides.
Writes bench/results/pipeline.json, prints a table, and draws each side's TTFT and TPOT
distributions in bench/results/pipeline.png (with matplotlib: `pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench.cpu_meter import Timed
from bench.pipeline_plot import plot_pipeline
from sluice.cli.generate import cpu_list_arg
from sluice.connectors.topics import delete_topics_with_prefix
from sluice.engine.cpus import allowed_cpus, bind_this_thread

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "pipeline.json"
FIGURE = RESULTS.with_suffix(".png")
SPECIAL_TOKENS = 17


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# After the timed workload, this many requests are sent one at a time (each waits for the last to
# finish): their TTFT is the latency the Kafka path adds to a request that does not queue.
LATENCY_REQUESTS = 8
LATENCY_PROMPT = 64
LATENCY_OUTPUT = 4


def pin_process(pid: int, cpus: set[int]) -> None:
    """Keep every thread of another process to `cpus` (its new threads inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that ended meanwhile


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v is not None)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=n)
    return [
        tokenizer.decode(rng.integers(SPECIAL_TOKENS, tokenizer.vocab_size, size=int(k)).tolist())
        for k in lens
    ]


def summary(name: str, ttft: list[float], tpot: list[float], tokens: int, wall: float) -> dict:
    """One side's figures; ttft and tpot per request, in the order of the prompts."""
    return {
        "side": name,
        "requests": len(ttft),
        "output_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
        "ttft_s": ttft,
        "tpot_s": tpot,
    }


def run_engine(args, prompts: list[str], alone_prompts: list[str]) -> dict:
    from sluice.engine import EngineConfig, LLMEngine, SamplingParams

    if args.engine_cpus:
        bind_this_thread(args.all_cpus)  # (the last Kafka phase kept this thread off them)

    engine = LLMEngine(
        args.model,
        EngineConfig(
            kv_cache_bytes=args.kv_cache_mb << 20,
            dtype=args.dtype,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kernels=args.kernels,
            quantization=args.quantization,
            engine_cpus=args.engine_cpus,  # (this thread, which steps it, is kept to them)
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4))
    log(f"engine: {len(prompts)} requests in-process")
    with Timed() as timed:
        results = engine.generate(prompts, params)
    out = summary(
        "engine in-process",
        [r.timings.ttft_s for r in results],
        [r.timings.tpot_s for r in results],
        sum(len(r.token_ids) for r in results),
        timed.wall,
    )
    out["others_cores"] = timed.others_cores
    log(f"engine: {LATENCY_REQUESTS} requests one at a time")
    alone = SamplingParams(temperature=0, max_tokens=LATENCY_OUTPUT, ignore_eos=True)
    out["alone_ttft_s"] = [engine.generate([p], alone)[0].timings.ttft_s for p in alone_prompts]
    return out


async def run_kafka(args, prompts: list[str], alone_prompts: list[str], delivery: str) -> dict:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    prefix = f"bench{uuid.uuid4().hex[:8]}"
    log_path = ROOT / ".sluice" / f"bench-pipeline-{prefix}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "sluice",
        "run",
        "--topic-prefix",
        prefix,
        "--no-sessions",
        "--bootstrap-servers",
        args.bootstrap_servers,
        "--kv-cache-mb",
        str(args.kv_cache_mb),
        "--dtype",
        args.dtype,
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-in-flight",
        str(max(64, len(prompts))),
        "--kernels",
        args.kernels,
        "--delivery",
        delivery,
    ]
    cmd += ["--quantization", args.quantization or "none"]  # as the engine side runs
    if args.engine_cpus:
        cmd += ["--engine-cpus", ",".join(map(str, args.engine_cpus))]
        bind_this_thread(args.other_cpus)  # this client, as the broker, off the engine's CPUs
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
            preexec_fn=lambda: bind_this_thread(args.all_cpus),  # it binds its own threads
        )
    try:
        deadline = time.monotonic() + 180
        while " up: reading " not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"sluice run did not start; see {log_path}")
            await asyncio.sleep(0.3)
        consumer = AIOKafkaConsumer(
            f"{prefix}.tokens",
            bootstrap_servers=args.bootstrap_servers,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            isolation_level="read_committed",  # what a client of exactly-once reads
        )
        producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap_servers, linger_ms=0)
        await consumer.start()
        await producer.start()

        async def publish(rid: str, prompt: str, max_tokens: int) -> float:
            body = {
                "request_id": rid,
                "prompt": prompt,
                "temperature": 0,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            await producer.send(
                f"{prefix}.requests", key=rid.encode(), value=json.dumps(body).encode()
            )
            return time.monotonic()

        async def read_until(rids: set[str], first: dict, final: dict) -> None:
            while not rids <= set(final):
                batch = await consumer.getmany(timeout_ms=200)
                now = time.monotonic()
                for records in batch.values():
                    for record in records:
                        event = json.loads(record.value)
                        rid = event["request_id"]
                        if event["type"] == "token":
                            first.setdefault(rid, now)
                        elif event["type"] == "final":
                            final[rid] = (now, event["usage"]["completion_tokens"])
                        else:
                            raise SystemExit(f"error event: {event}")

        # Warm up the pipeline (first steps, topic metadata) outside the measurement.
        await publish("warm-up", "warm up", 4)
        await producer.flush()
        await read_until({"warm-up"}, {}, {})
        log(f"kafka ({delivery}): {len(prompts)} requests through {prefix}.requests")
        sent, first, final = {}, {}, {}
        with Timed(proc.pid) as timed:  # others: the broker, Redis, and this client
            start = time.monotonic()
            for i, prompt in enumerate(prompts):
                rid = f"r{i:03d}"
                sent[rid] = await publish(rid, prompt, args.output_len)
            await producer.flush()
            await read_until(set(sent), first, final)
            wall = max(t for t, _ in final.values()) - start
        others_cores = timed.others_cores
        log(f"kafka: {LATENCY_REQUESTS} requests one at a time")
        alone_ttft = []
        for i, prompt in enumerate(alone_prompts):
            rid, got = f"alone{i}", {}
            t = await publish(rid, prompt, LATENCY_OUTPUT)
            await producer.flush()
            await read_until({rid}, got, {})
            alone_ttft.append(got[rid] - t)
        await producer.stop()
        await consumer.stop()
    finally:
        proc.terminate()
        proc.wait(60)
        await delete_topics_with_prefix(args.bootstrap_servers, prefix)  # a broker's topics pile up
    ttft = [first[r] - sent[r] for r in sent]
    tpot = [(final[r][0] - first[r]) / max(1, final[r][1] - 1) for r in sent]
    name = "pipeline via Kafka" + (", exactly-once" if delivery == "exactly-once" else "")
    out = summary(name, ttft, tpot, sum(n for _, n in final.values()), wall)
    out.update(others_cores=others_cores, alone_ttft_s=alone_ttft)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="16 requests, 32..128 prompt tokens, 32 out"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="weights multiplied as stored by the native kernels, on both sides",
    )
    parser.add_argument(
        "--engine-cpus",
        type=cpu_list_arg,
        help="both sides' engine on these CPUs, one thread each (`--engine-cpus`), and the "
        "broker, Redis, this client and `sluice run`'s event loop on the others: the pipeline's "
        "cost when serving the queue does not share the engine's cores",
    )
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "torch", "native"],
        help="the engine's kernels on both sides (auto: native where it builds)",
    )
    parser.add_argument(
        "--delivery",
        default="at-least-once",
        choices=["at-least-once", "exactly-once", "both"],
        help="the pipeline's delivery mode (both: one kafka phase each, compared)",
    )
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="alternate the phases this many times and report the median ratio",
    )
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.prompt_min, args.prompt_max, args.output_len = 16, 32, 128, 32
    from sluice.connectors.settings import kafka_bootstrap_servers
    from sluice.connectors.stack import LocalStack
    from sluice.engine.loader import load_tokenizer

    if args.bootstrap_servers is None:
        args.bootstrap_servers = kafka_bootstrap_servers()
        if not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
            LocalStack().up()  # a no-op when it is already running
    args.all_cpus = allowed_cpus()
    if args.engine_cpus:
        args.other_cpus = args.all_cpus - set(args.engine_cpus)
        if not args.other_cpus:
            raise SystemExit("--engine-cpus: leave at least one CPU for the broker and the client")
        stack = LocalStack()
        for pid in (stack.kafka.pid(), stack.redis.pid()):
            if pid is not None:
                pin_process(pid, args.other_cpus)
        log(
            f"engine on CPUs {sorted(args.engine_cpus)}; broker, Redis, client and event loop on "
            f"{sorted(args.other_cpus)}"
        )
    tokenizer, _ = load_tokenizer(args.model)
    prompts = make_prompts(
        tokenizer, args.num_requests, args.prompt_min, args.prompt_max, args.seed
    )
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    log(
        f"{len(prompts)} prompts, {prompt_tokens} prompt tokens, "
        f"{args.output_len} output tokens each"
    )

    # prompts of their own, so the prefix cache holds none of them
    alone_prompts = make_prompts(
        tokenizer, LATENCY_REQUESTS, LATENCY_PROMPT, LATENCY_PROMPT, args.seed + 1
    )
    modes = ["at-least-once", "exactly-once"] if args.delivery == "both" else [args.delivery]
    pairs = []  # (engine, kafkas) of each repeat, interleaved so drifts hit both sides alike
    for repeat in range(args.repeats):
        if args.repeats > 1:
            log(f"repeat {repeat + 1} of {args.repeats}")
        engine = run_engine(args, prompts, alone_prompts)
        kafkas = [asyncio.run(run_kafka(args, prompts, alone_prompts, mode)) for mode in modes]
        pairs.append((engine, kafkas))
    ratios = [k[0]["throughput_tok_s"] / e["throughput_tok_s"] for e, k in pairs]
    # the median pair (of an even count, the lower of the middle two)
    engine, kafkas = pairs[sorted(range(len(pairs)), key=ratios.__getitem__)[(len(pairs) - 1) // 2]]
    kafka = kafkas[0]
    ratio = kafka["throughput_tok_s"] / engine["throughput_tok_s"]
    added_ttft_ms = (kafka["ttft_p50_s"] - engine["ttft_p50_s"]) * 1000
    alone = {s["side"]: percentile(s["alone_ttft_s"], 0.5) for s in (engine, *kafkas)}
    added_alone_ms = (alone[kafka["side"]] - alone[engine["side"]]) * 1000
    # With every request queued, a request's TTFT is mostly the steps before its first token: steps
    # slower by the wall-time ratio alone add this much at the median.
    from_slower_steps_ms = engine["ttft_p50_s"] * (kafka["wall_s"] / engine["wall_s"] - 1) * 1000
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
        "prompt_tokens": prompt_tokens,
        "sides": [engine, *kafkas],
        "throughput_ratio": ratio,
        "throughput_ratios": ratios,  # one a repeat, in order; `throughput_ratio` is their median
        "added_p50_ttft_ms": added_ttft_ms,
        "alone_p50_ttft_s": alone,
        "added_alone_p50_ttft_ms": added_alone_ms,
        "added_p50_ttft_from_slower_steps_ms": from_slower_steps_ms,
        "targets": {"throughput_ratio": ">= 0.95", "added_p50_ttft_ms": "<= 20"},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))

    print(
        f"\n{'side':<34}{'tok/s':>9}{'wall s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
        f"{'TPOT p99':>10}{'others':>8}{'alone TTFT':>12}"
    )
    for s in (engine, *kafkas):
        print(
            f"{s['side']:<34}{s['throughput_tok_s']:>9.1f}{s['wall_s']:>9.1f}"
            f"{s['ttft_p50_s'] * 1000:>8.0f}ms{s['ttft_p99_s'] * 1000:>8.0f}ms"
            f"{s['tpot_p50_s'] * 1000:>8.1f}ms{s['tpot_p99_s'] * 1000:>8.1f}ms"
            f"{s['others_cores']:>8.2f}"
            f"{alone[s['side']] * 1000:>10.0f}ms"
        )
    spread = ""
    if len(ratios) > 1:
        spread = f" (median of {len(ratios)}: " + ", ".join(f"{r:.3f}" for r in ratios) + ")"
    print(f"\nthroughput ratio (Kafka / in-process): {ratio:.3f}{spread}   (target >= 0.95)")
    print(
        f"added p50 TTFT: {added_ttft_ms:+.0f} ms   (target <= 20 ms), "
        "of which slower steps alone explain "
        f"{from_slower_steps_ms:+.0f} ms (in-process p50 TTFT x (wall-time ratio - 1))"
    )
    print(
        f"added p50 TTFT, one request at a time "
        f"({LATENCY_REQUESTS} requests of {LATENCY_PROMPT} tokens, "
        f"{LATENCY_OUTPUT} out): "
        f"{added_alone_ms:+.0f} ms"
    )
    if len(kafkas) == 2:
        alo, eos = kafkas
        eos_ratio = eos["throughput_tok_s"] / alo["throughput_tok_s"]
        eos_alone_ms = (alone[eos["side"]] - alone[alo["side"]]) * 1000
        result["exactly_once_throughput_ratio"] = eos_ratio
        result["exactly_once_added_alone_p50_ttft_ms"] = eos_alone_ms
        RESULTS.write_text(json.dumps(result, indent=2))
        print(
            f"exactly-once / at-least-once throughput: {eos_ratio:.3f}   (target >= 0.9); "
            f"added p50 TTFT of a request that does not queue: {eos_alone_ms:+.0f} ms "
            "(target <= commit interval + 20 ms)"
        )
    print(
        "others = cores other processes kept busy during the timed phase (Kafka side: the broker, "
        "Redis and this client, which share this machine's CPUs with the engine)"
    )
    print(f"written: {RESULTS.relative_to(ROOT)}")
    if plot_pipeline(result, FIGURE):
        print(f"drawn: {FIGURE.relative_to(ROOT)} (TTFT and TPOT of every request, both sides)")
    else:
        print('no figure: matplotlib is not installed (pip install -e ".[bench]")')


if __name__ == "__main__":
    main()
