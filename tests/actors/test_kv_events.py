"""A runner's KV events, as the routing index reads them: a snapshot first, then the changes of
each step and heartbeats with its load, and the index built from them holds what the engine's
prefix cache holds."""

from __future__ import annotations

import time

import pytest

from sluice.actors.delivery import Delivery
from sluice.actors.kv_events import KvEventPublisher, KvEventsMessage
from sluice.actors.kv_router import KvRouter
from sluice.actors.messages import Envelope, TokenizedRequest
from sluice.actors.runner_actor import RunnerActor
from sluice.schemas import GenerateRequest

from .helpers import BOUND, eventually, tiny_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=128)


def work(i: int, length: int) -> TokenizedRequest:
    request = GenerateRequest(
        request_id=f"r{i}", prompt="ids below", temperature=0, max_tokens=3, ignore_eos=True
    )
    ids = [(7 * i + j) % 50 + 3 for j in range(length)]
    return TokenizedRequest(request=request, prompt_token_ids=ids, received_at=time.time())


async def test_runner_reports_its_cache_and_load(engine):
    reports: list[KvEventsMessage] = []

    async def send(message: KvEventsMessage) -> None:
        # as on the wire
        reports.append(KvEventsMessage.model_validate_json(message.model_dump_json()))

    publisher = KvEventPublisher(
        send,
        runner_id="r-1",
        work_topic="w.r-1",
        work_group="g-runner-r-1",
        block_size=engine.config.block_size,
        heartbeat_s=0.2,
    )
    acked = []

    async def steps(envelope: Envelope) -> None:
        envelope.delivery.done()

    runner = RunnerActor(engine, steps, runner_id="r-1", kv_events=publisher)
    await runner.start()
    try:
        await eventually(lambda: reports and reports[0].snapshot)
        for i in range(4):
            await runner.tell(
                Envelope(work(i, 40 + 5 * i), Delivery(lambda _, i=i: acked.append(i)))
            )
        await eventually(lambda: len(acked) == 4, BOUND * 3)
        # heartbeats go on while idle
        count = len(reports)
        await eventually(lambda: len(reports) >= count + 2)
    finally:
        await runner.stop()

    assert [m.seq for m in reports] == list(range(len(reports)))
    assert {m.incarnation for m in reports} == {publisher.incarnation}
    assert any(m.stored for m in reports[1:])  # the prompts' blocks, reported as computed
    assert any(m.load.running > 0 for m in reports)
    assert reports[-1].load.running == 0
    assert reports[-1].load.num_blocks == engine.stats()["num_kv_blocks"] > 0
    router = KvRouter()
    for message in reports:
        router.apply(message)
    assert router.runners["r-1"].blocks == {h[:8] for h in engine.cached_block_hashes()}
    assert router.runners["r-1"].blocks
