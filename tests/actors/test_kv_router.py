"""The routing index: built from KV event messages as a runner writes them, it sends a request to
the runner caching the longest prefix of its prompt, within the load margin, keeps a session where
it was, and leaves out a runner gone silent."""

from __future__ import annotations

import time

import pytest

from sluice.actors.kv_events import (
    KvEventsMessage,
    RunnerLoad,
    pack_hashes,
    unpack_hashes,
)
from sluice.actors.kv_router import KvRouter
from sluice.actors.messages import TokenizedRequest
from sluice.engine.block_manager import prefix_block_hashes
from sluice.schemas import GenerateRequest

BS = 16


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def work(ids: list[int], rid: str = "r", session: str | None = None, tenant=None):
    request = GenerateRequest(
        request_id=rid, prompt="(ids)", session_id=session, tenant=tenant, max_tokens=1
    )
    return TokenizedRequest(request=request, prompt_token_ids=ids, received_at=time.time())


def report(
    runner: str, *, stored=(), removed=(), snapshot=False, running=0, inc="a", seq=0, leaving=False
):
    return KvEventsMessage(
        runner_id=runner,
        work_topic=f"w.{runner}",
        work_group=f"g-{runner}",
        leaving=leaving,
        incarnation=inc,
        seq=seq,
        sent_at=time.time(),
        block_size=BS,
        load=RunnerLoad(running=running),
        snapshot=snapshot,
        stored=pack_hashes(stored),
        removed=pack_hashes(removed),
    )


def blocks(ids, tenant=None):
    return prefix_block_hashes(ids, BS, tenant)


PREFIX_A = list(range(1000, 1000 + 8 * BS))
PREFIX_B = list(range(5000, 5000 + 8 * BS))


@pytest.fixture
def router():
    clock = Clock()
    r = KvRouter(load_margin=4, dead_after_s=10, clock=clock)
    r.clock = clock
    return r


def test_packed_hashes_round_trip():
    hashes = blocks(PREFIX_A)
    assert unpack_hashes(pack_hashes(hashes)) == [h[:8] for h in hashes]
    assert len(pack_hashes(hashes[:3])) == 32  # 24 bytes, in base64


def test_longest_cached_prefix_wins(router):
    router.apply(report("r1", stored=blocks(PREFIX_A)[:2]))
    router.apply(report("r2", stored=blocks(PREFIX_A)[:6]))
    choice = router.choose(work(PREFIX_A + [1, 2, 3]), "k")
    assert (choice.runner_id, choice.work_topic, choice.cached_blocks, choice.why) == (
        "r2",
        "w.r2",
        6,
        "prefix",
    )
    # Another tenant's blocks of the same tokens are not its prefix.
    choice = router.choose(work(PREFIX_A, rid="t", tenant="acme"), "k2")
    assert choice.cached_blocks == 0 and choice.why == "least loaded"


def test_a_chosen_runner_counts_the_prompt_as_cached_at_once(router):
    """Requests sharing a prefix, arriving before the first one's blocks are reported, go to the
    same runner."""
    router.apply(report("r1"))
    router.apply(report("r2"))
    first = router.choose(work(PREFIX_B + [7], rid="1"), "1")
    second = router.choose(work(PREFIX_B + [8], rid="2"), "2")
    assert first.why == "least loaded" and second.why == "prefix"
    assert second.runner_id == first.runner_id and second.cached_blocks == 8
    other = router.choose(work(PREFIX_A + [9], rid="3"), "3")
    assert other.runner_id != first.runner_id  # the other runner is less loaded now


def test_load_margin_sends_to_the_least_loaded(router):
    router.apply(report("r1", stored=blocks(PREFIX_A), running=9))
    router.apply(report("r2", running=5))
    assert router.choose(work(PREFIX_A), "k").runner_id == "r1"  # 9 <= 5 + 4
    router.apply(report("r1", running=10))
    choice = router.choose(work(PREFIX_A), "k")
    assert (choice.runner_id, choice.why) == ("r2", "least loaded")


def test_eviction_and_snapshot_and_restart_change_what_is_cached(router):
    a = blocks(PREFIX_A)
    router.apply(report("r1", stored=a))
    router.apply(report("r2"))
    router.apply(report("r1", removed=a[4:], seq=1))
    assert router.choose(work(PREFIX_A), "k").cached_blocks == 4
    router.apply(report("r1", stored=a[:1], snapshot=True, seq=2))
    assert router.runners["r1"].blocks == {h[:8] for h in a[:1]}
    router.apply(report("r1", inc="b"))  # restarted: nothing cached
    assert router.runners["r1"].blocks == set()


def test_session_stays_with_its_runner_while_it_lives(router):
    router.apply(report("r1"))
    router.apply(report("r2"))
    turn1 = router.choose(work(PREFIX_A, session="s"), "t/s")
    router.apply(report("r1", stored=blocks(PREFIX_B), seq=1))
    router.apply(report("r2", stored=blocks(PREFIX_B), seq=1))
    turn2 = router.choose(work(PREFIX_B, rid="2", session="s"), "t/s")
    assert turn2.runner_id == turn1.runner_id and turn2.why == "session"
    # Its runner goes silent: the next turn goes elsewhere.
    other = "r2" if turn1.runner_id == "r1" else "r1"
    router.clock.now += 11
    router.apply(report(other, seq=2))
    assert [v.runner_id for v in router.live()] == [other]
    assert router.choose(work(PREFIX_B, rid="3", session="s"), "t/s").runner_id == other


def test_no_runner_alive_means_no_choice(router):
    assert router.choose(work(PREFIX_A), "k") is None
    router.apply(report("r1"))
    router.clock.now += 10.5
    assert router.choose(work(PREFIX_A), "k") is None


def test_round_robin_takes_turns():
    router = KvRouter(policy="round-robin", clock=Clock())
    router.apply(report("r1", stored=blocks(PREFIX_A)))
    router.apply(report("r2"))
    picks = [router.choose(work(PREFIX_A, rid=str(i)), str(i)).runner_id for i in range(4)]
    assert picks == ["r1", "r2", "r1", "r2"]


def test_a_runner_that_says_it_leaves_is_not_chosen_until_it_is_back(router):
    router.apply(report("r1", stored=blocks(PREFIX_A)))
    router.apply(report("r2"))
    router.apply(report("r1", leaving=True, seq=1))
    assert [v.runner_id for v in router.live()] == ["r2"]
    assert router.choose(work(PREFIX_A), "k").runner_id == "r2"
    router.apply(report("r1", seq=2))  # a late heartbeat of the same run does not revive it
    assert [v.runner_id for v in router.live()] == ["r2"]
    router.apply(report("r1", inc="b"))  # started again
    assert [v.runner_id for v in router.live()] == ["r1", "r2"]
