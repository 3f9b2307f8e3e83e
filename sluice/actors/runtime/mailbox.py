"""A bounded mailbox: the only way messages reach an actor.

`put` waits while the mailbox is full, so a fast sender slows down to the pace of its receiver
(backpressure) instead of growing a queue without bound; `put_nowait` raises `MailboxFull` instead.
`close` stops new messages: puts (waiting ones included) raise `MailboxClosed`, while the consumer
still gets everything already queued and then `MailboxClosed` (end of stream).

A second, unbounded *control* lane carries the runtime's own signals (a background task's crash)
ahead of ordinary messages; it never counts towards `depth` and is not for application messages.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class MailboxFull(Exception):
    """`put_nowait` found the mailbox at capacity."""


class MailboxClosed(Exception):
    """The mailbox takes no more messages (put), or is closed and empty (get: end of stream)."""


class Mailbox:
    def __init__(self, capacity: int, name: str = "mailbox") -> None:
        if capacity < 1:
            raise ValueError(f"mailbox capacity must be at least 1, got {capacity}")
        self.name = name
        self._capacity = capacity
        self._items: deque[Any] = deque()
        self._control: deque[Any] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    # -- metrics ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def depth(self) -> int:
        """Messages queued and not yet taken by the consumer."""
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def full(self) -> bool:
        return len(self._items) >= self._capacity

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Mailbox {self.name} {self.depth}/{self._capacity} {state}>"

    # -- sending ---------------------------------------------------------------------------------

    async def put(self, message: Any) -> None:
        """Queue `message`, waiting while the mailbox is full. Raises `MailboxClosed`."""
        while True:
            if self._closed:
                raise MailboxClosed(f"{self.name} is closed")
            if not self.full():
                self._items.append(message)
                _wake_one(self._getters)
                return
            waiter = asyncio.get_running_loop().create_future()
            self._putters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                _discard(self._putters, waiter)
                # We may have been woken for a free slot just before being cancelled: pass it on.
                if not self.full() and not waiter.cancelled():
                    _wake_one(self._putters)
                raise

    def put_nowait(self, message: Any) -> None:
        """Queue `message` now or raise `MailboxFull` / `MailboxClosed`."""
        if self._closed:
            raise MailboxClosed(f"{self.name} is closed")
        if self.full():
            raise MailboxFull(f"{self.name} is full ({self._capacity} messages)")
        self._items.append(message)
        _wake_one(self._getters)

    def put_control(self, message: Any) -> None:
        """Runtime-internal: deliver `message` before any queued message, even when closed."""
        self._control.append(message)
        _wake_one(self._getters)

    # -- receiving -------------------------------------------------------------------------------

    async def get(self) -> Any:
        """The next message; waits while empty. Raises `MailboxClosed` once closed and drained."""
        while True:
            if self._control:
                return self._control.popleft()
            if self._items:
                message = self._items.popleft()
                _wake_one(self._putters)
                return message
            if self._closed:
                raise MailboxClosed(f"{self.name} is closed and drained")
            waiter = asyncio.get_running_loop().create_future()
            self._getters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()
                _discard(self._getters, waiter)
                if (self._items or self._control) and not waiter.cancelled():
                    _wake_one(self._getters)
                raise

    def __aiter__(self) -> Mailbox:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.get()
        except MailboxClosed:
            raise StopAsyncIteration from None

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Take no more messages. Waiting senders get `MailboxClosed`; queued messages stay."""
        if self._closed:
            return
        self._closed = True
        _wake_all(self._putters)
        _wake_all(self._getters)

    def clear(self) -> list[Any]:
        """Remove and return every queued message (control messages are kept)."""
        left = list(self._items)
        self._items.clear()
        _wake_all(self._putters)
        return left


def _wake_one(waiters: deque[asyncio.Future[None]]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return


def _wake_all(waiters: deque[asyncio.Future[None]]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)


def _discard(waiters: deque[asyncio.Future[None]], waiter: asyncio.Future[None]) -> None:
    try:
        waiters.remove(waiter)
    except ValueError:
        pass
