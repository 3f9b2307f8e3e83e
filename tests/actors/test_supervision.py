import asyncio
import logging

import pytest

from sluice.actors.runtime import ActorFailed, ActorState, ActorSystem, MailboxClosed, RestartPolicy

from .helpers import BOUND, Recorder, eventually

FAST = RestartPolicy.restart(max_restarts=3, window=60, backoff=0.001)


async def test_crash_restarts_keeps_the_queue_and_reports_the_failing_message(caplog):
    actor = Recorder("worker", fail_on={"bad"}, restart_policy=FAST)
    for message in [1, "bad", 2, 3]:
        actor.tell_nowait(message)
    with caplog.at_level(logging.ERROR, logger="sluice.actors"):
        await actor.start()
        assert await asyncio.wait_for(actor.drain(), BOUND) == 0
    assert actor.handled == [1, 2, 3]
    [(message, exc)] = actor.failures
    assert message == "bad" and isinstance(exc, ValueError)
    assert actor.events == ["start", "stop", "restart:ValueError", "start", "stop"]
    assert actor.restarts == 1 and actor.crashes == 1 and actor.state == ActorState.STOPPED
    crash = next(r for r in caplog.records if "crashed" in r.getMessage())
    assert "worker" in crash.getMessage() and "'bad'" in crash.getMessage()
    assert crash.exc_info is not None  # the traceback is logged


async def test_too_many_restarts_escalate_and_end_system_run(caplog):
    system = ActorSystem()
    sink = system.add(Recorder("sink"))
    broken = system.add(Recorder("broken", fail_on={"x"}, restart_policy=FAST), sends_to=[sink])
    for _ in range(10):
        broken.tell_nowait("x")
    with caplog.at_level(logging.ERROR, logger="sluice.actors"):
        with pytest.raises(ActorFailed) as failed:
            await asyncio.wait_for(system.run(), BOUND)
    assert failed.value.actor_name == "broken" and isinstance(failed.value.cause, ValueError)
    assert "exceed max_restarts=3" in failed.value.reason
    assert broken.crashes == 4 and broken.restarts == 3 and len(broken.failures) == 4
    assert broken.state == ActorState.FAILED and sink.state == ActorState.STOPPED
    assert broken.unprocessed == 6  # not silently dropped: counted and reported
    assert any(
        r.getMessage().startswith("actor broken failed:") and "shutting down" in r.getMessage()
        for r in caplog.records
    )


async def test_escalate_policy_ends_the_system_at_the_first_crash():
    system = ActorSystem()
    other = system.add(Recorder("other"))
    broken = system.add(Recorder("broken", fail_on={"x"}, restart_policy="escalate"))
    await system.start()
    await broken.tell("x")
    with pytest.raises(ActorFailed, match="actor broken failed: ValueError"):
        await asyncio.wait_for(system.wait(), BOUND)
    assert broken.restarts == 0 and broken.failures[0][0] == "x"
    assert other.done and broken.done
    with pytest.raises(ActorFailed):
        await broken.join()


async def test_a_sender_blocked_on_a_failed_actor_is_released():
    gate = asyncio.Event()
    broken = Recorder("broken", capacity=1, gate=gate, fail_on={0}, restart_policy="escalate")
    await broken.start()
    await broken.tell(0)  # in hand, waiting at the gate
    await broken.tell(1)  # queued: the mailbox is full
    blocked = asyncio.create_task(broken.tell(2))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    gate.set()
    with pytest.raises(MailboxClosed):
        await asyncio.wait_for(blocked, BOUND)
    assert broken.left == [1]


async def test_a_crashing_background_task_goes_through_supervision():
    class Polling(Recorder):
        async def on_start(self):
            await super().on_start()
            if self.events.count("start") == 1:
                self.spawn(self.poll())

        async def poll(self):
            await asyncio.sleep(0)
            raise ConnectionError("broker went away")

    actor = Polling("poller", restart_policy=FAST)
    await actor.start()
    await eventually(lambda: actor.restarts == 1)
    assert actor.events[:3] == ["start", "stop", "restart:ConnectionError"]
    assert actor.failures == []  # no message was being handled
    await asyncio.wait_for(actor.drain(), BOUND)


async def test_failing_on_start_escalates_from_system_run():
    class NoStart(Recorder):
        async def on_start(self):
            raise RuntimeError("no model file")

    system = ActorSystem()
    downstream = system.add(Recorder("downstream"))
    system.add(NoStart("loader", restart_policy="escalate"), sends_to=[downstream])
    with pytest.raises(ActorFailed, match="no model file"):
        await asyncio.wait_for(system.run(), BOUND)
    assert downstream.state == ActorState.STOPPED


class LostRank(RuntimeError):
    pass


class RankHolder(Recorder):
    """Fails with a LostRank wrapped as the engine thread's failure is (its cause)."""

    fatal = (LostRank,)

    async def handle(self, message):
        if message == "rank gone":
            raise RuntimeError("worker failed") from LostRank("rank 1 exited")
        await super().handle(message)


async def test_a_fatal_crash_escalates_at_once_and_other_crashes_still_restart():
    system = ActorSystem()
    actor = system.add(RankHolder("runner", fail_on={"bad"}, restart_policy=FAST))
    await system.start()
    await actor.tell("bad")  # not fatal: restarted
    await actor.tell(1)
    await eventually(lambda: actor.handled == [1])
    assert actor.restarts == 1
    await actor.tell("rank gone")
    with pytest.raises(ActorFailed) as failed:
        await asyncio.wait_for(system.wait(), BOUND)
    assert "a restart cannot mend it" in failed.value.reason
    assert actor.restarts == 1 and actor.state == ActorState.FAILED
