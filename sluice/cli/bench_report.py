"""What `sluice bench` reports of one run: throughput, latency percentiles and goodput, as the
client saw them (its own clock, from just before it published each request).

Per request: TTFT (publish to the first token event), TPOT (after the first token, the mean time
per further token), ITL (the gaps between its token events), end-to-end latency (publish to the
final event). Goodput is the rate of requests that met every SLO given (``--slo
ttft=500ms,tpot=50ms,e2e=10s``); a request that failed meets none.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
SLO_NAMES = ("ttft", "tpot", "e2e")


@dataclass
class RequestTimes:
    """One request as the client saw it (seconds, its own monotonic clock)."""

    sent: float
    token_times: list[float] = field(default_factory=list)  # one per token event
    done: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.done is not None and self.error is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or not self.token_times or self.done is None:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=500ms,tpot=50ms,e2e=10s`` -> seconds per name."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        if name not in SLO_NAMES:
            raise ValueError(f"--slo: {name!r} is not one of {', '.join(SLO_NAMES)}")
        match = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s)?\s*", value)
        if not match:
            raise ValueError(f"--slo: {part!r}: give a duration such as 500ms or 2s")
        number = float(match.group(1))
        out[name] = number / 1000 if match.group(2) == "ms" else number
    return out


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile, linearly interpolated between the closest ranks (as numpy's)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _summary(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p)
    return out


def meets(times: RequestTimes, slo: dict[str, float]) -> bool:
    if not times.ok:
        return False
    for name, limit in slo.items():
        value = getattr(times, name)
        if value is not None and value > limit:
            return False
    return True


def report(
    times: list[RequestTimes], rate: float, slo: dict[str, float], max_concurrency: int | None
) -> dict[str, Any]:
    """The figures of one run at one offered rate."""
    done = [t for t in times if t.ok]
    start = min((t.sent for t in times), default=0.0)
    end = max((t.done for t in done if t.done is not None), default=start)
    duration = max(end - start, 1e-9)
    output = sum(t.output_tokens for t in done)
    prompt = sum(t.prompt_tokens for t in done)
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": max_concurrency,
        "requests": len(times),
        "completed": len(done),
        "failed": len(times) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "goodput": sum(meets(t, slo) for t in times) / duration if slo else None,
        "slo": slo or None,
        "ttft_s": _summary([t.ttft for t in done if t.ttft is not None]),
        "tpot_s": _summary([t.tpot for t in done if t.tpot is not None]),
        "itl_s": _summary([gap for t in done for gap in t.itls]),
        "e2e_s": _summary([t.e2e for t in done if t.e2e is not None]),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per offered rate."""
    header = (
        f"{'rate':>6} {'done':>5} {'req/s':>6} {'tok/s':>7} {'goodput':>7} "
        f"{'TTFT p50':>8} {'p99':>6} {'TPOT p50':>8} {'p99':>5} {'ITL p50':>7} {'p99':>5} "
        f"{'E2E p50':>7} {'p99':>6}   (ms)"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        goodput = "-" if r["goodput"] is None else f"{r['goodput']:.2f}"
        lines.append(
            f"{r['request_rate']!s:>6} {r['completed']:>5} {r['request_throughput']:>6.2f} "
            f"{r['output_throughput']:>7.1f} {goodput:>7} "
            f"{_ms(r['ttft_s']['p50']):>8} {_ms(r['ttft_s']['p99']):>6} "
            f"{_ms(r['tpot_s']['p50']):>8} {_ms(r['tpot_s']['p99']):>5} "
            f"{_ms(r['itl_s']['p50']):>7} {_ms(r['itl_s']['p99']):>5} "
            f"{_ms(r['e2e_s']['p50']):>7} {_ms(r['e2e_s']['p99']):>6}"
        )
    return "\n".join(lines)


def figure(rows: list[dict[str, Any]], path: str) -> None:
    """TTFT and TPOT (p50 and p99) against the offered request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in rows if r["request_rate"] != "inf"]
    rates = [float(r["request_rate"]) for r in finite]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            values = [(r[key][p] or 0) * 1000 for r in finite]
            ax.plot(rates, values, style, label=p)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} against offered load")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
