"""A runner restarted by its supervisor after its engine thread failed takes up again every request
it held: resumed from its progress record (the same tokens, no seq sent twice with two contents),
or, without a progress log, ended with an error final. On a real tiny engine; the progress
changelog is an in-memory table here (the real one is tested against the broker)."""

from __future__ import annotations

import time

import pytest

from sluice.actors import engine_loop
from sluice.actors.delivery import Delivery
from sluice.actors.messages import Envelope, TokenizedRequest
from sluice.actors.progress import ProgressLog
from sluice.actors.runner_actor import RESTARTED, RunnerActor
from sluice.engine import LLMEngine, SamplingParams
from sluice.schemas import GenerateRequest

from .helpers import BOUND, eventually, tiny_engine


class MemoryChangelog:
    """The Changelog interface over a dict (what the runner's progress log needs of it)."""

    transactional = False

    def __init__(self):
        self.table: dict[str, bytes] = {}

    async def start(self):
        pass

    async def stop(self):
        pass

    async def catch_up(self):
        pass

    def get(self, key):
        return self.table.get(key)

    def keys(self):
        return list(self.table)

    async def put(self, records, origin=None):
        self.table.update(records)

    async def delete(self, *keys, origin=None):
        for key in keys:
            self.table.pop(key, None)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    return tiny_engine(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=128)


def work(i: int) -> TokenizedRequest:
    request = GenerateRequest(
        request_id=f"r{i}", prompt="ids below", temperature=0, max_tokens=10, ignore_eos=True
    )
    return TokenizedRequest(
        request=request, prompt_token_ids=list(range(3 + i, 15 + i)), received_at=time.time()
    )


def fail_once_at_step(monkeypatch, n: int) -> None:
    real, calls = engine_loop.EngineLoop.step, []

    def step(self):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("the engine thread broke")
        return real(self)

    monkeypatch.setattr(engine_loop.EngineLoop, "step", step)


async def serve(engine: LLMEngine, progress: ProgressLog | None, n: int = 3):
    sent, acked = [], []

    async def sink(envelope: Envelope) -> None:
        sent.append(envelope.body)
        envelope.delivery.done()

    runner = RunnerActor(engine, sink, progress=progress)
    await runner.start()
    for i in range(n):
        await runner.tell(Envelope(work(i), Delivery(lambda _, i=i: acked.append(f"r{i}"))))
    await eventually(lambda: len(acked) == n, BOUND * 3)
    await runner.stop()
    return runner, sent, acked


async def test_restarted_runner_resumes_what_it_held(engine, monkeypatch):
    clean = {
        f"r{i}": r.token_ids
        for i, r in enumerate(
            engine.generate(
                prompt_token_ids=[work(i).prompt_token_ids for i in range(3)],
                params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            )
        )
    }
    fail_once_at_step(monkeypatch, 4)  # a few tokens in
    runner, sent, acked = await serve(engine, ProgressLog(MemoryChangelog()))
    assert runner.restarts == 1
    assert sorted(acked) == ["r0", "r1", "r2"]
    for rid, want in clean.items():
        mine = [m for m in sent if m.request_id == rid]
        by_seq = {}
        for m in mine:
            if not m.finished:
                assert by_seq.setdefault(m.seq, m.token_ids) == m.token_ids, (rid, m.seq)
        tokens = [t for s in sorted(by_seq) for t in by_seq[s]]
        assert tokens == want, rid
        (final,) = [m for m in mine if m.finished]
        assert final.finish_reason == "length" and final.usage.completion_tokens == 10


async def test_without_a_progress_log_the_requests_held_end_with_an_error(engine, monkeypatch):
    fail_once_at_step(monkeypatch, 4)
    runner, sent, acked = await serve(engine, None)
    assert runner.restarts == 1 and sorted(acked) == ["r0", "r1", "r2"]
    finals = [m for m in sent if m.finished]
    assert {m.request_id for m in finals} == {"r0", "r1", "r2"}
    assert all(m.finish_reason == "error" and m.failure == RESTARTED for m in finals)


async def test_a_copy_of_a_running_request_is_dropped_and_acknowledged(engine):
    """Work delivered twice while its first copy runs (a rebalance of the work topic): it runs
    once, and the copy is acknowledged too (or its offset would stop the partition's commits),
    but only when the request ends: the copy may be the same record, and its offset must not be
    committed while the request still runs."""
    sent, acked = [], []

    async def sink(envelope: Envelope) -> None:
        sent.append(envelope.body)
        envelope.delivery.done()

    runner = RunnerActor(engine, sink, progress=ProgressLog(MemoryChangelog()))
    await runner.start()
    await runner.tell(Envelope(work(0), Delivery(lambda _: acked.append("first"))))
    await runner.tell(Envelope(work(0), Delivery(lambda _: acked.append("copy"))))
    await eventually(lambda: len(acked) == 2, BOUND * 3)
    assert acked == ["first", "copy"]
    await runner.stop()
    assert len([m for m in sent if m.finished]) == 1
