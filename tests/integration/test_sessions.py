"""The session store against real Redis, and its degraded mode when Redis is gone or silent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from sluice.connectors.sessions import SessionRecord, SessionStore, redact, session_key

pytestmark = pytest.mark.integration

OUTAGE_LINE = "sessions will not reuse the prefix cache until it returns"
RECOVERY_LINE = "is reachable again"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(**changes) -> SessionRecord:
    base = dict(
        tenant="acme",
        session_id=f"s-{uuid.uuid4().hex[:8]}",
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}],
        token_ids=[1, 2, 3, 4, 5],
        owner="runner-0",
        model="smollm2",
        turns=1,
    )
    return SessionRecord(**{**base, **changes})


async def test_record_round_trip_with_ttl_set_and_refreshed(redis_url):
    raw = aioredis.Redis.from_url(redis_url)
    async with SessionStore(redis_url, ttl_s=60) as store:
        rec = record()
        key = session_key(rec.tenant, rec.session_id)
        try:
            assert await store.get(rec.tenant, rec.session_id) is None
            before = time.time()
            assert await store.update(rec)
            got = await store.get("acme", rec.session_id)
            assert got == rec and got.last_used >= before
            assert 55 <= await raw.ttl(key) <= 60

            # Another turn: the record grows and the TTL starts over.
            await raw.expire(key, 5)
            got.messages += [{"role": "user", "content": "and then?"}]
            got.token_ids += [6, 7]
            got.turns, got.owner = 2, "runner-1"
            assert await store.update(got)
            assert 55 <= await raw.ttl(key) <= 60
            again = await store.get("acme", rec.session_id)
            assert again.turns == 2 and again.owner == "runner-1"
            assert again.token_ids == [1, 2, 3, 4, 5, 6, 7] and len(again.messages) == 3

            # Tenants are kept apart, and a session without tenant is its own namespace.
            assert await store.get("other", rec.session_id) is None
            assert await store.get(None, rec.session_id) is None

            assert await store.delete("acme", rec.session_id)
            assert await store.get("acme", rec.session_id) is None
            assert not await store.delete("acme", rec.session_id)
            assert store.available and store.failures == 0
        finally:
            await raw.delete(key)
            await raw.aclose()


async def test_keys_escape_separators_and_unreadable_records_are_ignored(redis_url):
    assert session_key("a:b", "c") != session_key("a", "b:c")
    assert session_key(None, "s") == "sluice:session::s"
    raw = aioredis.Redis.from_url(redis_url)
    async with SessionStore(redis_url) as store:
        key = session_key("acme", "broken")
        try:
            await raw.set(key, b"{not json", ex=60)
            assert await store.get("acme", "broken") is None
            assert store.errors == 1 and store.available
        finally:
            await raw.delete(key)
            await raw.aclose()


async def test_redis_down_get_returns_none_update_no_ops_fast_and_logs_once(caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with SessionStore(url, probe_interval=60) as store:
        with caplog.at_level(logging.WARNING, logger="sluice.connectors.sessions"):
            started = time.monotonic()
            assert await store.get("acme", "s1") is None
            assert not store.available and store.failures == 1
            for _ in range(20):  # in the back-off window: not even tried
                assert await store.get("acme", "s1") is None
                assert await store.update(record()) is False
                assert await store.delete("acme", "s1") is False
            elapsed = time.monotonic() - started
        assert elapsed < 1.5
        assert store.failures == 1 and store.skipped == 60 and store.outages == 1
        assert caplog.text.count(OUTAGE_LINE) == 1
        assert f"Redis unreachable at {url}" in caplog.text


async def test_silent_redis_times_out_within_the_socket_timeout():
    # A server that accepts connections and never answers: the worst case for a client.
    clients: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        clients.append(writer)
        await reader.read()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with SessionStore(f"redis://127.0.0.1:{port}/0", socket_timeout=0.3) as store:
            started = time.monotonic()
            assert await store.get("acme", "s1") is None
            assert await store.update(record()) is False  # skipped: in the back-off window
            assert time.monotonic() - started < 1.5
            assert not store.available and store.failures == 1 and store.skipped == 1
    finally:
        for writer in clients:
            writer.close()
        server.close()
        await server.wait_closed()


class Forwarder:
    """A TCP relay in front of the real Redis that can be cut and restored (an outage)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def down(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        self.writers.clear()
        await self.server.wait_closed()

    async def _relay(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]

        async def pipe(src, dst) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_outage_and_recovery_are_logged_once_each(redis_url, caplog):
    target = urlsplit(redis_url)
    relay = Forwarder(target.hostname, target.port or 6379)
    await relay.up()
    rec = record()
    store = SessionStore(f"redis://127.0.0.1:{relay.port}{target.path or '/0'}", probe_interval=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="sluice.connectors.sessions"):
            assert await store.update(rec)
            await relay.down()
            assert await store.get(rec.tenant, rec.session_id) is None
            assert not store.available
            await relay.up()
            assert await store.get(rec.tenant, rec.session_id) is None  # before the next probe
            await asyncio.sleep(0.4)
            got = await store.get(rec.tenant, rec.session_id)
            assert got is not None and got.token_ids == rec.token_ids
            assert store.available and store.outages == 1
        assert caplog.text.count(OUTAGE_LINE) == 1
        assert caplog.text.count(RECOVERY_LINE) == 1
    finally:
        await store.delete(rec.tenant, rec.session_id)
        await store.close()
        await relay.down()


def test_redact_hides_the_password():
    assert redact("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://:secret@host/0") == "redis://:***@host/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


# -- turns: idempotent and ordered ---------------------------------------------------------------


def turn_messages(*pairs: tuple[str, str]) -> list[dict]:
    out = []
    for user, reply in pairs:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return out


async def test_a_turn_recorded_again_replaces_its_own_entry(redis_url):
    async with SessionStore(redis_url) as store:
        sid = f"s-{uuid.uuid4().hex[:8]}"
        try:
            one = turn_messages(("hi", "hello"))
            assert await store.record_turn("t", sid, "turn-1", one, [1, 2, 3], (0, 0))
            assert await store.record_turn("t", sid, "turn-1", one, [1, 2, 3], (0, 0))  # replayed
            rec = await store.get("t", sid)
            assert rec.turn_ids == ["turn-1"] and rec.turns == 1 and rec.messages == one

            two = one + turn_messages(("and?", "more"))
            assert await store.record_turn("t", sid, "turn-2", two, [1, 2, 3, 4, 5], (2, 3))
            rec = await store.get("t", sid)
            assert rec.turn_ids == ["turn-1", "turn-2"] and rec.messages == two
            # a turn served again is built on the conversation before it, not after it
            assert await store.history_for("t", sid, "turn-2") == (one, [1, 2, 3])
            assert await store.history_for("t", sid, "turn-1") == ([], [])
            assert await store.history_for("t", sid, "turn-3") == (two, [1, 2, 3, 4, 5])
            # and replaces its entry (and what came after it)
            assert await store.record_turn("t", sid, "turn-1", one, [1, 2, 3], (0, 0))
            rec = await store.get("t", sid)
            assert rec.turn_ids == ["turn-1"] and rec.messages == one and rec.turns == 1
        finally:
            await store.delete("t", sid)


async def test_one_turn_in_flight_per_session(redis_url):
    async with SessionStore(redis_url) as store:
        sid = f"s-{uuid.uuid4().hex[:8]}"
        try:
            wins = await asyncio.gather(*(store.begin_turn("t", sid, f"r{i}") for i in range(12)))
            assert sum(wins) == 1  # the transaction lets exactly one of them in
            first = f"r{wins.index(True)}"
            assert await store.begin_turn("t", sid, first)  # again: it is still its turn
            other = "r0" if first != "r0" else "r1"
            assert not await store.begin_turn("t", sid, other)
            await store.record_turn("t", sid, first, turn_messages(("a", "b")), [1], (0, 0))
            assert (await store.get("t", sid)).pending is None
            assert await store.begin_turn("t", sid, other)
            assert await store.end_turn("t", sid, other)  # it failed: nothing to remember
            assert await store.begin_turn("t", sid, "r-late")
            assert await store.begin_turn("t", sid, "r-forced", force=True)
            assert (await store.get("t", sid)).pending == "r-forced"
        finally:
            await store.delete("t", sid)


async def test_a_turn_served_again_is_not_held_up_by_a_later_turn_that_ran_ahead(redis_url):
    """After a crash, turn 1 (offset 5) is delivered again while the record still says turn 2
    (offset 9, begun by the dead process) is pending: turn 2 comes again behind turn 1, so turn 1
    must not wait for it (each would wait for the other)."""
    async with SessionStore(redis_url) as store:
        sid = f"s-{uuid.uuid4().hex[:8]}"
        try:
            assert await store.begin_turn("t", sid, "turn-2", position=("req", 3, 9))
            assert not await store.begin_turn("t", sid, "turn-3", position=("req", 3, 12))
            assert not await store.begin_turn("t", sid, "turn-x", position=("req", 1, 2))
            assert not await store.begin_turn("t", sid, "turn-y")  # no position: it waits
            assert await store.begin_turn("t", sid, "turn-1", position=("req", 3, 5))
            rec = await store.get("t", sid)
            assert rec.pending == "turn-1" and rec.pending_at == ("req", 3, 5)
            assert not await store.begin_turn("t", sid, "turn-2", position=("req", 3, 9))
            await store.record_turn("t", sid, "turn-1", turn_messages(("a", "b")), [1], (0, 0))
            assert await store.begin_turn("t", sid, "turn-2", position=("req", 3, 9))
        finally:
            await store.delete("t", sid)


async def test_a_turn_waits_out_a_short_outage_and_is_recorded(redis_url, caplog):
    target = urlsplit(redis_url)
    relay = Forwarder(target.hostname, target.port or 6379)
    await relay.up()
    url = f"redis://127.0.0.1:{relay.port}{target.path or '/0'}"
    sid = f"s-{uuid.uuid4().hex[:8]}"
    store = SessionStore(url, probe_interval=5, outage_wait_s=20)
    try:
        assert await store.check()
        await relay.down()
        with caplog.at_level(logging.WARNING, logger="sluice.connectors.sessions"):
            answer = asyncio.ensure_future(
                store.record_turn("t", sid, "turn-1", turn_messages(("a", "b")), [1, 2], (0, 0))
            )
            await asyncio.sleep(1.5)
            assert not answer.done()  # waiting for Redis, not dropped
            await relay.up()
            assert await asyncio.wait_for(answer, 10)
        assert "session turns wait up to 20 s" in caplog.text
        assert (await store.get("t", sid)).turn_ids == ["turn-1"]
    finally:
        await store.delete("t", sid)
        await store.close()
        await relay.down()

    # An outage longer than the wait: the turn goes on without Redis after outage_wait_s.
    await relay.up()
    store = SessionStore(url, probe_interval=5, outage_wait_s=0.6)
    try:
        assert await store.check()
        await relay.down()
        started = time.monotonic()
        assert await store.history_for("t", sid, "turn-2") is None
        assert 0.5 < time.monotonic() - started < 3
        assert not store.available
    finally:
        await store.close()
        await relay.down()
