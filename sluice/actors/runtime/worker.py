"""Blocking work off the event loop: a step loop in a dedicated thread.

The runner's engine steps are long, blocking calls; run on the event loop they would starve the
Kafka consumer (missed heartbeats, a rebalance). `ThreadedWorker` runs them in one thread of its
own, which is also the only thread that touches the engine:

    worker = ThreadedWorker(step=engine.step, accept=engine.add_request,
                            has_work=engine.has_unfinished, name="runner-0",
                            on_start=engine.bind_thread)   # optional: first thing in the thread
    worker.start()                      # from the event loop
    worker.submit(request)              # any time, from the loop: handed to accept() in the thread
    async for output in worker:         # each non-None step() result, in order
        ...
    leftovers = await worker.stop(drain=True)   # keep reading meanwhile (max_pending)

In the thread, each round passes the submitted items to `accept`, then calls `step()` while
`has_work()` says so (or while items came in, when no `has_work` is given), and otherwise sleeps
until something is submitted. Results travel to the loop with `call_soon_threadsafe`; at most
`max_pending` may wait there unread, after which the thread waits (backpressure on the engine
rather than an unbounded queue). An exception in the thread ends the worker: iteration raises
`WorkerFailed` with it as the cause.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

log = logging.getLogger("sluice.actors")

In = TypeVar("In")
Out = TypeVar("Out")

_WAKE = object()  # put on the inbox to wake the thread (stop)
_END = object()  # put on the results queue when the thread ends


class WorkerFailed(Exception):
    """The worker thread raised; the original exception is `__cause__`."""


class WorkerStopped(Exception):
    """The worker has stopped: nothing more can be submitted."""


class ThreadedWorker(Generic[In, Out]):
    def __init__(
        self,
        step: Callable[[], Out | None],
        *,
        accept: Callable[[In], None] | None = None,
        has_work: Callable[[], bool] | None = None,
        name: str = "worker",
        max_pending: int = 64,
        idle_wait: float = 0.5,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._on_start = on_start  # called first in the thread (e.g. to bind it to CPUs)
        self._step = step
        self._accept = accept
        self._has_work = has_work
        self._idle_wait = idle_wait
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = threading.Semaphore(max_pending)
        self._stop_now = threading.Event()
        self._drain = threading.Event()
        self._leftovers: list[In] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._results: asyncio.Queue[Any] | None = None
        self._done: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self.steps = 0

    # -- loop side -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread. Call from the event loop that will read the results."""
        if self._thread is not None:
            raise RuntimeError(f"worker {self.name} was already started")
        self._loop = asyncio.get_running_loop()
        self._results = asyncio.Queue()
        self._done = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name=f"sluice-{self.name}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, item: In) -> None:
        """Hand `item` to `accept` in the worker thread. Raises `WorkerStopped` after stop."""
        if self._stopped or self._stop_now.is_set() or self._drain.is_set():
            raise WorkerStopped(f"worker {self.name} is stopping")
        self._inbox.put(item)

    async def get(self) -> Out:
        """The next step result. Raises `WorkerFailed` if the thread raised, `WorkerStopped` once
        it has ended and every result has been read."""
        if self._results is None:
            raise RuntimeError(f"worker {self.name} was never started")
        item = await self._results.get()
        if item is _END:
            self._results.put_nowait(_END)  # keep answering later calls the same way
            if self._error is not None:
                raise WorkerFailed(f"worker {self.name} failed: {self._error!r}") from self._error
            raise WorkerStopped(f"worker {self.name} has stopped")
        self._pending.release()
        return item

    def __aiter__(self) -> ThreadedWorker[In, Out]:
        return self

    async def __anext__(self) -> Out:
        try:
            return await self.get()
        except WorkerStopped:
            raise StopAsyncIteration from None

    async def stop(self, *, drain: bool = False, timeout: float | None = None) -> list[In]:
        """End the thread after the step in hand (`drain=True`: after all submitted items are
        accepted and `has_work()` is false). Results already produced stay readable. Returns the
        submitted items that were never accepted. Raises `TimeoutError` if the thread has not
        ended within `timeout` seconds (a thread cannot be killed; it is a daemon thread)."""
        self._stopped = True
        if self._thread is None:
            return self._take_inbox()
        (self._drain if drain else self._stop_now).set()
        self._inbox.put(_WAKE)
        assert self._done is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._done), timeout)
        except TimeoutError:
            log.error("worker %s: thread still running %gs after stop", self.name, timeout)
            raise
        self._thread.join(1.0)  # it resolved `_done` as its last act: this returns at once
        return self._leftovers

    # -- thread side -----------------------------------------------------------------------------

    def _run(self) -> None:
        items: list[In] = []
        try:
            if self._on_start is not None:
                self._on_start()
            while not self._stop_now.is_set():
                items += self._take_inbox()
                if self._stop_now.is_set():
                    break
                accepted = bool(items)
                while items:
                    self._accept_item(items.pop(0))
                busy = self._has_work() if self._has_work is not None else accepted
                if not busy:
                    if self._drain.is_set() and self._inbox.empty():
                        break
                    items = self._wait_for_input()
                    continue
                out = self._step()
                self.steps += 1
                if out is not None:
                    self._deliver(out)
        except BaseException as exc:  # noqa: BLE001 - reported to the loop, never lost
            self._error = exc
            log.error("worker %s: step loop raised", self.name, exc_info=exc)
        finally:
            self._leftovers.extend(items + self._take_inbox())
            self._post(_END)
            assert self._loop is not None and self._done is not None
            try:
                self._loop.call_soon_threadsafe(_resolve, self._done)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting

    def _accept_item(self, item: In) -> None:
        if self._accept is None:
            raise TypeError(f"worker {self.name} was given an item but has no accept()")
        self._accept(item)

    def _take_inbox(self) -> list[In]:
        items: list[In] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return items
            if item is not _WAKE:
                items.append(item)

    def _wait_for_input(self) -> list[In]:
        try:
            item = self._inbox.get(timeout=self._idle_wait)
        except queue.Empty:
            return []
        return [] if item is _WAKE else [item]

    def _deliver(self, out: Out) -> None:
        # Wait while `max_pending` results are unread, unless told to stop now.
        while not self._pending.acquire(timeout=0.1):
            if self._stop_now.is_set():
                break
        self._post(out)

    def _post(self, item: Any) -> None:
        assert self._loop is not None and self._results is not None
        try:
            self._loop.call_soon_threadsafe(self._results.put_nowait, item)
        except RuntimeError:
            log.warning("worker %s: event loop closed; a result was dropped", self.name)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def in_passing_thread(fn: Callable[..., Out], *args: Any) -> Out:
    """fn(*args) in a thread that ends when it returns, awaited without blocking the loop.

    For building the engine: unlike `asyncio.to_thread`, whose pooled thread lives on, this leaves
    no idle thread holding an OpenMP thread team. GNU OpenMP cuts its spin-waiting when more teams
    than cores exist, and every small torch op of the engine's step thread then paid a futex wake
    (measured: ~3x slower index_select and softmax, the whole pipeline ~15 % slower on 2 cores)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Out] = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(_settle, done, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    thread = threading.Thread(
        target=run, name=f"sluice-{getattr(fn, '__name__', 'build')}", daemon=True
    )
    thread.start()
    result = await done
    thread.join()  # it has returned already: gone, with its thread team, before the caller goes on
    return result


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
