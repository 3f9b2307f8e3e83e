"""The streamer actor without Kafka: a fake producer stands in for aiokafka."""

import asyncio
import json

from sluice.actors.messages import Envelope, StepMessage
from sluice.actors.runtime.actor import ActorState
from sluice.actors.streamer_actor import StreamerActor
from sluice.schemas.events import Timings, Usage

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
            lambda: acks.append("token"),
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
            lambda: acks.append("final"),
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
        session_id="s",
        session_messages=[{"role": "user", "content": "x"}],
        session_token_ids=[1, 2, 5],
        published=True,
    )
    await streamer.tell(Envelope(final, lambda: acks.append("final")))
    await eventually(lambda: acks == ["final"])
    assert await asyncio.wait_for(streamer.drain(), BOUND) == 0
    assert producer.sent == []
    assert sessions.turns == [("s", "r", [1, 2, 5])]
