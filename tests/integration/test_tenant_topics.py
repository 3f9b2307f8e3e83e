"""Tenancy from the transport (`sluice run --tenant-topics`): a request published on
PREFIX.requests.<tenant> is that tenant's, whatever its payload says; one naming another tenant is
refused, naming the field; the shared PREFIX.requests keeps taking the tenant from the payload.
Sessions are kept per tenant in Redis, which shows whose each request was."""

from __future__ import annotations

import asyncio

import pytest

from sluice.connectors.sessions import SessionStore
from sluice.connectors.topics import ensure_topics
from sluice.testing.pipeline_harness import PipelineProcess, collect, new_prefix, publish, request

pytestmark = pytest.mark.integration

ASK = {"messages": [{"role": "user", "content": "Say hi."}], "temperature": 0, "max_tokens": 3}


async def session_of(store: SessionStore, tenant: str | None, session_id: str, timeout=15.0):
    """The session's record, once the streamer has written it (just after the final event)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        record = await store.get(tenant, session_id)
        if record is not None:
            return record
        await asyncio.sleep(0.2)
    return None


async def test_the_topic_decides_the_tenant(bootstrap_servers, redis_url, tmp_path):
    prefix = new_prefix()
    acme = f"{prefix}.requests.acme"
    await ensure_topics(bootstrap_servers, {acme: 2})
    process = PipelineProcess(bootstrap_servers, redis_url, prefix, tmp_path, "--tenant-topics")
    try:
        process.wait_ready()
        await publish(
            bootstrap_servers,
            acme,
            [
                request("on-acme", session_id=f"{prefix}-s1", **ASK),
                request("acme-as-other", tenant="other", session_id=f"{prefix}-s2", **ASK),
            ],
        )
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [request("shared", tenant="other", session_id=f"{prefix}-s3", **ASK)],
        )
        streams = await collect(
            bootstrap_servers, prefix, {"on-acme", "acme-as-other", "shared"}, timeout=180
        )
        async with SessionStore(redis_url) as store:
            acme_session = await session_of(store, "acme", f"{prefix}-s1")
            untenanted = await store.get(None, f"{prefix}-s1")
            shared_session = await session_of(store, "other", f"{prefix}-s3")
            refused_session = await store.get("other", f"{prefix}-s2")
    finally:
        process.stop()
    assert streams.finals("on-acme")[0]["type"] == "final"
    (refused,) = streams.finals("acme-as-other")
    assert refused["type"] == "error" and refused["field"] == "tenant"
    assert "acme" in refused["message"] and "other" in refused["message"]
    assert streams.finals("shared")[0]["type"] == "final"
    assert acme_session is not None and untenanted is None
    assert shared_session is not None and refused_session is None
