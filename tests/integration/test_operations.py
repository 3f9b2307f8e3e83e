"""Operations on the real broker: the probes a supervisor polls while `sluice run` starts, and
latency counted as the client sees it, from the request's publish. A request published while no
pipeline runs waits in its topic; its final event must say so (it once said TTFT 174 ms after a
chat turn had waited 150 s for its first token)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from sluice.connectors.topics import ensure_topics
from sluice.testing.pipeline_harness import (
    PipelineProcess,
    collect,
    free_port,
    new_prefix,
    publish,
    request,
    scrape,
    value,
)

pytestmark = pytest.mark.integration

WAIT_IN_TOPIC_S = 3.0


def probe(port: int) -> tuple[int, dict] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except OSError:
        return None  # not listening yet


async def test_readiness_while_starting_and_latency_from_publish(bootstrap_servers, tmp_path):
    prefix = new_prefix()
    await ensure_topics(bootstrap_servers, {f"{prefix}.requests": 4})
    await publish(
        bootstrap_servers,
        f"{prefix}.requests",
        [request("early", prompt="The sea is", temperature=0, max_tokens=4)],
    )
    published = time.time()
    await asyncio.sleep(WAIT_IN_TOPIC_S)  # no pipeline yet: the request waits in its topic
    port = free_port()
    process = PipelineProcess(
        bootstrap_servers, None, prefix, tmp_path, "--metrics-port", str(port)
    )
    answers: list[tuple[int, dict]] = []
    try:
        deadline = time.monotonic() + 120
        while not answers or answers[-1][0] != 200:
            assert time.monotonic() < deadline, answers[-3:] or process.tail()
            answer = probe(port)
            if answer is not None:
                answers.append(answer)
            await asyncio.sleep(0.05)
        streams = await collect(bootstrap_servers, prefix, {"early"}, timeout=120)
        # the streamer counts a request once its final is written: a reader may see it first
        samples, counted_by = scrape(port), time.monotonic() + 30
        while value(samples, "sluice_time_in_topic_seconds_count") == 0:
            assert time.monotonic() < counted_by, "the request was never counted"
            await asyncio.sleep(0.1)
            samples = scrape(port)
    finally:
        process.stop()

    # not ready until the model is loaded and the consumer has its partitions; then ready
    not_ready = [body for status, body in answers if status == 503]
    assert not_ready, "the probe never saw the pipeline starting"
    assert all(body["ready"] is False for body in not_ready)
    assert not_ready[0]["checks"]["consumer_assigned"] is False
    assert answers[-1][1] == {
        "ready": True,
        "checks": {
            "model_loaded": True,
            "consumer_assigned": True,
            "broker_reachable": True,
            "serving": True,
        },
    }

    (final,) = streams.finals("early")
    t = final["timings"]
    waited = t["in_topic_s"]
    assert waited >= WAIT_IN_TOPIC_S
    assert waited <= time.time() - published
    # queue time, TTFT and the total all include the wait in the topic
    assert t["queue_s"] >= waited and t["ttft_s"] >= t["queue_s"] and t["total_s"] >= t["ttft_s"]
    assert value(samples, "sluice_time_in_topic_seconds_count") == 1
    assert value(samples, "sluice_time_in_topic_seconds_sum") == pytest.approx(waited)
    assert value(samples, "sluice_time_to_first_token_seconds_sum") >= waited


def test_a_session_timeout_the_broker_refuses_is_named_in_one_line(bootstrap_servers, tmp_path):
    pipeline = PipelineProcess(
        bootstrap_servers, None, new_prefix(), tmp_path, "--session-timeout-ms", "1000"
    )
    try:
        code = pipeline.proc.wait(180)
    finally:
        pipeline.kill()
    assert code == 2, pipeline.tail()
    assert "the broker refused --session-timeout-ms 1000" in pipeline.text()
    assert "Traceback" not in pipeline.text()
