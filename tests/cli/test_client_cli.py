"""`sluice produce`, `tail` and `chat` as a user runs them, against `sluice run` on the real broker
and Redis; plus the client's stream handling (duplicates, ordering, file validation) without
Kafka."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from sluice.cli.client import EventStream, Grouped, Prefixed
from sluice.cli.produce import requests_from_args
from sluice.schemas import FinalEvent, Timings, TokenEvent, Usage, encode
from sluice.testing.pipeline_harness import PipelineProcess, new_prefix, publish

integration = pytest.mark.integration
GREEDY = ["--temperature", "0"]


def sluice(
    *args: str, input: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def pipeline(endpoints, tmp_path_factory):
    """One `sluice run` (with sessions) for the whole module, on topics and a group of its own."""
    prefix = new_prefix()
    process = PipelineProcess(
        endpoints.bootstrap_servers,
        endpoints.redis_url,
        prefix,
        tmp_path_factory.mktemp("pipeline"),
        "--group",
        prefix,
    )
    try:
        process.wait_ready()
        yield SimpleNamespace(prefix=prefix, bootstrap=endpoints.bootstrap_servers, process=process)
    finally:
        assert process.stop() == 0, process.tail()


def kafka_flags(pipeline) -> list[str]:
    return ["--topic-prefix", pipeline.prefix, "--bootstrap-servers", pipeline.bootstrap]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def check_stream(events: list[dict], rid: str) -> dict:
    """Gap-free token seqs, exactly one final right after them; returns the final."""
    mine = [e for e in events if e["request_id"] == rid]
    tokens = [e for e in mine if e["type"] == "token"]
    finals = [e for e in mine if e["type"] != "token"]
    assert [e["seq"] for e in tokens] == list(range(len(tokens))), mine
    assert len(finals) == 1 and finals[0]["type"] == "final", mine
    assert finals[0]["seq"] == len(tokens)
    assert "".join(e["text"] for e in tokens) == finals[0]["text"]
    return finals[0]


@integration
def test_produce_prints_ids_and_tail_afterwards_reads_whole_streams_once(pipeline):
    result = sluice(
        "produce",
        *kafka_flags(pipeline),
        *GREEDY,
        "--max-tokens",
        "8",
        "The capital of France is",
        "One, two, three,",
    )
    assert result.returncode == 0, result.stderr
    ids = result.stdout.split()
    assert len(ids) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids), result.stdout

    # tail starts after the fact (perhaps after the streams ended) and still sees all of them.
    tailed = sluice("tail", *kafka_flags(pipeline), "--json", "--timeout", "150", ids[0])
    assert tailed.returncode == 0, tailed.stderr
    events = json_lines(tailed.stdout)
    final = check_stream(events, ids[0])
    assert final["usage"]["completion_tokens"] <= 8

    # A replay after a crash sends the same (request_id, seq) events again: tail drops them.
    replay = [(ids[0].encode(), json.dumps(e).encode()) for e in events]
    asyncio.run(publish(pipeline.bootstrap, f"{pipeline.prefix}.tokens", replay))
    text = sluice("tail", *kafka_flags(pipeline), "--timeout", "150", *ids)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert [line for line in lines if line.startswith("--- ")] == [f"--- {i}" for i in ids]
    summaries = [line for line in lines if line.startswith("[") and "TTFT" in line]
    assert len(summaries) == 2 and all(
        "prompt" in s and "cached" in s and "TPOT" in s for s in summaries
    )
    assert text.stdout.count(final["text"]) == 1


@integration
def test_produce_follow_streams_the_text_then_a_summary(pipeline):
    result = sluice(
        "produce",
        *kafka_flags(pipeline),
        *GREEDY,
        "--max-tokens",
        "6",
        "--request-id",
        f"f-{pipeline.prefix}",
        "--follow",
        "--timeout",
        "150",
        "Once upon a time",
    )
    assert result.returncode == 0, result.stderr
    first, *rest = result.stdout.splitlines()
    assert first == f"f-{pipeline.prefix}"
    assert re.match(
        r"\[(stop|length): \d+ tokens; prompt \d+ \(\d+ cached\); TTFT \d+ ms", rest[-1]
    ), rest
    assert "".join(rest[:-1]).strip()  # the text came first


@integration
def test_produce_with_tools_prints_the_calls_the_model_makes(pipeline, tmp_path):
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    (tmp_path / "tools.json").write_text(json.dumps([weather]))
    result = sluice(
        "produce",
        *kafka_flags(pipeline),
        *GREEDY,
        "--chat",
        "--tools",
        f"@{tmp_path / 'tools.json'}",
        "--tool-choice",
        "weather",
        "--max-tokens",
        "40",
        "--follow",
        "--timeout",
        "150",
        "What is the weather in Rome?",
    )
    assert result.returncode == 0, result.stderr
    calls = re.findall(r"\[tool call call_[0-9a-f]{24}: weather\((.*)\)\]", result.stdout)
    assert len(calls) == 1 and isinstance(json.loads(calls[0])["city"], str), result.stdout
    assert result.stdout.splitlines()[-1].startswith("[tool_calls: ")
    # without --chat the tools have nothing to go with: refused before anything is sent
    refused = sluice(
        "produce", *kafka_flags(pipeline), "--tools", "@" + str(tmp_path / "tools.json"), "x"
    )
    assert refused.returncode != 0 and "tools" in refused.stderr


@integration
def test_file_with_bad_lines_reports_them_by_line_and_field_and_sends_the_rest(pipeline, tmp_path):
    rid = f"file-{pipeline.prefix}"
    path = tmp_path / "requests.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"request_id": f"{rid}-1", "prompt": "Hello,"}),
                json.dumps({"request_id": f"{rid}-bad", "prompt": "x", "max_tokens": 0}),
                "",
                json.dumps({"request_id": f"{rid}-typo", "prompt": "x", "max_token": 3}),
                json.dumps(
                    {"request_id": f"{rid}-2", "messages": [{"role": "user", "content": "Hi"}]}
                ),
            ]
        )
        + "\n"
    )
    result = sluice(
        "produce",
        *kafka_flags(pipeline),
        *GREEDY,
        "--max-tokens",
        "5",
        "--file",
        str(path),
        "--json",
        "--follow",
        "--timeout",
        "150",
    )
    assert result.returncode == 1, result.stderr  # some lines were not sent
    assert f"{path} line 2: max_tokens: must be >= 1 (got 0)" in result.stderr
    assert (
        f"{path} line 4: max_token: unknown field" in result.stderr
        and "'max_tokens'" in result.stderr
    )
    records = json_lines(result.stdout)
    sent = [r for r in records if "type" not in r]
    assert [r["request_id"] for r in sent] == [f"{rid}-1", f"{rid}-2"]
    assert all(r["topic"] == f"{pipeline.prefix}.requests" and r["offset"] >= 0 for r in sent)
    events = [r for r in records if "type" in r]
    for name in (f"{rid}-1", f"{rid}-2"):
        assert (
            check_stream(events, name)["usage"]["completion_tokens"] <= 5
        )  # the flag's default applied
    assert not [e for e in events if "bad" in e["request_id"] or "typo" in e["request_id"]]


@integration
def test_chat_two_turns_over_kafka_second_reuses_the_cache(pipeline):
    session = f"chat-{pipeline.prefix}"
    result = sluice(
        "chat",
        *kafka_flags(pipeline),
        "--session",
        session,
        "--tenant",
        "acme",
        *GREEDY,
        "--max-tokens",
        "16",
        input="Name three rivers.\nWhich is longest?\n",
    )
    assert result.returncode == 0, result.stderr
    assert session in result.stderr
    stats = [
        re.search(r"\[cached (\d+) of (\d+) prompt tokens; (\d+) tokens", line)
        for line in result.stdout.splitlines()
    ]
    stats = [tuple(map(int, m.groups())) for m in stats if m]
    assert len(stats) == 2, result.stdout
    (_, prompt1, completion1), (cached2, prompt2, _) = stats
    assert prompt2 > prompt1 + completion1  # turn 2 continues turn 1 (kept by the pipeline)
    assert cached2 > 0 and cached2 >= (prompt1 + completion1) // 16 * 16 - 16


# --- without Kafka ------------------------------------------------------------------------------


def token(rid: str, seq: int, text: str) -> TokenEvent:
    return TokenEvent(request_id=rid, seq=seq, token_ids=[seq], text=text)


def final(rid: str, seq: int, text: str) -> FinalEvent:
    return FinalEvent(
        request_id=rid,
        seq=seq,
        finish_reason="stop",
        text=text,
        model="m",
        usage=Usage(prompt_tokens=5, cached_tokens=3, completion_tokens=seq),
        timings=Timings(queue_s=0, ttft_s=0.05, tpot_s=0.01, total_s=0.1),
    )


class FakeConsumer:
    def __init__(self, batches):
        self.batches = list(batches)

    async def getmany(self, timeout_ms):
        if not self.batches:
            return {}
        tp = TopicPartition("p.tokens", 0)
        return {
            tp: [
                SimpleNamespace(key=e.request_id.encode(), value=encode(e))
                for e in self.batches.pop(0)
            ]
        }


async def test_stream_drops_duplicates_and_requests_not_asked_for():
    stream = EventStream("unused:9092", ["p.tokens"], ["a"])
    await stream.consumer.stop()  # never started; the fake below stands in for it
    events = [token("a", 0, "x"), token("b", 0, "y"), token("a", 1, "z")]
    stream.consumer = FakeConsumer(
        [events, [token("a", 0, "x"), token("a", 1, "z"), final("a", 2, "xz")]]
    )
    got = await stream.poll() + await stream.poll()
    assert [(r.event.request_id, r.event.seq) for r in got] == [("a", 0), ("a", 1), ("a", 2)]
    assert got[-1].terminal


def received(event):
    return SimpleNamespace(event=event, raw={}, terminal=not isinstance(event, TokenEvent))


def test_grouped_shows_requests_in_order_buffering_later_ones():
    out = io.StringIO()
    render = Grouped(["a", "b"], {"a": "first"}, out=out)
    for event in [
        token("b", 0, "B1"),
        token("a", 0, "A1"),
        final("b", 1, "B1"),
        token("a", 1, " A2"),
        final("a", 2, "A1 A2"),
    ]:
        render(received(event))
    lines = out.getvalue().splitlines()
    assert (
        lines[0] == "--- a: first"
        and lines[1] == "A1 A2"
        and lines[3] == "--- b"
        and lines[4] == "B1"
    )
    assert lines[2].startswith("[stop: 2 tokens; prompt 5 (3 cached); TTFT 50 ms, TPOT 10 ms")


def test_prefixed_prints_whole_lines_per_request():
    out = io.StringIO()
    render = Prefixed(out=out)
    for event in [
        token("a", 0, "one\ntw"),
        token("b", 0, "x"),
        token("a", 1, "o"),
        final("a", 2, ""),
        final("b", 1, ""),
    ]:
        render(received(event))
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["[a] one", "[a] two"] and lines[2].startswith("[a] [stop: 2 tokens")
    assert lines[3] == "[b] x" and lines[4].startswith("[b] [stop: 1 tokens")


def test_file_lines_are_validated_with_flags_as_defaults(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(
        '{"prompt": "a"}\n{"prompt": "b", "max_tokens": 2}\n[1]\n{"prompt": "c", "n": 99}\n'
    )
    args = argparse.Namespace(
        file=path,
        prompts=[],
        request_id=None,
        session_id="s",
        tenant=None,
        max_tokens=7,
        temperature=None,
        top_p=None,
        seed=None,
        stop=None,
        priority=None,
        reply_topic=None,
        chat=False,
        system=None,
    )
    requests, problems = requests_from_args(args)
    assert [(r.prompt, r.max_tokens, r.session_id) for r in requests] == [
        ("a", 7, "s"),
        ("b", 2, "s"),
    ]
    assert problems[0].startswith(f"{path} line 3: ") and "JSON object" in problems[0]
    assert problems[1] == f"{path} line 4: n: must be <= 16 (got 99)"
