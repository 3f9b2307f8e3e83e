"""A Faust (faust-streaming) app as a client of sluice: a task publishes prompts to the requests
topic, and an agent consumes the token stream, assembling each reply from its events (dropping
copies by request id and seq) and printing it once its final event arrives.

    pip install faust-streaming
    python examples/faust_client.py "Name a colour." "Name a fruit."
    KAFKA_BOOTSTRAP_SERVERS=kafka:9092 python examples/faust_client.py "Hi"
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

import faust

BROKER = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
PREFIX = os.environ.get("SLUICE_TOPIC_PREFIX", "sluice")
PROMPTS = sys.argv[1:] or ["Name a colour."]
RUN = uuid.uuid4().hex[:8]

app = faust.App(
    f"sluice-faust-example-{RUN}",  # a group of its own: it reads the tokens topic from the start
    broker=f"kafka://{BROKER}",
    store="memory://",
    web_enabled=False,
    topic_disable_leader=True,
    consumer_auto_offset_reset="earliest",
)
requests_topic = app.topic(f"{PREFIX}.requests", key_serializer="raw", value_serializer="json")
tokens_topic = app.topic(f"{PREFIX}.tokens", key_serializer="raw", value_serializer="json")

wanted = {f"faust-{RUN}-{i}": prompt for i, prompt in enumerate(PROMPTS)}
texts: dict[str, str] = {}
next_seq: dict[str, int] = {}
finished: set[str] = set()


@app.task
async def publish_prompts() -> None:
    for request_id, prompt in wanted.items():
        body = {
            "request_id": request_id,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 32,
            "temperature": 0,
            "event_format": "sluice",
        }
        await requests_topic.send(key=request_id.encode(), value=body)


@app.agent(tokens_topic)
async def replies(events) -> None:
    async for event in events:
        request_id = event.get("request_id")
        if request_id not in wanted or event.get("seq", 0) < next_seq.get(request_id, 0):
            continue  # another client's, or a copy sent again after a crash
        next_seq[request_id] = event["seq"] + 1
        if event["type"] == "token":
            texts[request_id] = texts.get(request_id, "") + event["text"]
            continue
        finished.add(request_id)
        if event["type"] == "final":
            print(f"{wanted[request_id]!r} -> {texts.get(request_id, '')!r}", flush=True)
        else:
            print(f"{wanted[request_id]!r} -> error {event['code']}: {event['message']}")
        if finished == set(wanted):  # every reply is in: the worker ends, after this event
            asyncio.ensure_future(worker.stop())


worker = faust.Worker(app, loglevel="WARNING")

if __name__ == "__main__":
    worker.execute_from_commandline()
