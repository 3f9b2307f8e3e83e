"""The actor: a name, a bounded mailbox, and one task that handles its messages one at a time.

Subclass `Actor`, override `handle`, and send with `await other.tell(message)`: actors hold plain
references to each other, there is no registry. Lifecycle:

    start()  runs `on_start`, then handles messages; returns once the actor is running
    drain()  closes the mailbox, handles everything already queued, runs `on_stop`, ends
    stop()   closes the mailbox, finishes only the message in hand, runs `on_stop`, ends;
             the queued messages it leaves are counted, returned and passed to `on_unprocessed`
    join()   waits for the end; raises `ActorFailed` if the actor escalated a crash

A crash is an exception escaping `handle` (or `on_start`, or a task started with `spawn`, or one
reported with `fail`). It is logged with the actor's name and traceback, the failing message goes
to `on_failure(message, exc)`, and the actor's `RestartPolicy` decides (see supervisor.py):

    restart   after a backoff: `on_stop`, `on_restart(exc)` (reset state here), `on_start`, then
              the same mailbox again, so nothing queued is lost
    escalate  the actor ends FAILED with `failure` set, its mailbox closes (waiting senders get
              `MailboxClosed` instead of hanging), and its ActorSystem shuts down

Too many crashes within the policy's window escalate as well, and so does at once an exception of
one of the actor's `fatal` types (or one caused by it): a fault no restart can mend.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import reprlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

from sluice.actors.runtime.mailbox import Mailbox, MailboxClosed
from sluice.actors.runtime.supervisor import Decision, RestartPolicy, Supervisor

log = logging.getLogger("sluice.actors")

_repr = reprlib.Repr()
_repr.maxstring = 120
_repr.maxother = 120


def describe(message: Any) -> str:
    """A short, log-safe rendering of a message (prompts can be long)."""
    return _repr.repr(message)


class ActorFailed(Exception):
    """An actor escalated a crash. `cause` is the exception, `reason` why it was not restarted."""

    def __init__(self, actor_name: str, cause: BaseException, reason: str) -> None:
        super().__init__(f"actor {actor_name} failed: {type(cause).__name__}: {cause} ({reason})")
        self.actor_name = actor_name
        self.cause = cause
        self.reason = reason


class ActorState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class _Crash:
    """Control message: crash the actor with `exc` (from `fail`)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Actor:
    capacity: int = 64
    restart_policy: RestartPolicy | str = RestartPolicy()
    # Crashes a restart cannot mend (e.g. a lost tensor-parallel rank): they escalate at once.
    fatal: tuple[type[BaseException], ...] = ()

    def __init__(
        self,
        name: str | None = None,
        *,
        capacity: int | None = None,
        restart_policy: RestartPolicy | str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name or type(self).__name__
        self.mailbox = Mailbox(capacity or type(self).capacity, self.name)
        self.restart_policy = RestartPolicy.coerce(
            restart_policy if restart_policy is not None else type(self).restart_policy
        )
        self.state = ActorState.NEW
        self.failure: ActorFailed | None = None
        # counters for metrics
        self.processed = 0
        self.crashes = 0
        self.restarts = 0
        self.unprocessed = 0
        self._supervisor = Supervisor(self.restart_policy, clock)
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stopping = False
        self._stop_event = asyncio.Event()
        self._hooks_live = False  # on_start completed, on_stop not yet run
        self._in_hand: list[Any] = []  # the message being handled, if any
        self._where = ""  # what the actor was doing, for the crash log line
        self._handling: Any = None  # with _where "handling": the message (rendered only on a crash)
        self._background: set[asyncio.Task[Any]] = set()
        self._watchers: list[Callable[[Actor], None]] = []

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.state.value} {self.mailbox!r}>"

    # -- to override -----------------------------------------------------------------------------

    async def handle(self, message: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    async def on_start(self) -> None:
        """Before the first message, and again after each restart."""

    async def on_stop(self) -> None:
        """After the last message, and before each restart (release what on_start took)."""

    async def on_restart(self, exc: BaseException) -> None:
        """Between on_stop and on_start of a restart: reset the actor's state here."""

    async def on_failure(self, message: Any, exc: BaseException) -> None:
        """`handle(message)` raised `exc`; e.g. emit an error event for that message."""

    def on_unprocessed(self, messages: list[Any]) -> None:
        """Queued messages the actor ends without handling (stop, failure). Default: a warning."""
        log.warning(
            "actor %s ended with %d unprocessed message(s), first: %s",
            self.name,
            len(messages),
            describe(messages[0]),
        )

    # -- sending ---------------------------------------------------------------------------------

    async def tell(self, message: Any) -> None:
        """Queue a message, waiting while the mailbox is full. Raises `MailboxClosed`."""
        await self.mailbox.put(message)

    def tell_nowait(self, message: Any) -> None:
        """Queue a message now, or raise `MailboxFull` / `MailboxClosed`."""
        self.mailbox.put_nowait(message)

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The actor has ended (stopped or failed)."""
        return self.state in (ActorState.STOPPED, ActorState.FAILED)

    async def start(self) -> None:
        """Start the actor's task; return once `on_start` has run. Raises `ActorFailed`."""
        if self._task is not None or self.state != ActorState.NEW:
            raise RuntimeError(f"actor {self.name} was already started")
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self.state = ActorState.STARTING
        self._task = loop.create_task(self._main(), name=f"actor:{self.name}")
        self._task.add_done_callback(self._task_done)
        await asyncio.wait({self._ready, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self.failure is not None:
            raise self.failure

    async def drain(self, timeout: float | None = None) -> int:
        """Stop accepting, handle everything queued, then stop. After `timeout` seconds fall back
        to `stop`. Returns the number of messages left unprocessed (0 for a complete drain)."""
        self.mailbox.close()
        if self._task is None:
            return self._end_unstarted()
        if self.state in (ActorState.RUNNING, ActorState.STARTING) and not self._stopping:
            self.state = ActorState.DRAINING
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        if not done:
            log.warning(
                "actor %s: drain not finished after %gs (%d queued); stopping",
                self.name,
                timeout,
                self.mailbox.depth,
            )
            return await self.stop(timeout)
        return self.unprocessed

    async def stop(self, timeout: float | None = None) -> int:
        """Finish the message in hand and stop; queued messages are left (and reported). After
        `timeout` seconds the task is cancelled. Returns the number of messages left unprocessed."""
        self._request_stop()
        if self._task is None:
            return self._end_unstarted()
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        if not done:
            log.warning("actor %s: still busy %gs after stop; cancelling it", self.name, timeout)
            self._task.cancel()
            await asyncio.wait({self._task})
        return self.unprocessed

    def request_stop(self) -> None:
        """`stop` without waiting: usable from a callback or a signal handler."""
        self._request_stop()

    async def join(self) -> None:
        """Wait until the actor ends. Raises `ActorFailed` if it escalated a crash."""
        if self._task is None:
            raise RuntimeError(f"actor {self.name} was never started")
        await asyncio.wait({self._task})
        if self.failure is not None:
            raise self.failure

    def fail(self, exc: BaseException) -> None:
        """Crash this actor from outside `handle` (a worker thread's error, a broken connection):
        it goes through supervision like a crash in `handle`, after the message in hand."""
        if not self.done:
            self.mailbox.put_control(_Crash(exc))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run `coro` beside the actor (a poll loop, a result pump); call it from `on_start`.
        It is cancelled after `on_stop` (at the end and before each restart): a task that must run
        to completion (a pump draining a worker) is awaited in `on_stop`. An exception from it
        crashes the actor, except `MailboxClosed` once the actor's mailbox is closed."""
        task = asyncio.get_running_loop().create_task(coro, name=name or f"actor:{self.name}:task")
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def watch(self, callback: Callable[[Actor], None]) -> None:
        """Call `callback(actor)` when it escalates and when its task ends (used by ActorSystem)."""
        self._watchers.append(callback)

    # -- internals -------------------------------------------------------------------------------

    def _request_stop(self) -> None:
        self._stopping = True
        self._stop_event.set()
        self.mailbox.close()
        if not self.done and self._task is not None:
            self.state = ActorState.STOPPING

    def _live_state(self) -> ActorState:
        if self._stopping:
            return ActorState.STOPPING
        return ActorState.DRAINING if self.mailbox.closed else ActorState.RUNNING

    def _end_unstarted(self) -> int:
        self._report_unprocessed(self.mailbox.clear())
        if self.state == ActorState.NEW:
            self.state = ActorState.STOPPED
        return self.unprocessed

    async def _main(self) -> None:
        restart_after: BaseException | None = None
        try:
            while True:
                try:
                    if restart_after is not None:
                        self._where = "in on_restart"
                        await self.on_restart(restart_after)
                    self._where = "in on_start"
                    await self.on_start()
                    self._hooks_live = True
                    self.state = self._live_state()
                    if self._ready is not None and not self._ready.done():
                        self._ready.set_result(None)
                    await self._process()
                    break
                except Exception as exc:
                    self.crashes += 1
                    log.error("actor %s crashed %s", self.name, self._where_text(), exc_info=exc)
                    await self._release()
                    decision = self._supervisor.on_crash()
                    if self._is_fatal(exc):
                        decision = Decision(False, 0.0, "a restart cannot mend it")
                    if not decision.restart:
                        self._escalate(exc, decision.reason)
                        await self._finish(ActorState.FAILED)
                        return
                    log.warning("actor %s: %s", self.name, decision.reason)
                    if not self._stopping:
                        self.state = ActorState.RESTARTING
                    if await self._stop_requested_within(decision.delay):
                        break
                    self.restarts += 1
                    restart_after = exc
            await self._finish(ActorState.STOPPED)
        except asyncio.CancelledError:
            self._hooks_live = False
            for task in list(self._background):
                task.cancel()
            self._report_unprocessed(self._in_hand + self.mailbox.clear())
            self.mailbox.close()
            if self.state != ActorState.FAILED:
                self.state = ActorState.STOPPED
            log.warning("actor %s cancelled (on_stop skipped)", self.name)
            raise

    async def _process(self) -> None:
        while not self._stopping:
            try:
                message = await self.mailbox.get()
            except MailboxClosed:
                return
            if isinstance(message, _Crash):
                self._where = "outside handle (fail() or a spawned task)"
                raise message.exc
            self._in_hand = [message]
            self._where, self._handling = "handling", message
            try:
                await self.handle(message)
            except Exception as exc:
                self._in_hand = []
                try:
                    await self.on_failure(message, exc)
                except Exception:
                    log.exception(
                        "actor %s: on_failure raised for %s", self.name, describe(message)
                    )
                raise
            self._in_hand = []
            self.processed += 1

    def _where_text(self) -> str:
        return f"handling {describe(self._handling)}" if self._where == "handling" else self._where

    async def _stop_requested_within(self, delay: float) -> bool:
        try:
            await asyncio.wait_for(self._stop_event.wait(), delay)
            return True
        except TimeoutError:
            return self._stopping

    async def _release(self) -> None:
        """on_stop (if on_start completed), then cancel the background tasks."""
        if self._hooks_live:
            self._hooks_live = False
            try:
                await self.on_stop()
            except Exception:
                log.exception("actor %s: on_stop raised", self.name)
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _is_fatal(self, exc: BaseException | None) -> bool:
        while exc is not None:
            if isinstance(exc, self.fatal):
                return True
            exc = exc.__cause__
        return False

    def _escalate(self, exc: BaseException, reason: str) -> None:
        self.failure = ActorFailed(self.name, exc, reason)
        self.state = ActorState.FAILED
        self.mailbox.close()
        log.error("actor %s failed: %s: %s (%s)", self.name, type(exc).__name__, exc, reason)
        self._notify()

    async def _finish(self, state: ActorState) -> None:
        await self._release()
        self.mailbox.close()
        self._report_unprocessed(self.mailbox.clear())
        self.state = state

    def _report_unprocessed(self, messages: list[Any]) -> None:
        self.unprocessed += len(messages)
        if messages:
            try:
                self.on_unprocessed(messages)
            except Exception:
                log.exception("actor %s: on_unprocessed raised", self.name)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if isinstance(exc, MailboxClosed) and self.mailbox.closed:
            return  # the actor is draining or stopping: a sender to its own mailbox just ends
        if self.done:
            log.error(
                "actor %s: background task %s failed after the actor ended",
                self.name,
                task.get_name(),
                exc_info=exc,
            )
            return
        self.fail(exc)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)
        if not task.cancelled() and task.exception() is not None:
            # A bug in the runtime itself: never let it pass silently.
            exc = task.exception()
            assert exc is not None
            if self.failure is None:
                self._escalate(exc, "the actor's task raised")
            self.state = ActorState.FAILED
        self._notify()

    def _notify(self) -> None:
        for callback in self._watchers:
            try:
                callback(self)
            except Exception:
                log.exception("actor %s: watcher raised", self.name)
