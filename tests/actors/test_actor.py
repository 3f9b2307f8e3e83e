import asyncio

import pytest

from sluice.actors.runtime import ActorState, MailboxClosed, MailboxFull

from .helpers import BOUND, Recorder, eventually, settle


async def test_drain_finishes_everything_queued_then_stops():
    actor = Recorder(capacity=100)
    for i in range(50):
        await actor.tell(i)
    await actor.start()
    assert await asyncio.wait_for(actor.drain(), BOUND) == 0
    assert actor.handled == list(range(50))
    assert actor.events == ["start", "stop"]
    assert actor.state == ActorState.STOPPED and actor.processed == 50
    with pytest.raises(MailboxClosed):
        await actor.tell("late")
    await asyncio.wait_for(actor.join(), BOUND)


async def test_stop_finishes_the_message_in_hand_and_reports_the_rest():
    gate = asyncio.Event()
    actor = Recorder(gate=gate)
    for i in range(10):
        actor.tell_nowait(i)
    await actor.start()
    await eventually(lambda: actor.in_hand == 0)
    stopping = asyncio.create_task(actor.stop())
    await settle()
    gate.set()
    assert await asyncio.wait_for(stopping, BOUND) == 9
    assert actor.handled == [0]
    assert actor.left == list(range(1, 10)) and actor.unprocessed == 9
    assert actor.events == ["start", "stop"] and actor.state == ActorState.STOPPED


async def test_stop_with_timeout_cancels_a_stuck_handler_and_counts_it():
    actor = Recorder(gate=asyncio.Event())  # never opens
    for i in range(3):
        actor.tell_nowait(i)
    await actor.start()
    await eventually(lambda: actor.in_hand == 0)
    assert await asyncio.wait_for(actor.stop(timeout=0.05), BOUND) == 3
    assert actor.left == [0, 1, 2] and actor.state == ActorState.STOPPED


async def test_a_full_receiver_blocks_the_sender():
    gate = asyncio.Event()
    receiver = Recorder(capacity=2, gate=gate)
    sender = Recorder(capacity=100, forward_to=receiver)
    await receiver.start()
    await sender.start()
    for i in range(10):
        await sender.tell(i)
    await settle(50)
    # receiver: one in hand + 2 queued; the sender is stuck forwarding the fourth (handled is
    # recorded before forwarding), the other six wait in its own mailbox.
    assert receiver.mailbox.depth == 2 and receiver.in_hand == 0
    assert sender.handled == [0, 1, 2, 3] and sender.mailbox.depth == 6
    with pytest.raises(MailboxFull):
        receiver.tell_nowait("x")
    gate.set()
    await asyncio.wait_for(sender.drain(), BOUND)
    await asyncio.wait_for(receiver.drain(), BOUND)
    assert receiver.handled == list(range(10))


async def test_stopping_an_actor_never_started_reports_its_queue():
    actor = Recorder()
    actor.tell_nowait("a")
    assert await actor.stop() == 1 and actor.left == ["a"]
    assert actor.state == ActorState.STOPPED
