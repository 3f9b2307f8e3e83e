"""The harness over the real broker, with the real pipeline and model and a real tool worker: a run
asked for with `sluice agent run` calls its tool, reads the result and answers. In deterministic
mode, a run through SIGKILLs of every process it uses (the pipeline three times, the tool worker
and the harness once each) ends as the same run uninterrupted does: the same turns, calls, results
and answer, one final, every event with one content, and every tool call run once (a worker
stopped while running a tool that is not idempotent answers `interrupted` instead:
tests/integration/test_tool_worker.py). The run replays identically from its record (`sluice
replay`). Beside them, a run of a tool that always fails ends on its failures and stalls nothing,
a best-of-n run answers with its best-scored sample's answer, a run with a judge answers again
when the judge rejects its first answer, a call that needs approval runs once `sluice agent
approve` approves it, and a run with a session goes on from the session's earlier run (in
Redis)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from sluice.testing.pipeline_harness import (
    PipelineProcess,
    new_prefix,
    publish,
    settled_session,
    sigkill,
)

pytestmark = pytest.mark.integration

TOOLS_MODULE = '''
import json, os, time
from sluice.tools import tool

@tool
def visit(place: str) -> str:
    """Visit a place and say what is there."""
    with open(os.environ["STARTED_FILE"], "a") as f:
        f.write(place + "\\n")
    time.sleep(2)
    # counted once it has run whole: a run cut by a SIGKILL did nothing, and is run again
    with open(os.environ["COUNT_FILE"], "a") as f:
        f.write(place + "\\n")
    return f"a quiet harbour with {len(place) % 5 + 2} boats"

@tool
def poison(what: str) -> str:
    """Look something up."""
    raise RuntimeError("poisoned")

@tool
def score(question: str, answer: str) -> str:
    """Score an answer: here, the longer the better."""
    return str(len(answer))

@tool
def check(question: str, answer: str) -> str:
    """Judge an answer: here, the first is rejected and the next accepted."""
    with open(os.environ["JUDGED_FILE"], "a+") as f:
        f.seek(0)
        first = not f.read()
        f.write(answer.replace("\\n", " ") + "\\n")
    if first:
        return json.dumps({"pass": False, "feedback": "Say it in fewer words."})
    return "true"
'''
VISIT = {
    "type": "function",
    "function": {
        "name": "visit",
        "description": "Visit a place and say what is there.",
        "parameters": {
            "type": "object",
            "properties": {"place": {"type": "string", "maxLength": 20}},
            "required": ["place"],
            "additionalProperties": False,
        },
    },
}
POISON = {
    "type": "function",
    "function": {
        "name": "poison",
        "description": "Look something up.",
        "parameters": {
            "type": "object",
            "properties": {"what": {"type": "string", "maxLength": 20}},
            "required": ["what"],
            "additionalProperties": False,
        },
    },
}
# sampled and seeded, so that "the same run" means the same draws, not only the same argmax
ASK = ["What is at the harbour?", "--tool-choice", "visit", "--temperature", "0.8"]
ASK += ["--seed", "11", "--max-steps", "3", "--max-tokens", "32", "--stream"]


class Service:
    """A `sluice` subprocess (a tool worker or the harness) with its log in a file."""

    def __init__(self, home: Path, *args: str, env: dict[str, str] | None = None):
        self.log_path = home / f"{args[0]}-{uuid.uuid4().hex[:6]}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", *args],
            cwd=home,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_for(self, text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.log_path.read_bytes():
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


async def events_of(bootstrap: str, prefix: str, run_id: str, until, timeout: float = 300):
    """The run's events on PREFIX.harness-events, read until `until(events)` holds."""
    consumer = AIOKafkaConsumer(
        f"{prefix}.harness-events", bootstrap_servers=bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while not until(events):
            assert time.monotonic() < deadline, events
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                events += [json.loads(r.value) for r in records]
            events = [e for e in events if e["run_id"] == run_id]
    finally:
        await consumer.stop()
    return events


def replay(*args: str) -> dict:
    """`sluice replay ... --json`: its report."""
    done = subprocess.run(
        [sys.executable, "-m", "sluice", "replay", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), (done.stdout, done.stderr)
    return json.loads(done.stdout)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def steps_of(events: list[dict]) -> list[dict]:
    """A run's numbered events (its steps and final), without the deltas of its turns' text."""
    return [e for e in events if e["type"] != "delta"]


def streamed(events: list[dict]) -> dict[int, str]:
    """Each turn's text as its deltas said it (a copy, from a resumed turn, said once)."""
    by_name: dict[tuple[int, int], str] = {}
    for e in events:
        if e["type"] == "delta":
            name = (e["step"], e["index"])
            assert by_name.setdefault(name, e["text"]) == e["text"], "a delta with two contents"
    turns: dict[int, str] = {}
    for step, index in sorted(by_name):
        turns[step] = turns.get(step, "") + by_name[step, index]
    return turns


def what_happened(events: list[dict]) -> list[object]:
    """A run's events less what names the run (its id, its calls' ids and keys) and what the
    clock and the processes give (times, the worker): what two runs of one request share."""
    by_seq: dict[int, dict] = {}
    for event in steps_of(events):
        assert by_seq.setdefault(event["seq"], event) == event, "a seq with two contents"
    assert sorted(by_seq) == list(range(len(by_seq))), "a seq missing"
    happened: list[object] = []
    for event in by_seq.values():
        if event["type"] == "harness_final":
            happened.append([event[k] for k in ("answer", "stop_reason", "steps", "tool_calls")])
            happened.append([event[k] for k in ("completion_tokens", "prompt_tokens")])
        elif event["kind"] == "model":
            made = event["tool_calls"] or []
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in made]
            happened.append((event["step"], "turn", event["text"], calls))
        elif event["kind"] == "tool_call":
            call = event["call"]
            happened.append((event["step"], "call", call["name"], call["arguments"]))
        else:
            result = event["result"]
            happened.append((event["step"], "result", result["ok"], result["content"]))
    return happened


async def test_a_run_through_sigkills_of_every_process_ends_as_an_uninterrupted_one(
    bootstrap_servers, redis_url, tmp_path
):
    prefix = new_prefix()
    (tmp_path / "toolmod.py").write_text(TOOLS_MODULE)
    (tmp_path / "tools.json").write_text(json.dumps([VISIT]))
    started, counted = tmp_path / "started.txt", tmp_path / "count.txt"
    started.touch()
    counted.touch()
    kafka = ["--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix]
    judged = tmp_path / "judged.txt"
    tool_env = {
        "STARTED_FILE": str(started),
        "COUNT_FILE": str(counted),
        "JUDGED_FILE": str(judged),
    }

    def new_pipeline() -> PipelineProcess:
        # a static member: each restart takes the partitions back without waiting for the
        # killed one's session to expire
        flags = ["--deterministic", "--group-instance-id", "harness-test-pipeline"]
        return PipelineProcess(bootstrap_servers, None, prefix, tmp_path, *flags)

    def new_worker() -> Service:
        serving = ["toolmod:visit", "toolmod:poison", "toolmod:score", "toolmod:check"]
        return Service(tmp_path, "tools", "serve", *serving, *kafka, env=tool_env)

    def new_harness() -> Service:
        return Service(tmp_path, "agent", "serve", "--redis-url", redis_url, *kafka)

    def ask(run_id: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "sluice", "agent", "run", *ASK]
            + ["--tools", f"@{tmp_path / 'tools.json'}", "--run-id", run_id, "--json", *kafka],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    async def printed(asking: subprocess.Popen) -> list[dict]:
        out, err = await asyncio.to_thread(asking.communicate, timeout=400)
        assert asking.returncode in (0, 1), (out, err)  # (1: a run that ended otherwise)
        return [json.loads(line) for line in out.splitlines()]

    async def until(run_id: str, holds) -> list[dict]:
        return await events_of(bootstrap_servers, prefix, run_id, holds)

    def has(kind: str):
        return lambda events: any(e.get("kind") == kind for e in events)

    def finals(events: list[dict]) -> int:
        return sum(e["type"] == "harness_final" for e in events)

    async def runs_started(n: int) -> None:
        while len(lines(started)) < n:
            await asyncio.sleep(0.05)

    pipeline, worker, harness = new_pipeline(), new_worker(), new_harness()
    killed: list[PipelineProcess | Service] = []
    calm, crashed = f"run-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:8]}"
    try:
        pipeline.wait_ready()
        worker.wait_for("serving ")
        harness.wait_for("harness serving")
        # a run of a tool that always fails, beside it: ended by its failures, stalling nothing
        poisoned = {
            "run_id": f"{calm}-poison",
            "messages": [{"role": "user", "content": "Look up the tide."}],
            "tools": [POISON],
            "tool_choice": {"type": "function", "function": {"name": "poison"}},
            "max_tool_failures": 1,
            "max_tokens": 30,
        }
        # and a run of two samples, each a run of its own, the longer answer chosen by a tool
        best_of = {
            "run_id": f"{calm}-best",
            "messages": [{"role": "user", "content": "Name a colour in one word."}],
            "tools": [POISON],
            "tool_choice": "none",
            "temperature": 1.0,
            "seed": 3,
            "max_tokens": 24,
            "verifier": {"type": "best-of-n", "n": 2, "scorer": "score"},
        }
        # and a run whose first answer its judge rejects: the model hears why and answers again
        judged_run = {**best_of, "run_id": f"{calm}-judged", "temperature": 0.0}
        judged_run["verifier"] = {"type": "tool", "judge": "check"}
        # and a run whose call waits for an approval
        approved_run = {**poisoned, "run_id": f"{calm}-approved", "needs_approval": ["poison"]}
        await publish(
            bootstrap_servers,
            f"{prefix}.harness",
            [
                (r["run_id"].encode(), json.dumps(r).encode())
                for r in (poisoned, best_of, judged_run, approved_run)
            ],
        )
        printed_calm = await printed(ask(calm))
        poison_events = await until(poisoned["run_id"], finals)
        best_events = await until(best_of["run_id"], finals)
        samples = [await until(f"{best_of['run_id']}.s{i}", finals) for i in range(2)]
        judged_events = await until(judged_run["run_id"], finals)
        waiting = await until(approved_run["run_id"], has("awaiting_approval"))
        (key,) = [e["call"]["key"] for e in waiting if e.get("kind") == "awaiting_approval"]
        approve = [sys.executable, "-m", "sluice", "agent", "approve", approved_run["run_id"], key]
        subprocess.run([*approve, "--by", "test", *kafka], check=True, timeout=60)
        approved_events = await until(approved_run["run_id"], finals)
        # two runs of one session: the second goes on from the first's conversation
        session = f"chat-{uuid.uuid4().hex[:8]}"
        remembered = []
        for i, said in enumerate(("My name is Ada. Greet me.", "What is my name?")):
            asked = {**best_of, "run_id": f"{session}-{i}", "temperature": 0.0}
            asked |= {"messages": [{"role": "user", "content": said}], "session_id": session}
            del asked["verifier"]
            await publish(
                bootstrap_servers,
                f"{prefix}.harness",
                [(asked["run_id"].encode(), json.dumps(asked).encode())],
            )
            remembered += await until(asked["run_id"], finals)
        before = len(lines(counted))
        assert before >= 1 and lines(started) == lines(counted)

        asking = ask(crashed)
        harness.wait_for(f"run {crashed}: started")
        await sigkill(pipeline.pid)  # pipeline 1: the first turn just asked for
        killed.append(pipeline)
        pipeline = new_pipeline()
        await until(crashed, has("tool_call"))
        await runs_started(before + 1)
        await sigkill(worker.pid)  # the call running: this run of it never ends
        killed.append(worker)
        worker = new_worker()
        await runs_started(before + 2)
        await sigkill(harness.pid)  # the call running again
        await sigkill(pipeline.pid)  # pipeline 2: idle, the run waiting on its tool
        killed += [harness, pipeline]
        harness, pipeline = new_harness(), new_pipeline()
        await until(crashed, has("tool_result"))
        await sigkill(pipeline.pid)  # pipeline 3: the next turn just asked for
        killed.append(pipeline)
        pipeline = new_pipeline()
        printed_crashed = await printed(asking)
        events = {run: await until(run, finals) for run in (calm, crashed)}

        # the same run asked for again: its final is sent again, as it was, and nothing is run;
        # a request that is not a valid run: its asker is told why
        question = [{"role": "user", "content": "x"}]
        again = {"run_id": crashed, "messages": question, "tools": [VISIT]}
        bad = {"run_id": f"{crashed}-bad", "messages": [], "tools": [VISIT]}
        await publish(
            bootstrap_servers,
            f"{prefix}.harness",
            [(crashed.encode(), json.dumps(again).encode()), (b"bad", json.dumps(bad).encode())],
        )
        repeated = await until(crashed, lambda es: finals(es) == 2)
        refused = await until(f"{crashed}-bad", finals)
    finally:
        for process in (pipeline, worker, harness, *killed):
            process.stop()

    assert what_happened(events[crashed]) == what_happened(events[calm])
    (best,) = [e for e in best_events if e["type"] == "harness_final"]
    ends = [next(e for e in events if e["type"] == "harness_final") for events in samples]
    scores = [len(e["answer"]) if e["stop_reason"] == "answer" else None for e in ends]
    assert [c.get("score") for c in best["candidates"]] == scores, json.dumps(best_events)
    assert best["stop_reason"] == "answer" and best["answer"] == max(
        (e["answer"] for e in ends if e["stop_reason"] == "answer"), key=len
    )
    (judged_final,) = [e for e in judged_events if e["type"] == "harness_final"]
    turns = [e for e in judged_events if e.get("kind") == "model"]
    verdicts = [e["result"]["content"] for e in judged_events if e.get("kind") == "tool_result"]
    assert judged_final["stop_reason"] == "answer", json.dumps(judged_events)
    assert len(turns) == judged_final["steps"] == 2 and judged_final["tool_calls"] == 2
    assert "fewer words" in verdicts[0] and verdicts[1] == "true"
    assert judged_final["answer"] == turns[1]["text"]
    assert lines(judged) == [t["text"].replace("\n", " ") for t in turns]
    first_run, second_run = [e for e in remembered if e["type"] == "harness_final"]
    ended = {first_run["stop_reason"], second_run["stop_reason"]}
    assert ended <= {"answer", "max_tokens"}, remembered  # (the model's last words: kept)
    assert first_run.get("history") is None and second_run["history"] == [
        {"role": "user", "content": "My name is Ada. Greet me."},
        {"role": "assistant", "content": first_run["answer"]},
    ]
    kept = await settled_session(redis_url, "", session, turns=2)
    assert kept["turn_ids"] == [first_run["run_id"], second_run["run_id"]]
    assert [m["content"] for m in kept["messages"]] == [
        "My name is Ada. Greet me.",
        first_run["answer"],
        "What is my name?",
        second_run["answer"],
    ]
    kinds = [e.get("kind", e["type"]) for e in approved_events]
    assert kinds == [
        "model",
        "tool_call",
        "awaiting_approval",
        "approval",
        "tool_result",
        "harness_final",
    ], json.dumps(approved_events)
    assert approved_events[3]["approval"] == {"run_id": approved_run["run_id"], "key": key} | {
        "approved": True,
        "reason": None,
        "by": "test",
    }
    # (run by the worker once approved: the poison tool's own failure, not a denial)
    assert approved_events[4]["result"]["error"] == "failed"
    (poison_final,) = [e for e in poison_events if e["type"] == "harness_final"]
    assert poison_final["stop_reason"] == "tool_failures", json.dumps(poison_events)
    assert poison_final["tool_calls"] == 1
    (failed,) = [e["result"] for e in poison_events if e.get("kind") == "tool_result"]
    assert not failed["ok"] and failed["error"] == "failed" and "poisoned" in failed["content"]
    (final,) = [e for e in events[crashed] if e["type"] == "harness_final"]
    calls = [e for e in events[crashed] if e.get("kind") == "tool_call"]
    assert len(calls) == final["tool_calls"] >= 1
    # every call run once whole (the tool's own count) through every kill: the run the worker's
    # kill cut short started and did not finish, and no call was run twice
    assert len(lines(counted)) == before + len(calls)
    assert len(lines(started)) == len(lines(counted)) + 1
    # each client printed its run: its events as JSON lines, once each, ending with the final
    for shown, run in ((printed_calm, calm), (printed_crashed, crashed)):
        assert [e["seq"] for e in steps_of(shown)] == sorted(
            {e["seq"] for e in steps_of(events[run])}
        )
        assert shown[-1] == [e for e in events[run] if e["type"] == "harness_final"][0]
        # the turns' text streamed as it came, through every kill: what each turn said, once
        turns = {e["step"]: e["text"] for e in events[run] if e.get("kind") == "model"}
        assert streamed(events[run]) == {k: t for k, t in turns.items() if t}
        assert streamed(shown) == streamed(events[run])
    # replayed from its record, with the recorded tool results: the same run (where a record
    # differs, the report says where: tests/cli/test_replay_run.py)
    replayed = replay("--run-id", crashed, *kafka)
    assert replayed["identical"] and replayed["expected_to_reproduce"], replayed
    assert replayed["turns"] == final["steps"]
    first, second = [e for e in repeated if e["type"] == "harness_final"]
    assert first == second == final
    assert len(lines(counted)) == before + len(calls)  # (nothing run for the repeat)
    (why,) = refused
    assert why["stop_reason"] == "error" and "messages" in why["error"]
