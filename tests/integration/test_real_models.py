"""A real model of the catalog through the whole pipeline, as a user runs it: `sluice run --model
NAME`, a request on the requests topic, its answer on the tokens topic. CI pulls Gemma 3 270M
(.ci/run; a base model: a plain prompt, no chat template); where the model is not pulled the test
says so and how to pull it."""

from __future__ import annotations

import asyncio

import pytest

from sluice.engine.errors import EngineError
from sluice.engine.loader import catalog
from sluice.testing.pipeline_harness import (
    PipelineProcess,
    collect,
    new_prefix,
    publish,
    request,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["gemma3-270m"])
async def test_a_real_model_answers_through_the_pipeline(name, bootstrap_servers, tmp_path):
    try:
        catalog.locate(name)
    except EngineError as e:
        pytest.skip(f"{name} is not pulled (sluice models pull {name}): {e}")
    prefix = new_prefix()
    process = PipelineProcess(bootstrap_servers, None, prefix, tmp_path, "--model", name)
    try:
        await asyncio.to_thread(process.wait_ready, 300)
        prompt = "Q: What is the capital of France?\nA:"
        body = request("capital", prompt=prompt, temperature=0, max_tokens=10)
        await publish(bootstrap_servers, f"{prefix}.requests", [body])
        streams = await collect(bootstrap_servers, prefix, {"capital"}, timeout=300)
    finally:
        process.stop()
    (final,) = streams.finals("capital")
    assert final["type"] == "final", final
    assert "Paris" in final["text"], final["text"]
    assert streams.text("capital") == final["text"]
