"""The pipeline benchmark's per-request TTFT and TPOT as cumulative distributions, one line per
side.

With all requests queued at once, a table's p50 and p99 hide the shape: whether the Kafka path
shifts every request by the same few hundred ms (slower steps) or only some of them (the order in
which partitions were read). Drawn with matplotlib when it is installed
(`pip install -e ".[bench]"`).
"""

from __future__ import annotations

from pathlib import Path


def plot_pipeline(result: dict, path: Path) -> bool:
    """Write the figure for a bench/pipeline.py result to `path`; False when matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side in result["sides"]:
        for ax, key, scale in ((ax_ttft, "ttft_s", 1.0), (ax_tpot, "tpot_s", 1000.0)):
            values = sorted(v * scale for v in side[key] if v is not None)
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(
                values,
                fractions,
                where="post",
                label=f"{side['side']} ({side['throughput_tok_s']:.0f} tok/s)",
            )
    ax_ttft.set(xlabel="time to first token (s)", ylabel="fraction of requests", title="TTFT")
    ax_tpot.set(xlabel="time per output token (ms)", title="TPOT")
    for ax in (ax_ttft, ax_tpot):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    args = result["args"]
    fig.suptitle(
        f"{args['num_requests']} requests at once, "
        f"prompts {args['prompt_min']}-{args['prompt_max']} tokens, "
        f"{args['output_len']} out, {args['dtype']}: "
        f"throughput ratio {result['throughput_ratio']:.3f}, "
        f"added p50 TTFT {result['added_p50_ttft_ms']:+.0f} ms",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
