"""The step plan's layout: a decodes-only step (laid out without per-token index arithmetic) and
the same decodes inside a mixed step (the general path) give every token the same position, cache
slot and decode row."""

from __future__ import annotations

import numpy as np
import torch

from sluice.engine.step_plan import build_step_plan, decode_rows

BLOCK = 4
SEQ_LENS = [3, 40, 9, 17, 41, 2]  # six decodes
TABLES = [[7], [0, 1, 2, 3, 4, 5, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20] * 11, [6]]


def test_a_decodes_only_step_lays_out_its_tokens_as_a_mixed_step_does():
    alone = build_step_plan([1] * 6, SEQ_LENS, TABLES, BLOCK)
    # the same decodes, then a prefill chunk of 5 tokens of a sequence of 23
    mixed = build_step_plan([1] * 6 + [5], SEQ_LENS + [23], TABLES + [list(range(21, 27))], BLOCK)
    want_pos = np.array(SEQ_LENS) - 1
    want_slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(TABLES, want_pos)]
    assert alone.positions.tolist() == mixed.positions[:6].tolist() == want_pos.tolist()
    assert alone.slot_mapping.tolist() == mixed.slot_mapping[:6].tolist() == want_slots
    assert alone.slot_mapping_host.tolist() == want_slots

    rows_alone, rows_mixed = decode_rows(alone), decode_rows(mixed)
    assert rows_alone is not None and rows_mixed is not None
    assert rows_alone.tokens.tolist() == rows_mixed.tokens.tolist() == list(range(6))
    assert rows_alone.seq_lens.tolist() == rows_mixed.seq_lens.tolist() == SEQ_LENS
    assert rows_alone.max_seq_len == rows_mixed.max_seq_len == max(SEQ_LENS)
    width = rows_alone.block_tables.shape[1]
    assert torch.equal(rows_alone.block_tables, rows_mixed.block_tables[:, :width])
    assert rows_alone.block_tables.dtype == rows_mixed.block_tables.dtype == torch.int32
    assert rows_alone.tokens.dtype == rows_mixed.tokens.dtype == torch.int64


def test_a_step_without_decodes_has_no_decode_rows():
    assert decode_rows(build_step_plan([3, 2], [3, 9], [[0], [1, 2, 3]], BLOCK)) is None
