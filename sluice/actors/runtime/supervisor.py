"""Supervision: what happens when an actor crashes.

An actor's `RestartPolicy` says whether a crash restarts it or escalates (ends the actor system, so
the process exits non-zero). A restarting actor gives up too and escalates once it has crashed more
than `max_restarts` times within `window` seconds; between restarts it waits an exponential backoff.
`Supervisor` applies one policy to one actor's crash history; it has no asyncio in it and takes a
clock, so its decisions are plain to test.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

# Final: their types are the literals, so they fit `RestartPolicy.kind`.
RESTART: Final = "restart"
ESCALATE: Final = "escalate"


@dataclass(frozen=True)
class RestartPolicy:
    kind: Literal["restart", "escalate"] = RESTART
    max_restarts: int = 3  # restarts allowed within `window` seconds; one more crash escalates
    window: float = 60.0  # seconds
    backoff: float = 0.1  # seconds before the first restart
    backoff_factor: float = 2.0
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in (RESTART, ESCALATE):
            raise ValueError(
                f"restart policy must be {RESTART!r} or {ESCALATE!r}, got {self.kind!r}"
            )
        if self.max_restarts < 0 or self.window <= 0 or self.backoff < 0 or self.backoff_factor < 1:
            raise ValueError(f"invalid restart policy {self}")

    @classmethod
    def restart(
        cls,
        max_restarts: int = 3,
        window: float = 60.0,
        backoff: float = 0.1,
        backoff_factor: float = 2.0,
        max_backoff: float = 5.0,
    ) -> RestartPolicy:
        return cls(RESTART, max_restarts, window, backoff, backoff_factor, max_backoff)

    @classmethod
    def escalate(cls) -> RestartPolicy:
        return cls(ESCALATE)

    @classmethod
    def coerce(cls, value: RestartPolicy | str) -> RestartPolicy:
        """Accept a policy or its kind's name ("restart" with default limits, "escalate")."""
        if isinstance(value, RestartPolicy):
            return value
        return cls(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay: float  # seconds to wait before restarting (0 when escalating)
    reason: str  # for the log line


class Supervisor:
    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._crashes: deque[float] = deque()

    @property
    def recent_crashes(self) -> int:
        self._forget_old(self._clock())
        return len(self._crashes)

    def on_crash(self) -> Decision:
        """Record a crash now and decide: restart after a delay, or escalate."""
        policy = self.policy
        if policy.kind == ESCALATE:
            return Decision(False, 0.0, "restart policy is escalate")
        now = self._clock()
        self._crashes.append(now)
        self._forget_old(now)
        restarts_needed = len(self._crashes)
        if restarts_needed > policy.max_restarts:
            return Decision(
                False,
                0.0,
                f"{restarts_needed} crashes within {policy.window:g}s "
                f"exceed max_restarts={policy.max_restarts}",
            )
        delay = min(
            policy.max_backoff, policy.backoff * policy.backoff_factor ** (restarts_needed - 1)
        )
        return Decision(
            True,
            delay,
            f"restart {restarts_needed}/{policy.max_restarts} "
            f"within {policy.window:g}s after {delay:.3g}s",
        )

    def _forget_old(self, now: float) -> None:
        while self._crashes and now - self._crashes[0] > self.policy.window:
            self._crashes.popleft()
