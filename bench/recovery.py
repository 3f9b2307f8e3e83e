"""How soon a SIGKILLed `sluice run` serves again, as a dynamic member of its consumer group and
as a static one (`--group-instance-id`, Kafka's group.instance.id).

Each round starts a pipeline on the default model, publishes a few long requests, waits until
their tokens flow, SIGKILLs the process, starts it again with the same flags and measures: the
restart until the process is ready (the model loaded, its topics read), and the SIGKILL until
the next event a plain client reads (the figure a user sees). A dynamic member's restart waits
for the killed member's session to expire (`--session-timeout-ms`, 10 s by default) before the
group hands its partitions on; a static member takes them back at once. Rounds alternate between
the two, so that the machine's drift falls on both alike. Against the stack at the usual
addresses (`sluice stack up` first); prints a table and writes bench/results/recovery.json.

    .venv/bin/python -m bench.recovery --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.engine_throughput import cpu_model
from sluice.connectors.settings import StackSettings
from sluice.testing.pipeline_harness import (  # the tests' plain-client harness
    PipelineProcess,
    Watcher,
    new_prefix,
    publish,
    request,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "recovery.json"
MODES = {"dynamic": [], "static": ["--group-instance-id", "bench-recovery"]}


async def one_round(bootstrap: str, mode: str, logs: Path) -> dict[str, float]:
    """One kill and restart of a fresh pipeline (its own topics and group)."""
    prefix = new_prefix()
    flags = MODES[mode]
    first = PipelineProcess(bootstrap, None, prefix, logs, *flags, name=f"{mode}-first")
    second = None
    try:
        first.wait_ready()
        async with Watcher(bootstrap, prefix) as watcher:
            ids = [f"long-{i}" for i in range(4)]
            await publish(
                bootstrap,
                f"{prefix}.requests",
                [
                    request(rid, prompt="Tell a long story.", max_tokens=400, ignore_eos=True)
                    for rid in ids
                ],
            )
            await watcher.wait_for(
                lambda s: all(len(s.events[rid]) >= 3 for rid in ids), 120, "tokens of each"
            )
            first.kill()
            killed = time.monotonic()
            await watcher.caught_up()
            seen = watcher.records
            second = PipelineProcess(bootstrap, None, prefix, logs, *flags, name=f"{mode}-again")
            second.wait_ready()
            ready = time.monotonic()
            await watcher.wait_for(lambda s: watcher.records > seen, 300, "an event after it")
            served = time.monotonic()
        return {"ready_s": ready - killed, "next_event_s": served - killed}
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="kills per mode (default 5)")
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or StackSettings().bootstrap_servers
    figures: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="sluice-recovery-") as tmp:
        for n in range(args.rounds):
            for mode in MODES:
                got = asyncio.run(one_round(bootstrap, mode, Path(tmp)))
                figures[mode].append(got)
                print(
                    f"  round {n + 1} {mode}: ready {got['ready_s']:.1f} s after the kill, "
                    f"next event {got['next_event_s']:.1f} s after it",
                    flush=True,
                )
    rows = {
        mode: {
            key: {
                "median": statistics.median(r[key] for r in rounds),
                "max": max(r[key] for r in rounds),
            }
            for key in ("ready_s", "next_event_s")
        }
        for mode, rounds in figures.items()
    }
    print(f"\nSIGKILL to serving again, {args.rounds} rounds a mode, CPU {cpu_model()}")
    print(f"{'member':10} {'ready: median':>14} {'max':>6} {'next event: median':>19} {'max':>6}")
    for mode, row in rows.items():
        ready, served = row["ready_s"], row["next_event_s"]
        print(
            f"{mode:10} {ready['median']:>12.1f} s {ready['max']:>4.1f} s "
            f"{served['median']:>17.1f} s {served['max']:>4.1f} s"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "cpu": cpu_model(),
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                "rounds": args.rounds,
                "summary": rows,
                "figures": figures,
            },
            indent=1,
        )
    )
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
