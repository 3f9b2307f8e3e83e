import asyncio
import threading
import time

import pytest

from sluice.actors.runtime import (
    Actor,
    ThreadedWorker,
    WorkerFailed,
    WorkerStopped,
    in_passing_thread,
)

from .helpers import BOUND, eventually


class Engine:
    """A stand-in for the engine: blocking steps, each finishing one unit of every request."""

    def __init__(self, step_seconds=0.0):
        self.step_seconds = step_seconds
        self.remaining = {}
        self.thread_ids = set()

    def add(self, request):
        name, units = request
        self.remaining[name] = units

    def has_work(self):
        return bool(self.remaining)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.step_seconds)
        out = []
        for name in list(self.remaining):
            self.remaining[name] -= 1
            out.append(name)
            if self.remaining[name] == 0:
                del self.remaining[name]
        return out


async def test_the_loop_keeps_running_while_the_worker_blocks():
    engine = Engine(step_seconds=0.05)
    worker = ThreadedWorker(engine.step, accept=engine.add, has_work=engine.has_work)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    worker.start()
    worker.submit(("a", 10))
    outputs = [await asyncio.wait_for(worker.get(), BOUND) for _ in range(10)]
    ticking.cancel()
    # ten blocking steps of 50 ms: a loop blocked by them would have ticked about never
    assert ticks >= 10
    assert outputs == [["a"]] * 10
    assert threading.get_ident() not in engine.thread_ids
    assert await asyncio.wait_for(worker.stop(drain=True), BOUND) == []
    assert not worker.running
    with pytest.raises(WorkerStopped):
        worker.submit(("b", 1))
    assert [out async for out in worker] == []


async def test_drain_finishes_submitted_work_and_stop_returns_unaccepted_items():
    engine = Engine()
    worker = ThreadedWorker(engine.step, accept=engine.add, has_work=engine.has_work, max_pending=2)
    worker.start()
    for i in range(5):
        worker.submit((f"r{i}", 3))
    stopping = asyncio.create_task(worker.stop(drain=True))
    outputs = [out async for out in worker]  # keep reading: results are bounded by max_pending
    assert await asyncio.wait_for(stopping, BOUND) == []
    done = [name for out in outputs for name in out]
    assert sorted(done) == sorted(f"r{i}" for i in range(5) for _ in range(3))

    entered, gate = threading.Event(), threading.Event()

    def blocking_step():
        entered.set()
        gate.wait(BOUND)

    blocking = ThreadedWorker(blocking_step, accept=lambda item: None)
    blocking.start()
    blocking.submit("first")
    await eventually(entered.is_set)  # the step for "first" is in hand
    blocking.submit("second")
    blocking.submit("third")
    stopping = asyncio.create_task(blocking.stop())
    await asyncio.sleep(0.01)
    gate.set()
    assert await asyncio.wait_for(stopping, BOUND) == ["second", "third"]


async def test_results_are_bounded_when_nobody_reads_them():
    worker = ThreadedWorker(lambda: "token", has_work=lambda: True, max_pending=3)
    worker.start()
    await asyncio.sleep(0.2)
    assert worker.steps <= 4  # three delivered and unread, the fourth waiting
    await asyncio.wait_for(worker.stop(), BOUND)
    assert len([out async for out in worker]) == worker.steps


async def test_an_exception_in_the_thread_reaches_the_reader():
    def step():
        raise RuntimeError("CUDA error: out of memory")

    worker = ThreadedWorker(step, has_work=lambda: True)
    worker.start()
    with pytest.raises(WorkerFailed) as failed:
        await asyncio.wait_for(worker.get(), BOUND)
    assert isinstance(failed.value.__cause__, RuntimeError)
    await asyncio.wait_for(worker.stop(), BOUND)
    assert not worker.running


async def test_a_runner_shaped_actor_drains_its_worker():
    """The runner pattern: handle() submits, a spawned pump forwards results, on_stop drains."""

    class Runner(Actor):
        def __init__(self):
            super().__init__("runner")
            self.results = []

        async def on_start(self):
            self.engine = Engine(step_seconds=0.001)
            self.worker = ThreadedWorker(
                self.engine.step, accept=self.engine.add, has_work=self.engine.has_work
            )
            self.worker.start()
            self.pumping = self.spawn(self.pump())

        async def pump(self):
            async for out in self.worker:
                self.results.extend(out)

        async def on_stop(self):
            await self.worker.stop(drain=True, timeout=BOUND)
            await (
                self.pumping
            )  # the pump ends after the last result (spawned tasks are cancelled next)

        async def handle(self, request):
            self.worker.submit(request)

    runner = Runner()
    await runner.start()
    for i in range(20):
        await runner.tell((f"r{i}", 4))
    assert await asyncio.wait_for(runner.drain(), BOUND) == 0
    assert len(runner.results) == 80
    assert sorted(set(runner.results)) == sorted(f"r{i}" for i in range(20))


async def test_in_passing_thread_returns_the_result_and_leaves_no_thread_behind():
    before = {t.ident for t in threading.enumerate()}
    loop_thread = threading.get_ident()
    ran_in = []

    def build(x, y):
        ran_in.append(threading.get_ident())
        return x + y

    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    ticker = asyncio.create_task(tick())
    assert await in_passing_thread(lambda: (time.sleep(0.05), build(2, 3))[1]) == 5
    ticker.cancel()
    assert ran_in and ran_in[0] != loop_thread
    assert ticks > 5  # the loop kept running meanwhile
    assert {t.ident for t in threading.enumerate()} <= before  # the thread has ended


async def test_in_passing_thread_raises_what_the_function_raised():
    def broken():
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        await in_passing_thread(broken)
