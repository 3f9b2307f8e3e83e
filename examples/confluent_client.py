"""A plain confluent-kafka client of sluice (librdkafka, the client most Kafka languages wrap):
publish one request to the requests topic, print its text as the token events arrive, and the
usage when the final event comes. Needs only confluent-kafka (`pip install confluent-kafka`).

    python examples/confluent_client.py "Write a haiku about a river."
    python examples/confluent_client.py --bootstrap-servers kafka:9092 --max-tokens 40 "Hi"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition


def chat(bootstrap: str, prefix: str, prompt: str, max_tokens: int, timeout: float) -> int:
    request_id = f"confluent-{uuid.uuid4().hex[:12]}"
    tokens_topic = f"{prefix}.tokens"
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"example-{request_id}",  # no offsets are committed: positions are ours
            "enable.auto.commit": False,
            "isolation.level": "read_committed",  # with exactly-once delivery: each event once
        }
    )
    # Read from the end as it is now, so that no event of the reply can slip past.
    partitions = consumer.list_topics(tokens_topic, timeout=10).topics[tokens_topic].partitions
    ends = []
    for p in partitions:
        _, high = consumer.get_watermark_offsets(TopicPartition(tokens_topic, p), timeout=10)
        ends.append(TopicPartition(tokens_topic, p, high))
    consumer.assign(ends)
    body = {
        "request_id": request_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "event_format": "sluice",  # the events read below, whatever the pipeline's default
    }
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    producer.produce(f"{prefix}.requests", json.dumps(body).encode(), key=request_id.encode())
    producer.flush(10)
    next_seq = 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            record = consumer.poll(0.5)
            if record is None or record.error() or record.key() != request_id.encode():
                continue
            event = json.loads(record.value())
            if event["seq"] < next_seq:
                continue  # sent again after a crash: seen already
            next_seq = event["seq"] + 1
            if event["type"] == "token":
                print(event["text"], end="", flush=True)
            elif event["type"] == "final":
                usage = event["usage"]
                print(
                    f"\n[{event['finish_reason']}: {usage['completion_tokens']} tokens; prompt "
                    f"{usage['prompt_tokens']} ({usage['cached_tokens']} cached)]"
                )
                return 0
            elif event["type"] == "error":
                print(f"error: {event['code']}: {event['message']}", file=sys.stderr)
                return 1
    finally:
        consumer.close()
    print("error: no final event in time", file=sys.stderr)
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--topic-prefix", default="sluice")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    return chat(
        args.bootstrap_servers, args.topic_prefix, args.prompt, args.max_tokens, args.timeout
    )


if __name__ == "__main__":
    sys.exit(main())
