"""The harness on generated tasks (`bench/harness_tasks.py`): accuracy of the model alone, with the
sandboxed python tool (its first turn held to a call), and with self-consistency over that; turns,
tool calls, tokens and seconds per task and per solved task; and what the harness itself adds,
read from the Kafka records' timestamps: each move (from the record it read, a turn's final event
or a tool's result, to the first record it published in answer) and each tool call's round trip
beyond the tool's own time (harness → worker → harness, through Kafka).

It starts the pipeline on `--model`, workers of the python tool and the harness service against
the stack at the usual addresses (`sluice stack up` first), runs the tasks (one at a time, or
`--concurrency` in flight to fill the engine's batch), prints a table and writes JSON
(bench/results/harness.json). Accuracy means something on a model that calls tools
(Qwen2.5-Coder 1.5B: `sluice models pull qwen2.5-coder-1.5b`; about 10-25 s a turn on two cores);
the overhead figures hold on any model, the default one included.

    .venv/bin/python -m bench.harness --model qwen2.5-coder-1.5b --tasks 100 --concurrency 8
    .venv/bin/python -m bench.harness --tasks 10 --modes python      # overhead, default model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bench.engine_throughput import cpu_model
from bench.harness_tasks import Task, tasks
from sluice.connectors.settings import StackSettings
from sluice.connectors.topics import ensure_topics
from sluice.tools.python_tool import DEFINITION as PYTHON

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "harness.json"
SYSTEM = (
    "Solve the task. When a computation helps, call the python tool with a program that prints "
    "the result. End your answer with the result alone on its last line."
)
SYSTEM_ALONE = "Solve the task. End your answer with the result alone on its last line."
MODES = ("alone", "python", "self-consistency")
PYTHON_TOOL = "sluice.tools.python_tool:python"


def run_request(task: Task, mode: str, max_tokens: int) -> dict[str, Any]:
    """What a task is asked as: a harness run, or (mode "alone") a plain chat request to the
    pipeline, with no tools offered, so that the model does not even know of one."""
    if mode == "alone":
        return {
            "request_id": f"{task.id}-alone-{uuid.uuid4().hex[:6]}",
            "messages": [
                {"role": "system", "content": SYSTEM_ALONE},
                {"role": "user", "content": task.question},
            ],
            "max_tokens": max_tokens,
            "seed": 1,
            "stream": False,
        }
    body: dict[str, Any] = {
        "run_id": f"{task.id}-{mode}-{uuid.uuid4().hex[:6]}",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task.question},
        ],
        "tools": [PYTHON],
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "max_steps": 4,
        "seed": 1,
    }
    if mode == "self-consistency":
        pattern = r"-?\d[\d,]*" if task.kind == "arithmetic" else r"[A-Za-z]{2,}"
        body |= {
            "temperature": 0.7,
            "verifier": {"type": "self-consistency", "n": 3, "answer_pattern": pattern},
        }
    return body


class Services:
    """The pipeline, a python tool worker and the harness, as subprocesses logging to files."""

    def __init__(self, model: str | None, prefix: str, logs: Path, tool_workers: int):
        kafka = ["--topic-prefix", prefix]
        run = ["run", "--no-sessions", "--group", prefix, *kafka]  # (a group of its own)
        run += ["--model", model] if model else []
        self.started: list[subprocess.Popen] = []
        self.logs = logs
        self._start("pipeline", " up: reading ", run)
        for i in range(tool_workers):
            self._start(f"python{i}", "serving python", ["tools", "serve", PYTHON_TOOL, *kafka])
        self._start("harness", "harness serving", ["agent", "serve", *kafka])

    def _start(self, name: str, ready: str, args: list[str]) -> None:
        log = self.logs / f"bench-harness-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sluice", *args], stdout=out, stderr=subprocess.STDOUT
            )
        self.started.append(proc)
        deadline = time.monotonic() + 600
        print(f"starting {name} (log: {log})", flush=True)
        while ready not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name} did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        for proc in self.started:
            proc.terminate()
        for proc in self.started:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


async def run_all(
    bootstrap: str, prefix: str, requests: list[dict], concurrency: int
) -> list[dict]:
    """Ask for the runs (or plain requests), `concurrency` of them in flight at once, in order;
    each one's final, as a harness final, with its own wall time."""
    alone = "request_id" in requests[0]
    ask, read = (
        (f"{prefix}.requests", f"{prefix}.replies.bench")
        if alone
        else (f"{prefix}.harness", f"{prefix}.harness-events")
    )
    await ensure_topics(bootstrap, {ask: 4, read: 4})
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await consumer.start()
    await producer.start()
    finals: dict[str, dict] = {}
    started: dict[str, float] = {}  # in flight: name -> when it was asked
    names = [body.get("run_id") or body["request_id"] for body in requests]
    try:
        tps = [TopicPartition(read, p) for p in range(4)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)
        waiting = list(zip(names, requests))
        while len(finals) < len(requests):
            while waiting and len(started) < concurrency:
                name, body = waiting.pop(0)
                if alone:
                    body = {**body, "reply_topic": read}
                started[name] = time.monotonic()
                await producer.send_and_wait(ask, json.dumps(body).encode(), key=name.encode())
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                for r in batch:
                    event = json.loads(r.value)
                    for name in list(started):
                        final = _final_of(event, name)
                        if final is None:
                            continue
                        final["wall_s"] = time.monotonic() - started.pop(name)
                        finals[name] = final
                        print(
                            f"  [{len(finals)}/{len(requests)}] {name}: {final['stop_reason']}, "
                            f"{final['steps']} turns, {final['wall_s']:.1f} s",
                            flush=True,
                        )
    finally:
        await producer.stop()
        await consumer.stop()
    return [finals[name] for name in names]


def _final_of(event: dict, name: str) -> dict | None:
    """A run's final, or a plain request's final event made to look like one."""
    if event.get("type") == "harness_final" and event["run_id"] == name:
        return event
    if event.get("type") in ("final", "error") and event.get("request_id") == name:
        usage = event.get("usage") or {}
        return {
            "answer": event.get("text", ""),
            "stop_reason": "error"
            if event["type"] == "error"
            else "answer"
            if event.get("finish_reason") == "stop"
            else "max_tokens",
            "steps": 1,
            "tool_calls": 0,
            "completion_tokens": usage.get("completion_tokens", 0),
        }
    return None


async def records(bootstrap: str, topics: list[str]) -> dict[str, list[tuple[int, dict]]]:
    """Every record of `topics`: (timestamp ms, value) each, by topic."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    found: dict[str, list[tuple[int, dict]]] = {t: [] for t in topics}
    try:
        cluster = await consumer._client.fetch_all_metadata()  # (not subscribed: ask)
        tps = [
            TopicPartition(t, p)
            for t in topics
            for p in sorted(cluster.partitions_for_topic(t) or [])
        ]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        left = {tp for tp in tps if ends[tp] > 0}
        while left:
            for tp, batch in (await consumer.getmany(timeout_ms=1000)).items():
                for r in batch:
                    try:
                        found[tp.topic].append((r.timestamp, json.loads(r.value)))
                    except (TypeError, ValueError):
                        pass
            for tp in list(left):
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
    finally:
        await consumer.stop()
    return found


def overheads(found: dict[str, list[tuple[int, dict]]], prefix: str) -> dict[str, list[float]]:
    """The harness's moves, and per tool call the round trip beyond the tool's own time, in
    ms."""
    first: dict[tuple[str, str], int] = {}  # (what, name) -> the first record's timestamp

    def note(what: str, name: str, ts: int) -> None:
        first.setdefault((what, name), ts)

    for ts, m in found[f"{prefix}.requests"]:
        note("turn", m.get("request_id", ""), ts)
    for ts, m in found[f"{prefix}.replies.harness"]:
        if m.get("type") == "final":
            note("reply", m["request_id"], ts)
    for ts, m in found[f"{prefix}.tools.python"]:
        note("call", m["key"], ts)
    results: dict[str, tuple[int, dict]] = {}
    for ts, m in found[f"{prefix}.tool-results"]:
        results.setdefault(m["key"], (ts, m))
    for ts, m in found[f"{prefix}.harness-events"]:
        if m.get("type") == "harness_final":
            note("final", m["run_id"], ts)
        elif m.get("kind") == "model":
            note("model_step", f"{m['run_id']}.m{m['step']}", ts)
    moves, trips = [], []
    for (what, name), ts in first.items():
        if what == "reply" and ("model_step", name) in first:
            moves.append(first[("model_step", name)] - ts)  # a turn's final -> its move
    turns: dict[tuple[str, str], list[str]] = {}  # (run, step) -> its calls' keys
    for key in results:
        run, step, _ = key.rsplit("/", 2)
        turns.setdefault((run, step), []).append(key)
    # a call out and back, less the tool's own time and any wait behind another call its worker
    # ran first (a worker runs its calls one at a time: that wait is the tools' capacity)
    free: dict[str, int] = {}  # worker -> when its last answer was published
    for key, (ts, m) in sorted(results.items(), key=lambda kv: kv[1][0]):
        if ("call", key) in first:
            began = max(first[("call", key)], free.get(m.get("worker", ""), 0))
            trips.append(ts - began - 1000 * m.get("seconds", 0.0))
        free[m.get("worker", "")] = ts
    for (run, step), keys in turns.items():
        last = max(results[k][0] for k in keys)
        # the turn's last result -> the next turn (or the final)
        after = first.get(("turn", f"{run}.m{int(step) + 1}")) or first.get(("final", run))
        if after is not None:
            moves.append(after - last)
    return {"move_ms": moves, "tool_trip_ms": trips}


def summary(mode: str, chosen: list[Task], finals: list[dict], seconds: float) -> dict[str, Any]:
    """A mode's figures; `seconds` is its whole wall time, so that with several tasks in flight
    the seconds per task are the machine's, not each task's latency (reported apart)."""
    solved = [f for t, f in zip(chosen, finals) if t.solved_by(f["answer"])]
    tokens = sum(f["completion_tokens"] for f in finals)
    return {
        "mode": mode,
        "tasks": len(finals),
        "solved": len(solved),
        "accuracy": len(solved) / len(finals) if finals else 0.0,
        "turns_per_task": statistics.mean(f["steps"] for f in finals),
        "tool_calls_per_task": statistics.mean(f["tool_calls"] for f in finals),
        "tokens_per_solved": tokens / len(solved) if solved else None,
        "seconds_per_solved": seconds / len(solved) if solved else None,
        "seconds_per_task": seconds / len(finals),
        "latency_s": quantiles([f["wall_s"] for f in finals]),
        "stop_reasons": {
            r: sum(f["stop_reason"] == r for f in finals)
            for r in {f["stop_reason"] for f in finals}
        },
    }


def quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median": None, "p90": None, "max": None}
    ordered = sorted(values)
    return {
        "n": len(values),
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
    }


def prefix_reuse(found: dict[str, list[tuple[int, dict]]], prefix: str) -> dict[str, Any]:
    """How much of the later turns' prompts came from the prefix cache (their KV kept from the
    turn before): cached over prompt tokens of every turn after a run's first."""
    seen: dict[str, dict] = {}
    for _, m in found[f"{prefix}.replies.harness"]:
        if m.get("type") == "final" and m.get("request_id", "").rpartition(".m")[2] not in (
            "",
            "0",
        ):
            seen.setdefault(m["request_id"], m["usage"])
    prompt = sum(u["prompt_tokens"] for u in seen.values())
    cached = sum(u.get("cached_tokens", 0) for u in seen.values())
    return {"turns": len(seen), "prompt_tokens": prompt, "cached_tokens": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the default model (overhead only)")
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--max-tokens", type=int, default=300, help="a turn's most tokens")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="tasks in flight at once (default 1; more fills the engine's batch: the accuracy is "
        "the same kind of figure, the seconds per task become throughput)",
    )
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    assert set(modes) <= set(MODES), modes
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or StackSettings().bootstrap_servers
    prefix = f"bench-harness-{uuid.uuid4().hex[:6]}"
    logs = ROOT / ".sluice"
    logs.mkdir(exist_ok=True)
    chosen = tasks(args.tasks)
    # a worker per task in flight, up to the tool topic's 4 partitions: calls do not queue
    services = Services(args.model, prefix, logs, min(args.concurrency, 4))
    rows, per_task = [], {}
    try:
        for mode in modes:
            print(f"{mode}: {len(chosen)} tasks", flush=True)
            requests = [run_request(t, mode, args.max_tokens) for t in chosen]
            began = time.monotonic()
            finals = asyncio.run(run_all(bootstrap, prefix, requests, args.concurrency))
            rows.append(summary(mode, chosen, finals, time.monotonic() - began))
            per_task[mode] = [
                {
                    "task": t.id,
                    "expected": t.answer,
                    "solved": t.solved_by(f["answer"]),
                    **{
                        k: f[k]
                        for k in (
                            "answer",
                            "stop_reason",
                            "steps",
                            "tool_calls",
                            "completion_tokens",
                            "wall_s",
                        )
                    },
                }
                for t, f in zip(chosen, finals)
            ]
    finally:
        services.stop()
    topics = [
        f"{prefix}.{t}"
        for t in ("requests", "replies.harness", "tools.python", "tool-results", "harness-events")
    ]
    found = asyncio.run(records(bootstrap, topics))
    cost = {k: quantiles(v) for k, v in overheads(found, prefix).items()}
    reuse = prefix_reuse(found, prefix)
    turn_s = [f["wall_s"] / max(1, f["steps"]) for m in per_task.values() for f in m]

    print(
        f"\nharness on {len(chosen)} tasks ({args.concurrency} in flight), model "
        f"{args.model or 'default'}, CPU {cpu_model()}"
    )
    print(
        f"{'mode':18} {'accuracy':>9} {'turns':>6} {'calls':>6} {'tok/solved':>11} "
        f"{'s/solved':>9} {'s/task':>7} {'latency':>8}"
    )
    for r in rows:
        tok = f"{r['tokens_per_solved']:.0f}" if r["tokens_per_solved"] else "-"
        sec = f"{r['seconds_per_solved']:.1f}" if r["seconds_per_solved"] else "-"
        print(
            f"{r['mode']:18} {r['solved']:>4}/{r['tasks']:<4} {r['turns_per_task']:>6.2f} "
            f"{r['tool_calls_per_task']:>6.2f} {tok:>11} {sec:>9} {r['seconds_per_task']:>7.1f} "
            f"{r['latency_s']['median']:>8.1f}"
        )
    print("(s/solved and s/task: the mode's wall time shared out; latency: a task's median, s)")
    move, trip = cost["move_ms"], cost["tool_trip_ms"]
    print(
        f"\nharness move (read → published): median {move['median']} ms, p90 {move['p90']} ms, "
        f"max {move['max']} ms over {move['n']} moves; a turn takes "
        f"{statistics.median(turn_s):.2f} s (median)"
    )
    print(
        f"tool call round trip beyond the tool's time: median {trip['median']} ms, "
        f"p90 {trip['p90']} ms over {trip['n']} calls"
    )
    if reuse["prompt_tokens"]:
        share = 100 * reuse["cached_tokens"] / reuse["prompt_tokens"]
        print(
            f"later turns' prompts from the prefix cache: {reuse['cached_tokens']} of "
            f"{reuse['prompt_tokens']} tokens ({share:.0f} %, {reuse['turns']} turns)"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "cpu": cpu_model(),
                "model": args.model or "default",
                "concurrency": args.concurrency,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                "modes": rows,
                "overhead": cost,
                "later_turns_prefix_reuse": reuse,
                "median_turn_s": statistics.median(turn_s),
                "tasks": per_task,
            },
            indent=1,
        )
    )
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
