"""The device section of bench/gpu.py: facts about the machine (names, versions, clocks) and the
memory bandwidth that the kernel and engine numbers are measured against."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time

import torch

from bench.gpu_common import Ctx


def device_facts(ctx: Ctx) -> dict:
    facts: dict = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(ctx.device),
        "smoke": ctx.smoke,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    try:
        import triton

        facts["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        facts["triton"] = f"unavailable ({e})"
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        facts.update(
            name=p.name,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
        facts["l2_mib"] = round(getattr(p, "L2_cache_size", 0) / 2**20, 1)
        try:
            q = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,"
                    "power.limit,temperature.gpu",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=10,
            )
            facts["nvidia_smi"] = q.stdout.strip()
        except Exception as e:  # noqa: BLE001
            facts["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    else:
        facts.update(name=platform.processor() or platform.machine(), cpus=os.cpu_count())
    return facts


def bandwidth(ctx: Ctx) -> dict:
    """Device-to-device copy (bytes read + written per second), read-only (a sum) and write-only (a
    fill) rates, each the median of many runs."""
    nbytes = (16 << 20) if ctx.smoke else (1 << 30)
    src = (
        torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=ctx.device)
        if ctx.smoke
        else torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    )
    dst = torch.empty_like(src)
    as_f32 = src.view(torch.float32)
    res = {"bytes": nbytes}
    for name, fn, moved in (
        ("copy", lambda: dst.copy_(src), 2 * nbytes),
        ("read", lambda: as_f32.sum(), nbytes),
        ("write", lambda: dst.fill_(7), nbytes),
    ):
        if ctx.cuda:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(20)
            ]
            for s, e in ev:
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            ms = statistics.median(s.elapsed_time(e) for s, e in ev)
        else:
            fn()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            ms = 1e3 * statistics.median(ts)
        res[f"{name}_ms"] = ms
        res[f"{name}_gbs"] = moved / ms / 1e6
    return res
