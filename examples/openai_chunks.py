"""An OpenAI-style chat over Kafka: publish a Chat Completions body to sluice's requests topic and
print the reply as its `chat.completion.chunk` objects arrive, parsed with the `openai` package's
own types. Needs only aiokafka and openai (`pip install aiokafka openai`).

    python examples/openai_chunks.py "Name three colours."
    python examples/openai_chunks.py --bootstrap-servers kafka:9092 --topic-prefix sluice "Hi"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from openai.types.chat import ChatCompletionChunk


async def chat(bootstrap: str, prefix: str, prompt: str, max_tokens: int) -> int:
    request_id = f"example-{uuid.uuid4().hex[:12]}"
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_completion_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "request_id": request_id,  # sluice's extra: the key to find the reply by
    }
    consumer = AIOKafkaConsumer(
        f"{prefix}.tokens",
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
    )
    await consumer.start()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        # Read from the end as it is now, so that no chunk of the reply can slip past.
        partitions = list(consumer.assignment())
        while not partitions:
            await asyncio.sleep(0.1)
            partitions = list(consumer.assignment())
        await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)
        await producer.send_and_wait(
            f"{prefix}.requests", json.dumps(body).encode(), key=request_id.encode()
        )
        next_seq = 0
        async for record in consumer:
            if record.key != request_id.encode():
                continue
            obj = json.loads(record.value)
            if obj["seq"] < next_seq:
                continue  # a copy sent again after a crash: seen already
            next_seq = obj["seq"] + 1
            if "error" in obj:
                print(f"error: {obj['error']['message']}", file=sys.stderr)
                return 1
            chunk = ChatCompletionChunk.model_validate(obj)
            for choice in chunk.choices:
                print(choice.delta.content or "", end="", flush=True)
            if chunk.usage is not None:
                print(f"\n[{chunk.choices[0].finish_reason}: {chunk.usage.total_tokens} tokens]")
                return 0
    finally:
        await producer.stop()
        await consumer.stop()
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--topic-prefix", default="sluice")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    return asyncio.run(
        chat(args.bootstrap_servers, args.topic_prefix, args.prompt, args.max_tokens)
    )


if __name__ == "__main__":
    sys.exit(main())
