"""The delivery guarantees at scale, under faults, on a broker and a Redis of the benchmark's own.

    .venv/bin/python -m bench.chaos                       # exactly-once, the full figures
    .venv/bin/python -m bench.chaos --delivery both       # each mode in turn
    .venv/bin/python -m bench.chaos --quick               # 4 kills, 60 requests, 1,000 fuzzed

Phases, for each delivery mode, against one `sluice run` (all actors, sessions in Redis):
  kills  N requests published at once (greedy, seeded and unseeded sampled, a sixth of them turns
         of 3-turn chat sessions); `sluice run` is SIGKILLed K times while they are generated and
         started again, the broker is SIGKILLed and restarted once (after a third of the kills),
         and Redis is down for 3 s once (after two thirds). Recovery: from each SIGKILL to the
         next event the client reads.
  fuzz   F malformed messages (the fuzz test's mutations and nasty inputs), a valid request after
         every 200: each must get its error event.
  burst  B requests at once (10x the usual 64) while the pipeline's RSS is sampled every 0.25 s.
A plain aiokafka client publishes and reads (read_committed under exactly-once). Counted: lost
requests (no final), visible duplicates ((request_id, type, seq) read twice), conflicts (a
(request_id, seq) read with two contents), bad inputs answered, peak RSS. Targets: 0 lost,
0 visible duplicates under exactly-once, 0 conflicts, every bad input answered, RSS bounded.
Writes bench/results/chaos.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from sluice.connectors.kafka_broker import LocalKafka
from sluice.connectors.redis_server import LocalRedis
from sluice.testing.bad_messages import bad_message
from sluice.testing.pipeline_harness import (  # the tests' plain-client harness
    PipelineProcess,
    Streams,
    Watcher,
    private_stack,
    publish,
    request,
    sigkill,
)

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "chaos.json"
SUBJECTS = ["the sea", "a robot", "coffee", "the moon", "trains", "cats", "rain", "music"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def workload(n: int, tag: str, rng: random.Random) -> list[dict]:
    """n requests: a sixth are turns of 3-turn sessions, the rest mixed sampling, 16..128
    tokens (long enough that every kill finds streams half done)."""
    out = []
    for i in range(n):
        body = {
            "request_id": f"{tag}-{i:04d}",
            "max_tokens": rng.randrange(16, 129),
            "ignore_eos": True,
            "temperature": 0 if i % 3 == 0 else 1.0,
        }
        if i % 3:
            body["top_p"] = 0.95
        if i % 3 == 1:
            body["seed"] = rng.randrange(2**31)
        if i % 6 == 5:
            session = f"{tag}-s{i // 18}"
            body.update(
                session_id=session,
                messages=[
                    {"role": "user", "content": f"Turn {i}: one word about {SUBJECTS[i % 8]}."}
                ],
            )
        else:
            body["prompt"] = f"Item {i}: a few words about {SUBJECTS[i % len(SUBJECTS)]},"
        out.append(body)
    return out


def messages_of(bodies: list[dict]) -> list[tuple[bytes, bytes]]:
    return [
        request(b["request_id"], **{k: v for k, v in b.items() if k != "request_id"})
        for b in bodies
    ]


def count_streams(streams: Streams, ids: list[str]) -> dict:
    """Lost, visible duplicates and conflicting contents among the requests `ids`."""
    lost = duplicates = conflicts = 0
    for rid in ids:
        events = streams.events.get(rid, [])
        if not [e for e in events if e["type"] == "final"]:
            lost += 1
        seen: dict[tuple, str] = {}
        for e in events:
            key = (e["type"], e["seq"], e.get("index", 0))
            content = json.dumps([e.get("token_ids"), e.get("text")])
            if key in seen:
                duplicates += 1
                conflicts += seen[key] != content
            seen[key] = content
    return {
        "requests": len(ids),
        "lost": lost,
        "visible_duplicates": duplicates,
        "conflicts": conflicts,
    }


async def run_mode(args, delivery: str, home: Path) -> dict:
    settings = private_stack(home / delivery)
    kafka, redis = LocalKafka(settings), LocalRedis(settings)
    await asyncio.to_thread(kafka.start)
    await asyncio.to_thread(redis.start)
    bootstrap, prefix = settings.bootstrap_servers, f"chaos{int(time.time())}"
    exactly_once = delivery == "exactly-once"
    extra = ["--delivery", delivery, "--dtype", args.dtype]
    processes: list[PipelineProcess] = []
    logs = home / delivery / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def start(name: str) -> PipelineProcess:
        process = PipelineProcess(bootstrap, settings.redis_url, prefix, logs, *extra, name=name)
        processes.append(process)
        process.wait_ready(timeout=300)
        return process

    rng = random.Random(args.seed)
    result: dict = {"delivery": delivery}
    try:
        current = await asyncio.to_thread(start, "first")
        isolation = "read_committed" if exactly_once else "read_uncommitted"
        async with Watcher(bootstrap, prefix, isolation) as watcher:
            # -- kills --------------------------------------------------------------------------
            bodies = workload(args.requests, "k", rng)
            ids = [b["request_id"] for b in bodies]
            log(
                f"{delivery}: {len(ids)} requests, {args.kills} SIGKILLs, "
                "a broker restart, a Redis outage"
            )
            started = time.monotonic()
            await publish(bootstrap, f"{prefix}.requests", messages_of(bodies))
            recoveries, step = [], max(1, len(ids) // (args.kills + 1))
            outages = {"broker_restarts": 0, "redis_outages": 0}
            for k in range(args.kills):
                target = (k + 1) * step
                deadline = time.monotonic() + 60
                while sum(1 for r in ids if watcher.streams.finals(r)) < target:
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                if all(watcher.streams.finals(r) for r in ids):
                    log(f"every request finished before kill {k + 1}: no more kills")
                    break
                killed_at, records = time.monotonic(), watcher.records
                current.kill()
                current = await asyncio.to_thread(start, f"after-kill-{k + 1}")
                while watcher.records == records and time.monotonic() - killed_at < 300:
                    await asyncio.sleep(0.05)
                recoveries.append(time.monotonic() - killed_at)
                log(f"kill {k + 1}: next event {recoveries[-1]:.1f} s after the SIGKILL")
                if k == args.kills // 3:
                    await sigkill(kafka.pid())
                    await asyncio.to_thread(kafka.start)
                    outages["broker_restarts"] += 1
                    log("broker SIGKILLed and restarted")
                if k == 2 * args.kills // 3:
                    await sigkill(redis.pid())
                    await asyncio.sleep(3)
                    await asyncio.to_thread(redis.start)
                    outages["redis_outages"] += 1
                    log("Redis down for 3 s, restarted")
            await watcher.wait_finals(set(ids), timeout=args.timeout)
            result["kills"] = {
                **count_streams(watcher.streams, ids),
                "sigkills": len(recoveries),
                **outages,
                "recovery_s": [round(r, 2) for r in recoveries],
                "wall_s": round(time.monotonic() - started, 1),
            }

            # -- fuzz ---------------------------------------------------------------------------
            log(f"{delivery}: {args.fuzz} malformed messages")
            fuzz_rng = random.Random(args.seed + 1)
            expected_rids, expected_letters, valid_ids = [], 0, []
            messages: list[tuple[bytes | None, bytes]] = []
            for i in range(args.fuzz):
                payload, rid, _ = bad_message(i, fuzz_rng)
                if rid is None:
                    expected_letters += 1
                else:
                    expected_rids.append(rid)
                messages.append((None, payload))
                if i % 200 == 199:
                    body = {
                        "request_id": f"valid-{i}",
                        "prompt": "Say one word.",
                        "temperature": 0,
                        "max_tokens": 3,
                    }
                    valid_ids.append(body["request_id"])
                    messages.append((body["request_id"].encode(), json.dumps(body).encode()))
            letters_before = len(watcher.streams.dead_letters)
            started = time.monotonic()
            await publish(bootstrap, f"{prefix}.requests", messages)

            def answered(s: Streams) -> bool:
                return len(s.dead_letters) - letters_before >= expected_letters and all(
                    s.finals(r) for r in (*expected_rids, *valid_ids)
                )

            with contextlib.suppress(AssertionError):
                await watcher.wait_for(answered, args.timeout, "an answer to every bad message")
            await watcher.caught_up()
            got = sum(1 for r in expected_rids if watcher.streams.finals(r))
            letters = len(watcher.streams.dead_letters) - letters_before
            result["fuzz"] = {
                "bad_inputs": args.fuzz,
                "answered": got + min(letters, expected_letters),
                "error_events": sum(len(watcher.streams.finals(r)) for r in expected_rids)
                + letters,
                "valid_between": len(valid_ids),
                "valid_completed": sum(1 for r in valid_ids if watcher.streams.finals(r)),
                "wall_s": round(time.monotonic() - started, 1),
            }

            # -- burst --------------------------------------------------------------------------
            log(f"{delivery}: a burst of {args.burst} requests, RSS sampled")
            burst = [
                {
                    "request_id": f"b-{i:04d}",
                    "prompt": f"Burst {i}: {SUBJECTS[i % 8]} is",
                    "max_tokens": 16,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                for i in range(args.burst)
            ]
            before = current.proc_status("VmRSS") / 1024
            samples = [before]
            started = time.monotonic()
            await publish(bootstrap, f"{prefix}.requests", messages_of(burst))
            burst_ids = {b["request_id"] for b in burst}
            while not all(watcher.streams.finals(r) for r in burst_ids):
                samples.append(current.proc_status("VmRSS") / 1024)
                if time.monotonic() - started > args.timeout:
                    break
                await asyncio.sleep(0.25)
            result["burst"] = {
                **count_streams(watcher.streams, sorted(burst_ids)),
                "rss_before_mib": round(before, 1),
                "rss_peak_mib": round(max(samples), 1),
                "wall_s": round(time.monotonic() - started, 1),
            }
        current.stop()
    finally:
        for process in processes:
            process.kill()
        await asyncio.to_thread(kafka.stop)
        await asyncio.to_thread(redis.stop)
    return result


def table(results: list[dict]) -> str:
    rows = [
        ("requests through the kills", lambda r: r["kills"]["requests"], ""),
        (
            "SIGKILLs / broker restarts / Redis outages",
            lambda r: "{sigkills} / {broker_restarts} / {redis_outages}".format(**r["kills"]),
            "",
        ),
        ("lost", lambda r: r["kills"]["lost"] + r["burst"]["lost"], "0"),
        (
            "visible duplicates",
            lambda r: r["kills"]["visible_duplicates"] + r["burst"]["visible_duplicates"],
            "0 (exactly-once)",
        ),
        ("conflicting contents", lambda r: r["kills"]["conflicts"] + r["burst"]["conflicts"], "0"),
        (
            "recovery after a kill, median s",
            lambda r: sorted(r["kills"]["recovery_s"])[len(r["kills"]["recovery_s"]) // 2],
            "",
        ),
        ("recovery after a kill, max s", lambda r: max(r["kills"]["recovery_s"]), ""),
        (
            "bad inputs -> answered",
            lambda r: f"{r['fuzz']['bad_inputs']} -> {r['fuzz']['answered']}",
            "all",
        ),
        ("error events for them", lambda r: r["fuzz"]["error_events"], "one each (exactly-once)"),
        (
            "valid requests between them completed",
            lambda r: f"{r['fuzz']['valid_completed']}/{r['fuzz']['valid_between']}",
            "all",
        ),
        ("burst requests", lambda r: r["burst"]["requests"], ""),
        (
            "RSS before -> peak in the burst, MiB",
            lambda r: f"{r['burst']['rss_before_mib']:.0f} -> {r['burst']['rss_peak_mib']:.0f}",
            "bounded",
        ),
        ("burst wall s", lambda r: r["burst"]["wall_s"], ""),
    ]
    head = "| | " + " | ".join(r["delivery"] for r in results) + " | target |"
    lines = [head, "|---" * (len(results) + 2) + "|"]
    for name, get, target in rows:
        lines.append(f"| {name} | " + " | ".join(str(get(r)) for r in results) + f" | {target} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--delivery", choices=["at-least-once", "exactly-once", "both"], default="exactly-once"
    )
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--fuzz", type=int, default=10_000)
    parser.add_argument("--burst", type=int, default=640)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--quick", action="store_true", help="4 kills, 60 requests, 1,000 fuzzed, a burst of 160"
    )
    args = parser.parse_args()
    if args.quick:
        args.kills, args.requests, args.fuzz, args.burst = 4, 60, 1000, 160
    modes = ["at-least-once", "exactly-once"] if args.delivery == "both" else [args.delivery]
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="sluice-chaos-") as tmp:
        for mode in modes:
            results.append(asyncio.run(run_mode(args, mode, Path(tmp))))
    out = {"cpu": cpu, "args": vars(args), "results": results}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"\nCPU: {cpu}, dtype {args.dtype}\n")
    print(table(results))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
