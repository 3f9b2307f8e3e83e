"""How busy the machine's CPUs were during a timed phase, and how much of that was someone else.

This machine is shared: a phase whose cores were taken by other processes (another benchmark, the
Kafka broker, a client) is slower for that alone, so the benchmarks report it beside each figure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_busy_s() -> float:
    """CPU seconds all processes of the machine have been busy (from /proc/stat)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int | str = "self") -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Timed:
    """Wall time, the CPU time of process `pid` (this one by default), and how many cores *other*
    processes kept busy meanwhile."""

    def __init__(self, pid: int | str = "self"):
        self.pid = pid

    def __enter__(self):
        self.wall, self.cpu, self.busy = time.perf_counter(), process_cpu_s(self.pid), cpu_busy_s()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = process_cpu_s(self.pid) - self.cpu
        self.others_cores = (
            max(0.0, (cpu_busy_s() - self.busy - self.cpu) / self.wall) if self.wall else 0.0
        )

    def as_dict(self) -> dict:
        return {"elapsed_s": self.wall, "cpu_s": self.cpu, "others_cores": self.others_cores}
