"""A poison request on the real broker: a fault injected for one prompt (SLUICE_INJECT_FAULT, the
engine's test hook). Raised inside the engine, it ends that request with finish_reason "error" and
an internal error while the requests batched with it finish normally. Crashing the process
instead, it is taken up alone after each restart (so the requests that were in the engine with it
are not blamed) and, after --max-crashes such crashes, dead-lettered rather than looping."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from sluice.testing.pipeline_harness import PipelineProcess, Streams, Watcher, new_prefix, publish

pytestmark = pytest.mark.integration

MARKER = "POISON-PILL-7731"


def requests() -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(5):
        body = {
            "request_id": f"ok-{i}",
            "prompt": f"Note {i}: the sea is",
            "temperature": 0,
            "max_tokens": 12,
            "ignore_eos": True,
        }
        out.append((body["request_id"].encode(), json.dumps(body).encode()))
    poison = {
        "request_id": "poison",
        "prompt": f"Repeat after me: {MARKER}",
        "temperature": 0,
        "max_tokens": 12,
    }
    out.insert(2, (b"poison", json.dumps(poison).encode()))
    return out


def final_of(streams: Streams, rid: str) -> dict:
    (final,) = {json.dumps(e, sort_keys=True) for e in streams.events[rid] if e["type"] == "final"}
    return json.loads(final)


async def test_a_fault_raised_in_the_engine_ends_only_its_request(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    env = {"SLUICE_INJECT_FAULT": f"raise:{MARKER}"}
    process = PipelineProcess(bootstrap_servers, None, prefix, tmp_path, env=env)
    ids = {"poison", *(f"ok-{i}" for i in range(5))}
    try:
        process.wait_ready()
        async with Watcher(bootstrap_servers, prefix) as watcher:
            await publish(bootstrap_servers, f"{prefix}.requests", requests())
            streams = await watcher.wait_finals(ids, timeout=120)
    finally:
        code = process.stop()
    assert code == 0, process.tail()
    poison = final_of(streams, "poison")
    assert poison["finish_reason"] == "error" and poison["error"]["code"] == "internal"
    assert "InjectedFault" in poison["error"]["message"]
    for i in range(5):
        final = final_of(streams, f"ok-{i}")
        assert final["finish_reason"] == "length" and "error" not in final
        assert final["usage"]["completion_tokens"] == 12


async def test_a_request_that_crashes_the_process_is_dead_lettered(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    env = {"SLUICE_INJECT_FAULT": f"exit:{MARKER}"}
    ids = {"poison", *(f"ok-{i}" for i in range(5))}
    processes: list[PipelineProcess] = []
    exits = []

    def start() -> None:
        process = PipelineProcess(
            bootstrap_servers,
            None,
            prefix,
            tmp_path,
            "--max-crashes",
            "2",
            env=env,
            name=f"run-{len(processes)}",
        )
        processes.append(process)
        process.wait_ready()

    try:
        start()
        async with Watcher(bootstrap_servers, prefix) as watcher:
            await publish(bootstrap_servers, f"{prefix}.requests", requests())
            deadline = time.monotonic() + 300
            while not all(watcher.streams.finals(rid) for rid in ids):
                assert time.monotonic() < deadline, [p.tail() for p in processes[-2:]]
                if processes[-1].proc.poll() is not None:  # crashed: restart it, as systemd would
                    exits.append(processes[-1].proc.returncode)
                    assert len(exits) <= 6, "the poison request keeps crashing the process"
                    start()
                await asyncio.sleep(0.3)
            await watcher.caught_up()
            streams = watcher.streams
            dead = [e for e in streams.dead_letters if e.get("request_id") == "poison"]
        code = processes[-1].stop()
    finally:
        for p in processes:
            p.kill()
    assert code == 0, processes[-1].tail()
    assert exits and set(exits) == {70}, exits  # the injected crash, and nothing else
    assert len(dead) >= 1 and dead[0]["code"] == "internal"
    assert "dead-lettered" in dead[0]["message"] and dead[0]["raw_size"] > 0
    poison = final_of(streams, "poison")
    assert poison["finish_reason"] == "error" and "dead-lettered" in poison["error"]["message"]
    for i in range(5):  # in the engine with it when it crashed, but not blamed
        final = final_of(streams, f"ok-{i}")
        assert final["finish_reason"] == "length", final
        assert final["usage"]["completion_tokens"] == 12
