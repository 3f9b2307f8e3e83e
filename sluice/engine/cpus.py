"""Which CPUs the engine computes on (`EngineConfig.engine_cpus`, `--engine-cpus 0-3`), as a
llama.cpp or vLLM CPU user sets threads and their cores: one compute thread a CPU, and the rest of
the process (the event loop, the Kafka clients) kept to the other CPUs, so that serving the queue
never takes a core from a step whose threads wait for each other at every parallel region.

A thread's CPUs are inherited by the threads it starts, so a thread bound before it first
computes takes its OpenMP team (torch's and the native kernels') with it.
"""

from __future__ import annotations

import logging
import os
import re

from .errors import ConfigError

log = logging.getLogger("sluice.engine.engine")  # (the engine's start lines, under its name)

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A CPU list as taskset and cgroups write it: "0-3,6" -> (0, 1, 2, 3, 6)."""
    cpus: set[int] = set()
    for part in text.split(","):
        found = _RANGE.fullmatch(part.strip())
        first, last = (int(found[1]), int(found[2] or found[1])) if found else (0, -1)
        if last < first:
            raise ConfigError(f"{text!r} is not a CPU list such as 0-3 or 0,2", field="engine_cpus")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def allowed_cpus() -> set[int]:
    """The CPUs this thread may run on."""
    return set(os.sched_getaffinity(0))


def check_engine_cpus(cpus: tuple[int, ...]) -> None:
    missing = sorted(set(cpus) - allowed_cpus())
    if not cpus or missing:
        raise ConfigError(
            f"engine_cpus {list(cpus)}: this process may run on CPUs {sorted(allowed_cpus())} "
            f"only{f', not {missing}' if missing else ''}",
            field="engine_cpus",
        )


def bind_this_thread(cpus: tuple[int, ...] | set[int]) -> None:
    """Keep the calling thread (and the threads it starts from now on) to `cpus`."""
    os.sched_setaffinity(0, set(cpus))


def other_cpus(cpus: tuple[int, ...]) -> set[int]:
    """The CPUs this process may use besides the engine's (empty when it has no others)."""
    return allowed_cpus() - set(cpus)


def take_cpus(cpus: tuple[int, ...]) -> set[int]:
    """The engine's CPUs: one compute thread a CPU (torch's threads), the calling thread (which
    builds the engine and runs its probes) on them; returns the process's other CPUs."""
    import torch

    check_engine_cpus(cpus)
    others = other_cpus(cpus)
    torch.set_num_threads(len(cpus))
    bind_this_thread(cpus)
    log.info(
        "engine threads: %d, on CPUs %s; the rest of the process on %s",
        len(cpus),
        ",".join(map(str, cpus)),
        ",".join(map(str, sorted(others))) or "the same CPUs (no others are allowed)",
    )
    return others
