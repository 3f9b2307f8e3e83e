"""Which heads and MLP columns each tensor-parallel rank holds, and its slice of each weight.

Megatron's split of a decoder layer: q/k/v and gate/up are split by output rows (column-parallel),
o_proj and down by input columns (row-parallel), so each rank computes a partial sum of the
layer's output from its own heads and columns and one all-reduce per sub-layer adds them up.
Attention needs no communication: a rank's query heads read only its own KV heads.

Counts need not divide: KV heads are dealt out as evenly as they go (SmolLM2's 3 KV heads over 2
ranks: 2 and 1), each with its group of query heads (6 and 3); MLP columns likewise, in runs of
32 where the intermediate size allows, so that block-quantized down_proj rows keep the blocks of
the unsharded matrix. Biases follow their rows; o_proj's bias (Llama's attention_bias) stays on
rank 0 alone, so that the all-reduce adds it once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from ..config import ModelConfig
from ..errors import ConfigError

COLUMN_RUN = 32  # MLP columns go to ranks in runs of this many where the size allows (int8 blocks)


def even_split(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of each part: `total` in runs of `unit`, the first parts one run larger when
    the runs do not divide evenly."""
    runs = total // unit
    base, extra = divmod(runs, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + (base + (part < extra)) * unit
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class RankShard:
    """What one rank holds: [start, stop) of the KV heads, query heads and MLP columns."""

    rank: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    columns: tuple[int, int]

    def describe(self) -> str:
        def span(lo: int, hi: int) -> str:
            return f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"

        return (
            f"rank {self.rank}: KV heads {span(*self.kv_heads)}, query heads "
            f"{span(*self.q_heads)}, MLP columns {span(*self.columns)}"
        )


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig  # the whole model's
    ranks: tuple[RankShard, ...]

    @classmethod
    def of(cls, config: ModelConfig, world_size: int) -> ShardPlan:
        """The split of `config` over `world_size` ranks; ConfigError where it cannot be split."""
        c = config
        if c.num_experts or c.qk_norm_whole:
            # (experts split over ranks, or each expert's columns, would serve this; not built)
            raise ConfigError(
                f"tensor parallelism does not split a mixture of experts ({c.architecture}) yet",
                field="tensor_parallel_size",
            )
        if c.num_key_value_heads < world_size:
            # (replicating KV heads across ranks would serve this; not built)
            raise ConfigError(
                f"tensor_parallel_size={world_size} is more than the model's "
                f"{c.num_key_value_heads} KV heads: every rank needs at least one",
                field="tensor_parallel_size",
            )
        group = c.num_attention_heads // c.num_key_value_heads
        unit = COLUMN_RUN if c.intermediate_size % COLUMN_RUN == 0 else 1
        if c.intermediate_size // unit < world_size:
            unit = 1
        kv = even_split(c.num_key_value_heads, world_size)
        columns = even_split(c.intermediate_size, world_size, unit)
        ranks = tuple(
            RankShard(rank, kv[rank], (kv[rank][0] * group, kv[rank][1] * group), columns[rank])
            for rank in range(world_size)
        )
        return cls(config, ranks)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank_config(self, rank: int) -> ModelConfig:
        """The model as rank `rank` runs it: its heads and columns (head_dim and hidden size
        unchanged)."""
        r = self.ranks[rank]
        return replace(
            self.config,
            num_attention_heads=r.q_heads[1] - r.q_heads[0],
            num_key_value_heads=r.kv_heads[1] - r.kv_heads[0],
            intermediate_size=r.columns[1] - r.columns[0],
        )

    def rank_tensors(
        self, tensors: Mapping[str, torch.Tensor], rank: int, layers_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """Rank `rank`'s slices of HF-named tensors (views where they can be). `layers_only`
        leaves out the vocabulary matrices and the final norm (a worker never embeds nor computes
        logits)."""
        c, r = self.config, self.ranks[rank]
        d = c.head_dim
        q = slice(r.q_heads[0] * d, r.q_heads[1] * d)
        kv = slice(r.kv_heads[0] * d, r.kv_heads[1] * d)
        cols = slice(*r.columns)
        rows_of = {
            "self_attn.q_proj": q,
            "self_attn.k_proj": kv,
            "self_attn.v_proj": kv,
            "mlp.gate_proj": cols,
            "mlp.up_proj": cols,
        }
        inputs_of = {"self_attn.o_proj.weight": q, "mlp.down_proj.weight": cols}
        out = {}
        for name, t in tensors.items():
            if not name.startswith("model.layers."):
                if not layers_only:
                    out[name] = t
                continue
            tail = name.split(".", 3)[3]  # e.g. "self_attn.q_proj.weight"
            module = tail.rpartition(".")[0]
            if module in rows_of:
                out[name] = t[rows_of[module]]
            elif tail in inputs_of:
                out[name] = t[:, inputs_of[tail]]
            elif module == "self_attn.o_proj":  # its bias, added once: by rank 0
                out[name] = t if rank == 0 else torch.zeros_like(t)
            else:  # norms
                out[name] = t
        return out

    def describe(self) -> str:
        return "; ".join(r.describe() for r in self.ranks)
