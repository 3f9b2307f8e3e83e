"""The offset tracker commits only the finished prefix of a partition, whatever the finish order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.connectors.offsets import OffsetTracker


def test_nothing_handed_out_nothing_to_commit():
    tracker = OffsetTracker()
    assert tracker.committable() is None
    assert tracker.to_commit() is None
    assert tracker.in_flight == 0


def test_out_of_order_done_commits_only_the_contiguous_prefix():
    tracker = OffsetTracker()
    for offset in range(10, 15):
        tracker.start(offset)
    assert tracker.committable() == 10  # nothing done: restart at the first record
    assert tracker.done(12) and tracker.done(13)
    assert tracker.committable() == 10  # 10 and 11 still run
    assert tracker.done(10)
    assert tracker.committable() == 11
    assert tracker.done(11)
    assert tracker.committable() == 14  # 12 and 13 were already done
    assert tracker.in_flight == 1
    assert tracker.done(14)
    assert tracker.committable() == 15
    assert tracker.in_flight == 0


def test_gaps_in_offsets_do_not_block_the_commit():
    # Compaction and transaction markers leave offsets that are never delivered.
    tracker = OffsetTracker()
    for offset in (3, 7, 8, 20):
        tracker.start(offset)
    for offset in (20, 8, 3):
        tracker.done(offset)
    assert tracker.committable() == 7
    tracker.done(7)
    assert tracker.committable() == 21


def test_done_twice_or_unknown_is_refused_and_changes_nothing():
    tracker = OffsetTracker()
    tracker.start(0)
    tracker.start(1)
    assert tracker.done(1)
    assert not tracker.done(1)
    assert not tracker.done(5)
    assert not tracker.done(-1)
    assert tracker.committable() == 0 and tracker.in_flight == 1


def test_offsets_must_increase():
    tracker = OffsetTracker()
    tracker.start(5)
    with pytest.raises(ValueError):
        tracker.start(5)
    with pytest.raises(ValueError):
        tracker.start(2)


def test_to_commit_only_when_moved_past_the_last_commit():
    tracker = OffsetTracker()
    tracker.start(0)
    tracker.start(1)
    tracker.done(0)
    assert tracker.to_commit() == 1
    tracker.committed = 1
    assert tracker.to_commit() is None
    tracker.done(1)
    assert tracker.to_commit() == 2


@given(
    st.lists(
        st.integers(min_value=1, max_value=4), min_size=1, max_size=60
    ),  # gaps between offsets
    st.randoms(use_true_random=False),
    st.integers(min_value=0, max_value=1000),
)
def test_committable_is_always_the_lowest_unfinished_offset(gaps, rnd, first):
    offsets = []
    offset = first
    for gap in gaps:
        offsets.append(offset)
        offset += gap
    tracker = OffsetTracker()
    finished: set[int] = set()
    order = offsets[:]
    rnd.shuffle(order)
    started = 0
    # Interleave handing out and finishing, as the pipeline does.
    while len(finished) < len(offsets):
        can_finish = [o for o in order if o in offsets[:started] and o not in finished]
        if started < len(offsets) and (not can_finish or rnd.random() < 0.5):
            tracker.start(offsets[started])
            started += 1
        else:
            pick = can_finish[0]
            assert tracker.done(pick)
            finished.add(pick)
        unfinished = [o for o in offsets[:started] if o not in finished]
        expected = min(unfinished) if unfinished else offsets[started - 1] + 1
        assert tracker.committable() == expected
        # Never past a record still running: everything below the commit point is finished.
        assert all(o in finished for o in offsets[:started] if o < tracker.committable())
        assert tracker.in_flight == len(unfinished)
    assert tracker.committable() == offsets[-1] + 1
