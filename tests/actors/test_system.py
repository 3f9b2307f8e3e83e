import asyncio
import os
import signal

import pytest

from sluice.actors.runtime import ActorState, ActorSystem

from .helpers import BOUND, Recorder, eventually


def pipeline(system, trace, **sink_kwargs):
    class Traced(Recorder):
        async def on_start(self):
            trace.append(f"start {self.name}")

        async def on_stop(self):
            trace.append(f"stop {self.name}")

    sink = Traced("sink", **sink_kwargs)
    middle = Traced("middle", forward_to=sink, capacity=4)
    source = Traced("source", forward_to=middle, capacity=4)
    # added out of order on purpose: sends_to decides
    system.add(sink)
    system.add(middle, sends_to=[sink])
    system.add(source, sends_to=[middle])
    return source, middle, sink


async def test_starts_downstream_first_and_drains_upstream_first_losing_nothing():
    trace = []
    system = ActorSystem()
    source, middle, sink = pipeline(system, trace)
    assert [a.name for a in system.actors] == ["source", "middle", "sink"]
    running = asyncio.create_task(system.run())
    await eventually(lambda: len(trace) == 3)
    for i in range(100):
        await source.tell(i)
    system.request_shutdown()
    await asyncio.wait_for(running, BOUND)
    assert trace == [
        "start sink",
        "start middle",
        "start source",
        "stop source",
        "stop middle",
        "stop sink",
    ]
    assert sink.handled == list(range(100))
    assert system.unprocessed == {"source": 0, "middle": 0, "sink": 0}
    assert all(a.state == ActorState.STOPPED for a in system.actors)


async def test_a_second_shutdown_request_turns_a_drain_into_a_stop():
    trace = []
    gate = asyncio.Event()  # the sink never finishes its first message by itself
    system = ActorSystem()
    source, middle, sink = pipeline(system, trace, gate=gate)
    running = asyncio.create_task(system.run())
    await eventually(lambda: len(trace) == 3)
    for i in range(5):
        await source.tell(i)
    await eventually(lambda: sink.in_hand == 0 and sink.mailbox.depth == 4)
    system.request_shutdown()
    await eventually(lambda: system._current is sink)
    system.request_shutdown(graceful=False)
    gate.set()  # the message in hand finishes; the four queued behind it are reported
    await asyncio.wait_for(running, BOUND)
    assert sink.handled == [0] and sink.left == [1, 2, 3, 4]
    assert system.unprocessed["sink"] == 4


async def test_sigterm_drains_the_system():
    trace = []
    system = ActorSystem()
    source, middle, sink = pipeline(system, trace)
    remove = system.install_signal_handlers([signal.SIGTERM])
    try:
        running = asyncio.create_task(system.run())
        await eventually(lambda: len(trace) == 3)
        for i in range(20):
            await source.tell(i)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(running, BOUND)
    finally:
        remove()
    assert sink.handled == list(range(20))


async def test_cancelling_run_stops_the_actors():
    system = ActorSystem()
    actor = system.add(Recorder("a"))
    running = asyncio.create_task(system.run())
    await eventually(lambda: actor.state == ActorState.RUNNING)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(running, BOUND)
    assert actor.state == ActorState.STOPPED


async def test_rejects_cycles_duplicates_and_unknown_receivers():
    system = ActorSystem()
    a, b = Recorder("a"), Recorder("b")
    system.add(a, sends_to=[b])
    with pytest.raises(ValueError, match="not in the system"):
        _ = system.actors
    system.add(b, sends_to=[a])
    with pytest.raises(ValueError, match="cycle"):
        _ = system.actors
    with pytest.raises(ValueError, match="already added"):
        system.add(Recorder("a"))
