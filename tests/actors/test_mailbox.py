import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.actors.runtime import Mailbox, MailboxClosed, MailboxFull


async def settle(rounds: int = 5) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_put_blocks_the_sender_when_full_and_depth_never_exceeds_capacity():
    box = Mailbox(3)
    depths = []

    async def producer():
        for i in range(20):
            await box.put(i)
            depths.append(box.depth)

    task = asyncio.create_task(producer())
    await settle()
    assert box.depth == 3 and not task.done()  # the fourth put is waiting
    got = []
    while len(got) < 20:
        got.append(await asyncio.wait_for(box.get(), 5))
        await settle(2)
    await asyncio.wait_for(task, 5)
    assert got == list(range(20))
    assert max(depths) <= 3
    assert box.capacity == 3 and box.depth == 0


async def test_put_nowait_raises_when_full():
    box = Mailbox(2, name="m")
    box.put_nowait(1)
    box.put_nowait(2)
    with pytest.raises(MailboxFull, match="m is full"):
        box.put_nowait(3)
    assert box.depth == 2


async def test_close_rejects_puts_wakes_blocked_senders_and_drains_then_ends():
    box = Mailbox(2)
    await box.put("a")
    await box.put("b")
    blocked = asyncio.create_task(box.put("c"))
    await settle()
    box.close()
    with pytest.raises(MailboxClosed):
        await asyncio.wait_for(blocked, 5)
    with pytest.raises(MailboxClosed):
        box.put_nowait("d")
    with pytest.raises(MailboxClosed):
        await box.put("d")
    assert [m async for m in box] == ["a", "b"]
    with pytest.raises(MailboxClosed):
        await box.get()


async def test_close_wakes_a_waiting_consumer():
    box = Mailbox(1)
    getter = asyncio.create_task(box.get())
    await settle()
    box.close()
    with pytest.raises(MailboxClosed):
        await asyncio.wait_for(getter, 5)


async def test_cancelled_sender_does_not_swallow_a_free_slot():
    box = Mailbox(1)
    await box.put(0)
    first = asyncio.create_task(box.put(1))
    second = asyncio.create_task(box.put(2))
    await settle()
    assert await box.get() == 0  # wakes `first` ...
    first.cancel()  # ... which is cancelled before it runs: `second` must get the slot
    await asyncio.wait_for(second, 5)
    assert box.depth == 1 and await box.get() == 2


async def test_control_messages_jump_the_queue_and_do_not_count():
    box = Mailbox(1)
    box.put_nowait("user")
    box.put_control("control")
    assert box.depth == 1
    assert await box.get() == "control"
    assert await box.get() == "user"


@settings(max_examples=50, deadline=None)
@given(
    capacity=st.integers(1, 5),
    n_senders=st.integers(1, 4),
    per_sender=st.integers(0, 15),
    consumer_pauses=st.lists(st.integers(0, 3), min_size=1, max_size=8),
)
def test_many_senders_fifo_per_sender_bounded_and_nothing_lost(
    capacity, n_senders, per_sender, consumer_pauses
):
    async def scenario():
        box = Mailbox(capacity)
        max_depth = 0

        async def sender(s):
            nonlocal max_depth
            for i in range(per_sender):
                await box.put((s, i))
                max_depth = max(max_depth, box.depth)

        senders = [asyncio.create_task(sender(s)) for s in range(n_senders)]
        got = []
        for k in range(n_senders * per_sender):
            got.append(await asyncio.wait_for(box.get(), 5))
            await settle(consumer_pauses[k % len(consumer_pauses)])
        await asyncio.wait_for(asyncio.gather(*senders), 5)
        return got, max_depth

    got, max_depth = asyncio.run(scenario())
    assert max_depth <= capacity
    assert sorted(got) == sorted((s, i) for s in range(n_senders) for i in range(per_sender))
    for s in range(n_senders):
        assert [i for t, i in got if t == s] == list(range(per_sender))
