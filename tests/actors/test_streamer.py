"""The streamer actor without Kafka: a fake producer stands in for aiokafka."""

import asyncio
import json

from sluice.actors.delivery import Delivery
from sluice.actors.messages import Envelope, RequestHandle, StepMessage
from sluice.actors.runtime.actor import ActorState
from sluice.actors.streamer_actor import StreamerActor
from sluice.schemas.events import Timings, TokenLogprob, Usage

from .helpers import BOUND, eventually


class FakeProducer:
    def __init__(self):
        self.sent = []
        self.flushed = False

    async def send(self, topic, key=None, value=None, origin=None):
        self.sent.append((topic, key, json.loads(value)))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def flush(self):
        self.flushed = True


async def test_streamer_publishes_acks_and_drains_cleanly():
    producer = FakeProducer()
    streamer = StreamerActor(producer, "out", None)
    acks = []
    await streamer.start()
    await streamer.tell(
        Envelope(
            StepMessage(request_id="r", seq=0, token_ids=[5], text="Hi"),
            Delivery(lambda _: acks.append("token")),
        )
    )
    await streamer.tell(
        Envelope(
            StepMessage(
                request_id="r",
                seq=1,
                finished=True,
                finish_reason="stop",
                usage=Usage(prompt_tokens=3, completion_tokens=1),
                timings=Timings(queue_s=0.0, total_s=0.1),
                full_text="Hi",
            ),
            Delivery(lambda _: acks.append("final")),
        )
    )
    await eventually(lambda: len(acks) == 2)
    # A regression: the streamer's own helper once shadowed the runtime's Actor._finish, so every
    # drain ended in a TypeError, on_stop never ran and the process exited as failed.
    assert await asyncio.wait_for(streamer.drain(), BOUND) == 0
    assert streamer.state is ActorState.STOPPED and streamer.failure is None
    assert producer.flushed
    assert [(e["type"], e["seq"]) for _, _, e in producer.sent] == [("token", 0), ("final", 1)]
    assert acks == ["token", "final"]


class RecordingSessions:
    """Stands in for the Redis store: what the streamer records of session turns."""

    def __init__(self):
        self.turns = []
        self.available = True

    async def record_turn(self, tenant, session_id, request_id, messages, token_ids, start, **_):
        self.turns.append((session_id, request_id, token_ids))
        return True


async def test_a_final_published_before_is_not_sent_again_but_its_turn_is_recorded():
    """Exactly-once, a request delivered again after its committed final: its events must not go
    out twice, but its session turn (perhaps never recorded: the crash came first) and its
    acknowledgement still have to happen, or the session's next turn would wait for it."""
    producer, sessions = FakeProducer(), RecordingSessions()
    streamer = StreamerActor(producer, "out", sessions)
    acks = []
    await streamer.start()
    final = StepMessage(
        request_id="r",
        seq=1,
        finished=True,
        finish_reason="length",
        full_text="Hi",
        request=RequestHandle(session_id="s"),
        session_messages=[{"role": "user", "content": "x"}],
        session_token_ids=[1, 2, 5],
        published=True,
    )
    await streamer.tell(Envelope(final, Delivery(lambda _: acks.append("final"))))
    await eventually(lambda: acks == ["final"])
    assert await asyncio.wait_for(streamer.drain(), BOUND) == 0
    assert producer.sent == []
    assert sessions.turns == [("s", "r", [1, 2, 5])]


def _steps(**echo) -> list[StepMessage]:
    """A request's two token messages and its final, echoing `echo` (the request's wishes)."""
    lp = [TokenLogprob(token_id=5, logprob=-0.5, token="Hi", bytes=[72, 105])]
    handle = RequestHandle(model="m", **echo)
    return [
        StepMessage(request_id="r", seq=0, token_ids=[5], text="Hi", logprobs=lp, request=handle),
        StepMessage(
            request_id="r", seq=1, position=1, token_ids=[6], text="!", logprobs=lp, request=handle
        ),
        StepMessage(
            request_id="r",
            seq=2,
            finished=True,
            finish_reason="length",
            usage=Usage(prompt_tokens=3, cached_tokens=2, completion_tokens=2),
            timings=Timings(queue_s=0.0, total_s=0.1),
            full_text="Hi!",
            choice_logprobs=None if echo.get("stream", True) else {0: lp + lp},
            request=handle,
        ),
    ]


async def _publish(streamer: StreamerActor, steps: list[StepMessage]) -> None:
    acks = []
    await streamer.start()
    for step in steps:
        await streamer.tell(Envelope(step, Delivery(lambda _, s=step: acks.append(s.seq))))
    await eventually(lambda: len(acks) == len(steps))
    assert await asyncio.wait_for(streamer.drain(), BOUND) == 0


async def test_openai_events_by_pipeline_default_and_by_request():
    for pipeline_default, asked in (("openai", None), ("sluice", "openai")):
        producer = FakeProducer()
        streamer = StreamerActor(producer, "out", None, event_format=pipeline_default)
        await _publish(streamer, _steps(event_format=asked, chat=True, created=1234))
        first, second, last = (e for _, _, e in producer.sent)
        assert [e["object"] for e in (first, second, last)] == ["chat.completion.chunk"] * 3
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
        assert second["choices"][0]["delta"] == {"content": "!"}  # the role comes once
        assert first["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"
        assert last["choices"] == [
            {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        ]
        assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
        assert [e["seq"] for e in (first, second, last)] == [0, 1, 2]
        assert {e["created"] for e in (first, second, last)} == {1234}


async def test_a_request_that_does_not_stream_gets_its_final_alone():
    producer = FakeProducer()
    await _publish(StreamerActor(producer, "out", None), _steps(stream=False))
    ((_, _, final),) = producer.sent
    assert final["type"] == "final" and final["text"] == "Hi!" and final["seq"] == 2
    assert [lp["token"] for lp in final["logprobs"]] == ["Hi", "Hi"]

    producer = FakeProducer()
    steps = _steps(stream=False, event_format="openai", chat=False)
    await _publish(StreamerActor(producer, "out", None), steps)
    ((_, _, completion),) = producer.sent
    assert completion["object"] == "text_completion" and completion["id"] == "cmpl-r"
    (choice,) = completion["choices"]
    assert choice["text"] == "Hi!" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["Hi", "Hi"]
