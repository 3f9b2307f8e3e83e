"""Rotary cos and sin read from the rotary's table (`RotaryEmbedding.table`) rather than
computed a step at a time: a position gets the same bits in a step of any size, and a decode step
indexes two rows instead of running half a dozen small torch ops (~5 us against ~17 at one
token)."""

from __future__ import annotations

from ..rope import RotaryEmbedding
from .base import RopeTables


class ChunkedRope:
    """`rotary_tables` as rows of the rotary's table, filled in fixed chunks of positions."""

    def rotary_tables(self, rotary: RotaryEmbedding, positions, dtype) -> RopeTables:
        cos, sin = rotary.table(int(positions.max()) + 1 if positions.numel() else 0)
        return cos.index_select(0, positions), sin.index_select(0, positions)
