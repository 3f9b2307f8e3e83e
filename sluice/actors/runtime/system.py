"""ActorSystem: owns a set of actors, starts them, watches them, shuts them down in order.

Declare who sends to whom with `add(actor, sends_to=[...])`; the system orders the actors upstream
first (a topological order; ties keep the order of `add`). It starts them downstream first, so a
receiver is running before anyone sends to it, and shuts them down upstream first, so what an
upstream actor finishes while draining still finds its receivers open. Only forward edges need
declaring: a reply sent upstream during shutdown may meet a closed mailbox (`MailboxClosed`).

`run()` starts everything and returns once a shutdown has completed (`request_shutdown`, or a
signal after `install_signal_handlers`: the first drains, a second stops at once). If an actor
escalates a crash, `run()` logs "actor X failed: ...; shutting down", stops the others and raises
`ActorFailed`, so the process exits non-zero instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable
from typing import TypeVar

from sluice.actors.runtime.actor import Actor, ActorFailed

log = logging.getLogger("sluice.actors")

A = TypeVar("A", bound=Actor)


class ActorSystem:
    def __init__(
        self,
        name: str = "sluice",
        *,
        drain_timeout: float | None = 60.0,
        stop_timeout: float | None = 10.0,
    ) -> None:
        self.name = name
        self.drain_timeout = drain_timeout  # per actor; then it is stopped
        self.stop_timeout = stop_timeout  # per actor; then its task is cancelled
        self.failure: ActorFailed | None = None
        self.unprocessed: dict[str, int] = {}  # after shutdown: messages each actor left
        self._added: list[Actor] = []
        self._sends_to: dict[int, list[Actor]] = {}
        self._wake = asyncio.Event()
        self._shutdown_requested = False
        self._graceful = True
        self._shutdown_task: asyncio.Task[dict[str, int]] | None = None
        self._current: Actor | None = None  # the actor being drained or stopped

    def add(self, actor: A, *, sends_to: Iterable[Actor] = ()) -> A:
        if any(a is actor for a in self._added):
            raise ValueError(f"actor {actor.name} was already added")
        if any(a.name == actor.name for a in self._added):
            raise ValueError(f"an actor named {actor.name!r} was already added")
        self._added.append(actor)
        self._sends_to[id(actor)] = list(sends_to)
        actor.watch(self._on_actor_event)
        return actor

    @property
    def actors(self) -> list[Actor]:
        """Upstream first: the shutdown order (start is the reverse)."""
        known = {id(a) for a in self._added}
        indegree = {id(a): 0 for a in self._added}
        for actor in self._added:
            for target in self._sends_to[id(actor)]:
                if id(target) not in known:
                    raise ValueError(
                        f"{actor.name} sends to {target.name}, which is not in the system"
                    )
                indegree[id(target)] += 1
        position = {id(a): i for i, a in enumerate(self._added)}
        order: list[Actor] = []
        ready = [a for a in self._added if indegree[id(a)] == 0]
        while ready:
            actor = ready.pop(0)
            order.append(actor)
            for target in self._sends_to[id(actor)]:
                indegree[id(target)] -= 1
                if indegree[id(target)] == 0:
                    ready.append(target)
                    ready.sort(key=lambda a: position[id(a)])
        if len(order) != len(self._added):
            cyclic = sorted(a.name for a in self._added if indegree[id(a)] > 0)
            raise ValueError(f"sends_to forms a cycle among {cyclic}: declare only forward edges")
        return order

    # -- running ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the actors downstream first. Raises `ActorFailed` if one fails to start."""
        for actor in reversed(self.actors):
            await actor.start()

    async def run(self) -> None:
        """Start, then `wait`. Cancelling it stops the actors before it ends."""
        try:
            try:
                await self.start()
            except ActorFailed:
                pass  # wait() reports it and shuts down
            await self.wait()
        except asyncio.CancelledError:
            self.request_shutdown(graceful=False)
            await self.shutdown(graceful=False)
            raise

    async def wait(self) -> None:
        """Until a requested shutdown has completed, or every actor has ended by itself. Raises
        `ActorFailed` (after stopping the others) as soon as an actor escalates a crash."""
        while True:
            self._wake.clear()
            if self.failure is not None:
                await self._fail()
            if self._shutdown_requested:
                await self.shutdown(graceful=self._graceful)
                if self.failure is not None:
                    await self._fail()
                return
            if self._added and all(actor.done for actor in self._added):
                return
            await self._wake.wait()

    def request_shutdown(self, graceful: bool = True) -> None:
        """Ask `wait`/`run` to shut down: drain (graceful) or stop. Safe from any callback."""
        self._shutdown_requested = True
        if not graceful:
            self._graceful = False
            if self._current is not None:
                self._current.request_stop()
        self._wake.set()

    async def shutdown(self, graceful: bool = True) -> dict[str, int]:
        """Drain (or stop) the actors upstream first; returns each actor's unprocessed count."""
        if not graceful:
            self._graceful = False
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.get_running_loop().create_task(
                self._shutdown_in_order(), name=f"actor-system:{self.name}:shutdown"
            )
        return await asyncio.shield(self._shutdown_task)

    def install_signal_handlers(
        self,
        signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    ) -> Callable[[], None]:
        """First signal: drain in order; a second: stop now. Returns a function removing them."""
        loop = asyncio.get_running_loop()
        installed = list(signals)

        def on_signal(sig: signal.Signals) -> None:
            if not self._shutdown_requested:
                log.warning(
                    "received %s: draining actors (send it again to stop at once)", sig.name
                )
                self.request_shutdown(graceful=True)
            else:
                log.warning("received %s again: stopping actors now", sig.name)
                self.request_shutdown(graceful=False)

        for sig in installed:
            loop.add_signal_handler(sig, on_signal, sig)

        def remove() -> None:
            for sig in installed:
                loop.remove_signal_handler(sig)

        return remove

    # -- internals -------------------------------------------------------------------------------

    async def _shutdown_in_order(self) -> dict[str, int]:
        for actor in self.actors:
            self._current = actor
            if self._graceful and self.failure is None:
                left = await actor.drain(self.drain_timeout)
            else:
                left = await actor.stop(self.stop_timeout)
            self.unprocessed[actor.name] = left
        self._current = None
        total = sum(self.unprocessed.values())
        log.info(
            "actor system %s shut down (%s)%s",
            self.name,
            "drained" if self._graceful and self.failure is None else "stopped",
            f", {total} message(s) left unprocessed" if total else "",
        )
        return dict(self.unprocessed)

    async def _fail(self) -> None:
        failure = self.failure
        assert failure is not None
        log.critical(
            "actor %s failed: %s: %s (%s); shutting down",
            failure.actor_name,
            type(failure.cause).__name__,
            failure.cause,
            failure.reason,
        )
        self.request_shutdown(graceful=False)
        await self.shutdown(graceful=False)
        raise failure

    def _on_actor_event(self, actor: Actor) -> None:
        if actor.failure is not None and self.failure is None:
            self.failure = actor.failure
            if self._current is not None:
                self._current.request_stop()
        self._wake.set()
