"""`sluice run --engine-cpus`: the engine computes on its CPU alone, and the process's event loop
(with the Kafka clients on it) keeps to the other CPUs, so serving the queue never takes the core a
step is computing on."""

from __future__ import annotations

import os
from pathlib import Path

from sluice.testing.pipeline_harness import PipelineProcess, Watcher, new_prefix, publish, request


def cpus_of(pid: int, tid: int) -> set[int]:
    """The CPUs thread `tid` of process `pid` may run on (its Cpus_allowed_list)."""
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = part.partition("-")
                cpus.update(range(int(lo), int(hi or lo) + 1))
            return cpus
    raise KeyError("Cpus_allowed_list")


async def test_the_event_loop_keeps_off_the_engines_cpu(bootstrap_servers, tmp_path):
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, "this test needs a machine with two CPUs or more"
    cpu, prefix = min(allowed), new_prefix()
    process = PipelineProcess(
        bootstrap_servers, None, prefix, tmp_path, "--engine-cpus", str(cpu), name="engine-cpus"
    )
    try:
        process.wait_ready()
        async with Watcher(bootstrap_servers, prefix) as watcher:
            body = dict(prompt="The capital of France is", max_tokens=6, temperature=0)
            await publish(bootstrap_servers, f"{prefix}.requests", [request("cpus-1", **body)])
            streams = await watcher.wait_finals({"cpus-1"}, timeout=180)
        pid = process.pid
        threads = {
            int(t.name): cpus_of(pid, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()
        }
    finally:
        code = process.stop()
    assert code == 0, process.tail()
    (final,) = streams.finals("cpus-1")
    assert final["type"] == "final" and final["usage"]["completion_tokens"] == 6
    assert threads[pid] == allowed - {cpu}, threads  # the main thread runs the event loop
    assert [t for t, cpus in threads.items() if cpus == {cpu}], threads  # the step thread
    assert f"engine threads: 1, on CPUs {cpu}" in process.text()
