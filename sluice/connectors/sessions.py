"""Sessions in Redis: what a conversation said so far, and which runner holds its KV cache.

One JSON string per tenant and session at ``sluice:session:{tenant}:{session}``, written with its
TTL in one `SET ... EX` so a record never lives without an expiry. Every update refreshes the TTL;
reads do not (a turn reads at its start and updates at its end).

A record remembers its turns by request id, with where each began in the conversation
(`turn_ids`, `turn_starts`), so a turn served again (after a crash, before its input offset was
committed) replaces its own entry instead of adding a second copy, and is built on the
conversation before it (`history_for`). A turn in flight is marked `pending` (`begin_turn`) until
its answer is recorded (`record_turn`) or it ends otherwise (`end_turn`), so the session's next
turn can wait for it. Updates are read-modify-write in a Redis transaction (WATCH/MULTI), retried
when another writer got there first.

Redis going away never stops the pipeline. An outage that begins while serving (a restart, a
failover) is ridden out: for up to `outage_wait_s` the calls of a session turn (its start, its
history, its answer) wait and retry, so the turn is built on, and recorded in, the conversation
as it is. Past that, or when Redis was unreachable from the start, sessions degrade: no method
raises, reads return None, writes do nothing, `available` turns False and one warning is logged
per outage (a conversation's next turn is then served without its history). Short socket timeouts
keep a dead Redis from stalling the pipeline, and while it is down only one call every
`probe_interval` seconds tries it; the others return at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError, WatchError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.connectors.settings import redis_url

log = logging.getLogger(__name__)

T = TypeVar("T")

KEY_PREFIX = "sluice:session"
DEFAULT_TTL_S = 3600
DEFAULT_SOCKET_TIMEOUT_S = 0.5
DEFAULT_PROBE_INTERVAL_S = 5.0
DEFAULT_OUTAGE_WAIT_S = 30.0  # how long a turn waits for Redis to come back (a restart, a failover)
OUTAGE_RETRY_S = 0.25
# Requests without a tenant share this one; tenant ids are never empty, so it cannot collide.
NO_TENANT = ""


class SessionRecord(BaseModel):
    """A conversation as of its last finished turn.

    `messages` are the chat messages so far (``{"role": ..., "content": ...}``), assistant replies
    included; `token_ids` the full conversation as the model saw it, prompt and generated tokens,
    which is what the next turn's prefix match runs on. `owner` is the runner holding its KV
    blocks; `model` the model those token ids belong to (a different model cannot reuse them).
    """

    model_config = ConfigDict(extra="ignore")  # records written by newer versions stay readable

    tenant: str = NO_TENANT
    session_id: str
    messages: list[dict[str, Any]] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    owner: str | None = None
    model: str | None = None
    turns: int = 0
    last_used: float = 0.0  # unix time of the last update
    # Per answered turn: its request id, and the (messages, token ids) the conversation had
    # before it.
    turn_ids: list[str] = Field(default_factory=list)
    turn_starts: list[tuple[int, int]] = Field(default_factory=list)
    pending: str | None = None  # the request id of a turn being served
    # Where that turn's request stands in the input: (topic, partition, offset).
    pending_at: tuple[str, int, int] | None = None

    def before(self, request_id: str) -> tuple[list[dict[str, Any]], list[int]]:
        """The conversation as it was before `request_id`'s turn (all of it, for a new turn)."""
        if request_id in self.turn_ids:
            n_messages, n_tokens = self.turn_starts[self.turn_ids.index(request_id)]
            return self.messages[:n_messages], self.token_ids[:n_tokens]
        return self.messages, self.token_ids

    @field_validator("tenant", mode="before")
    @classmethod
    def _no_tenant(cls, value: Any) -> Any:
        return NO_TENANT if value is None else value


def _stands_after(pending: tuple[str, int, int] | None, mine: tuple[str, int, int] | None) -> bool:
    """Whether the pending turn's request comes after this one in the same input partition."""
    if pending is None or mine is None:
        return False
    return tuple(pending[:2]) == tuple(mine[:2]) and pending[2] > mine[2]


class RedisRefused(RuntimeError):
    """Redis answered, and refused the credentials."""

    def __init__(self, url: str, exc: Exception):
        super().__init__(
            f"Redis at {redact(url)} refused the credentials ({exc}): give the password in the "
            "URL, redis://:PASSWORD@HOST:PORT/DB (--redis-url or REDIS_URL)"
        )


def session_key(tenant: str | None, session_id: str) -> str:
    """The Redis key of a session; ':' and '%' in ids are escaped so keys cannot collide."""
    return f"{KEY_PREFIX}:{_escape(tenant or NO_TENANT)}:{_escape(session_id)}"


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace(":", "%3A")


def redact(url: str) -> str:
    """The URL without its password, for log lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))


class SessionStore:
    """Session records in Redis that degrade to "no sessions" while Redis is unreachable."""

    def __init__(
        self,
        url: str | None = None,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT_S,
        probe_interval: float = DEFAULT_PROBE_INTERVAL_S,
        outage_wait_s: float = DEFAULT_OUTAGE_WAIT_S,
    ) -> None:
        self.url = url = url or redis_url()
        self.ttl_s = ttl_s
        self.socket_timeout = socket_timeout
        self.probe_interval = probe_interval
        self.outage_wait_s = outage_wait_s
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            # One immediate retry on a broken connection (a pooled one from before a Redis
            # restart); none on timeouts, which would only double the stall.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            retry_on_timeout=False,
        )
        self.available = True
        self._down_since: float | None = None
        self._next_probe = 0.0
        self._seen_up = False  # an outage is ridden out only after Redis was seen serving
        self._ride_until = 0.0  # until when the turns wait for Redis in this outage
        # Counters for metrics.
        self.failures = 0  # calls that failed because Redis was unreachable or too slow
        self.skipped = 0  # calls not tried because Redis was down and no probe was due
        self.errors = 0  # calls Redis answered with an error, or records that did not parse
        self.outages = 0

    async def close(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> SessionStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def verify_credentials(self) -> None:
        """Raise RedisRefused when Redis answers but refuses this client (a wrong or missing
        password); an unreachable Redis is not an error here (sessions wait for it)."""
        try:
            await asyncio.wait_for(self._client.ping(), self.socket_timeout * 4)
        except AuthenticationError as exc:
            raise RedisRefused(self.url, exc) from None
        except ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise RedisRefused(self.url, exc) from None
            raise
        except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError):
            pass

    async def check(self) -> bool:
        """Ping Redis (subject to the probe back-off); True when it answered."""
        return bool(await self._call("ping", lambda r: r.ping(), False))

    async def get(
        self, tenant: str | None, session_id: str, *, wait: bool = False
    ) -> SessionRecord | None:
        """The session's record; None when there is none, or Redis is unreachable (`wait`: once
        a new outage has lasted `outage_wait_s`)."""
        raw = await self._call(
            "get", lambda r: r.get(session_key(tenant, session_id)), None, wait=wait
        )
        return self._parse(raw, tenant, session_id)

    async def update(self, record: SessionRecord) -> bool:
        """Write `record` (stamping `last_used`) and refresh its TTL; False when not written."""
        record.last_used = time.time()
        key = session_key(record.tenant, record.session_id)
        payload = record.model_dump_json()
        return bool(await self._call("update", lambda r: r.set(key, payload, ex=self.ttl_s), False))

    async def history_for(
        self, tenant: str | None, session_id: str, request_id: str
    ) -> tuple[list[dict[str, Any]], list[int]] | None:
        """The conversation a turn continues: before its own entry when it is served again."""
        record = await self.get(tenant, session_id, wait=True)
        return None if record is None else record.before(request_id)

    async def begin_turn(
        self,
        tenant: str | None,
        session_id: str,
        request_id: str,
        *,
        position: tuple[str, int, int] | None = None,
        force: bool = False,
    ) -> bool:
        """Mark the turn in flight; False (changing nothing) while another turn of the session
        is, unless `force`. True too when Redis cannot tell (sessions are an optimisation).

        `position` is where the turn's request stands in the input (topic, partition, offset).
        A pending turn that stands *after* it ran ahead in an earlier delivery (this one is being
        served again after a crash, and the later turn will come again behind it): it does not
        hold this one up, or each would wait for the other."""

        def change(record: SessionRecord | None) -> SessionRecord | None | bool:
            if record is None:
                record = SessionRecord(tenant=tenant or NO_TENANT, session_id=session_id)
            blocked = record.pending not in (None, request_id)
            if blocked and not force and not _stands_after(record.pending_at, position):
                return False
            record.pending, record.pending_at = request_id, position
            return record

        return await self._transact("begin_turn", tenant, session_id, change, True)

    async def end_turn(self, tenant: str | None, session_id: str, request_id: str) -> bool:
        """The turn ended without an answer to remember: the next turn need not wait."""

        def change(record: SessionRecord | None) -> SessionRecord | None | bool:
            if record is None or record.pending != request_id:
                return True
            record.pending, record.pending_at = None, None
            return record

        return await self._transact("end_turn", tenant, session_id, change, False)

    async def record_turn(
        self,
        tenant: str | None,
        session_id: str,
        request_id: str,
        messages: list[dict[str, Any]],
        token_ids: list[int],
        start: tuple[int, int],
        *,
        owner: str | None = None,
        model: str | None = None,
    ) -> bool:
        """Remember a turn's answer: `messages` and `token_ids` are the whole conversation after
        it, `start` where the turn began in them. A turn recorded before (served again) replaces
        its own entry and every later one, so no turn is ever held twice."""

        def change(record: SessionRecord | None) -> SessionRecord | None | bool:
            if record is None:
                record = SessionRecord(tenant=tenant or NO_TENANT, session_id=session_id)
            if request_id in record.turn_ids:
                keep = record.turn_ids.index(request_id)
                record.turn_ids = record.turn_ids[:keep]
                record.turn_starts = record.turn_starts[:keep]
            record.turn_ids.append(request_id)
            record.turn_starts.append(start)
            record.messages, record.token_ids = messages, token_ids
            record.turns = len(record.turn_ids)
            record.owner, record.model = owner, model
            if record.pending == request_id:
                record.pending, record.pending_at = None, None
            return record

        return await self._transact("record_turn", tenant, session_id, change, False)

    async def _transact(
        self,
        what: str,
        tenant: str | None,
        session_id: str,
        change: Callable[[SessionRecord | None], SessionRecord | None | bool],
        default: bool,
    ) -> bool:
        """Read the record, apply `change` (a new record to write, or True/False to write
        nothing and return that), write it: all in one WATCH/MULTI transaction, retried when the
        key changed meanwhile. `default` when Redis is unreachable."""
        key = session_key(tenant, session_id)

        async def op(client: aioredis.Redis) -> bool:
            async with client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        raw = await pipe.get(key)
                        record = self._parse(raw, tenant, session_id)
                        changed = change(record)
                        if isinstance(changed, bool):
                            await pipe.unwatch()
                            return changed
                        assert changed is not None
                        changed.last_used = time.time()
                        pipe.multi()
                        pipe.set(key, changed.model_dump_json(), ex=self.ttl_s)
                        await pipe.execute()
                        return True
                    except WatchError:
                        continue  # another writer got there first: read again

        return bool(await self._call(what, op, default, wait=True))

    def _parse(
        self, raw: bytes | str | None, tenant: str | None, session_id: str
    ) -> SessionRecord | None:
        if raw is None:
            return None
        try:
            return SessionRecord.model_validate_json(raw)
        except ValidationError as exc:
            self.errors += 1
            log.warning(
                "session %s of tenant %r has an unreadable record, ignoring it: %s",
                session_id,
                tenant,
                exc.errors()[:1],
            )
            return None

    async def delete(self, tenant: str | None, session_id: str) -> bool:
        """Remove the session; True when a record was removed."""
        removed = await self._call("delete", lambda r: r.delete(session_key(tenant, session_id)), 0)
        return bool(removed)

    async def _call(
        self,
        what: str,
        op: Callable[[aioredis.Redis], Awaitable[T]],
        default: T,
        *,
        wait: bool = False,
    ) -> T:
        """`op` on Redis; `default` when Redis is unreachable, unless `wait` and the outage is
        young: then retry until Redis is back or the outage is `outage_wait_s` old."""
        while True:
            riding = wait and time.monotonic() < self._ride_until
            if not self.available and time.monotonic() < self._next_probe and not riding:
                self.skipped += 1
                return default
            try:
                # The socket timeouts bound each read and connect; this bounds the whole call
                # (name resolution, the retry) so nothing can hold a turn up for long.
                result = await asyncio.wait_for(op(self._client), self.socket_timeout * 4)
                break
            except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as exc:
                self._went_down(exc)
                if wait and time.monotonic() < self._ride_until:
                    await asyncio.sleep(OUTAGE_RETRY_S)
                    continue
                return default
            except RedisError as exc:
                self.errors += 1
                log.warning("Redis %s failed: %s", what, exc)
                return default
        self._seen_up = True
        if not self.available:
            self.available = True
            log.warning(
                "Redis at %s is reachable again after %.0fs: sessions reuse the prefix cache again",
                redact(self.url),
                time.monotonic() - (self._down_since or 0),
            )
            self._down_since = None
        return result

    def _went_down(self, exc: BaseException) -> None:
        self.failures += 1
        self._next_probe = time.monotonic() + self.probe_interval
        if self.available:
            self.available = False
            self.outages += 1
            self._down_since = time.monotonic()
            if self._seen_up and self.outage_wait_s > 0:
                self._ride_until = self._down_since + self.outage_wait_s
                log.warning(
                    "Redis unreachable at %s (%s): session turns wait up to %.0f s for it to "
                    "return; after that sessions will not reuse the prefix cache until it returns",
                    redact(self.url),
                    exc.__class__.__name__,
                    self.outage_wait_s,
                )
                return
            log.warning(
                "Redis unreachable at %s (%s): sessions will not reuse the prefix cache "
                "until it returns",
                redact(self.url),
                exc.__class__.__name__,
            )
