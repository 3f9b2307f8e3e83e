"""What `sluice bench` sends, and when: the requests of a dataset and their arrival times.

Datasets:

* ``random``: prompts of random words, ``--input-len`` words long (each within
  ``--range-ratio`` of it), each asking for exactly ``--output-len`` tokens (``ignore_eos``), so
  that every run of the same seed sends the same load;
* ``sample``: the chat prompts shipped with sluice (``data/chat_prompts.jsonl``, written for it),
  each asking for up to ``--output-len`` tokens;
* a path: a JSON-lines file, one request object per line (sluice's or OpenAI's shape); a line
  without ``max_tokens`` gets ``--output-len``.

Arrivals: a Poisson process at the request rate (exponential gaps, seeded), evenly spaced ones
(``--arrival constant``), or all at once (rate ``inf``).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

_WORDS = (
    "river stone lamp garden window letter market bridge cloud orchard engine harbour pencil "
    "meadow signal candle valley ticket forest ladder mirror kettle planet violin lantern "
    "compass basket thunder island needle blanket feather station silver copper winter summer "
    "morning evening quiet bright gentle rapid distant narrow golden hollow patient curious"
).split()


@dataclass
class Workload:
    dataset: str = "sample"
    num_prompts: int = 50
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    seed: int = 0
    temperature: float = 0.0


def sample_prompts() -> list[dict[str, Any]]:
    """The shipped chat prompts (sluice's own)."""
    text = resources.files("sluice.cli").joinpath("data/chat_prompts.jsonl").read_text("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _from_file(path: Path) -> list[dict[str, Any]]:
    bodies = []
    for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from None
        if not isinstance(body, dict):
            raise ValueError(f"{path} line {number}: not a request object")
        bodies.append(body)
    if not bodies:
        raise ValueError(f"{path}: no requests")
    return bodies


def requests(workload: Workload) -> list[dict[str, Any]]:
    """The request bodies of one run (without request ids), `num_prompts` of them."""
    rng = random.Random(workload.seed)
    w = workload
    if w.dataset == "random":
        low = max(1, round(w.input_len * (1 - w.range_ratio)))
        high = max(low, round(w.input_len * (1 + w.range_ratio)))
        return [
            {
                "prompt": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high))),
                "max_tokens": w.output_len,
                "ignore_eos": True,
                "temperature": w.temperature,
            }
            for _ in range(w.num_prompts)
        ]
    pool = sample_prompts() if w.dataset == "sample" else _from_file(Path(w.dataset))
    out = []
    for i in range(w.num_prompts):
        body = dict(pool[i % len(pool)])
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = w.output_len
        body.setdefault("temperature", w.temperature)
        out.append(body)
    return out


def arrival_times(count: int, rate: float, arrival: str, seed: int) -> list[float]:
    """Seconds from the start at which each of `count` requests is sent."""
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError("the request rate must be > 0 (or inf)")
    if arrival == "constant":
        return [i / rate for i in range(count)]
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times
