"""Resume, never regenerate, on the real broker: `sluice run` SIGKILLed twice in the middle of
generation, greedy, seeded and unseeded sampled requests alike, in both delivery modes. Whatever
was published stays what the request goes on with: no (request_id, seq) ever carries two different
contents, the tokens in seq order are the final event's text, and every request gets one final.
With exactly-once delivery a read_committed consumer sees every (request_id, seq) exactly once,
with no gaps, and the restarted process, a static member of its group, takes its partitions back
at once. Driven by a plain aiokafka client (sluice.testing.pipeline_harness)."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.testing.pipeline_harness import (
    PipelineProcess,
    Streams,
    Watcher,
    committed_everything,
    new_prefix,
    publish,
    request,
)

pytestmark = pytest.mark.integration

SUBJECTS = ["the sea", "a robot", "coffee", "the moon", "trains", "cats", "rain", "music"]


def mixed_requests() -> list[dict]:
    """Greedy, seeded and unseeded sampled requests of spread lengths (the short ones finish
    first, so each kill lands between finals and in the middle of the longer streams)."""
    out = []
    for i in range(18):
        body = {
            "request_id": f"mix-{i:02d}",
            "prompt": f"Note {i}: a few words about {SUBJECTS[i % len(SUBJECTS)]},",
            "max_tokens": 10 + 4 * i,
            "ignore_eos": True,
        }
        kind = i % 3
        if kind == 0:
            body["temperature"] = 0
        else:
            body["temperature"] = 1.0
            body["top_p"] = 0.95
            if kind == 1:
                body["seed"] = 1000 + i
        out.append(body)
    return out


def assert_exactly_once(events: list[dict], rid: str) -> None:
    seen = [(e["type"], e["seq"]) for e in events]
    assert len(seen) == len(set(seen)), f"{rid}: an event seen twice: {seen}"


def assert_one_consistent_stream(events: list[dict], rid: str, max_tokens: int) -> dict:
    """One final (however often sent), each seq with one content, the texts in seq order equal to
    the final's text, no gaps. Returns the final."""
    finals = {(e["seq"], e["text"], e.get("seed")) for e in events if e["type"] == "final"}
    assert len(finals) == 1, (rid, finals)
    assert not [e for e in events if e["type"] == "error"], (rid, events)
    final = next(e for e in events if e["type"] == "final")
    by_seq: dict[int, dict] = {}
    for event in events:
        if event["type"] != "token":
            continue
        seen = by_seq.setdefault(event["seq"], event)
        assert (seen["text"], seen["token_ids"]) == (event["text"], event["token_ids"]), (
            f"{rid} seq {event['seq']} was published with two contents: {seen} and {event}"
        )
    assert sorted(by_seq) == list(range(final["seq"])), (rid, sorted(by_seq))
    assert "".join(by_seq[s]["text"] for s in sorted(by_seq)) == final["text"], rid
    assert sum(len(by_seq[s]["token_ids"]) for s in by_seq) == max_tokens, rid
    assert final["usage"]["completion_tokens"] == max_tokens, rid
    return final


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
async def test_two_sigkills_mid_generation_resume_every_stream(
    bootstrap_servers, tmp_path, delivery
):
    prefix = new_prefix()
    exactly_once = delivery == "exactly-once"
    bodies = mixed_requests()
    ids = {b["request_id"] for b in bodies}
    lengths = {b["request_id"]: b["max_tokens"] for b in bodies}
    processes: list[PipelineProcess] = []
    # Exactly-once runs as a static member (Kafka's group.instance.id) with a session of two
    # minutes: a restart must take its partitions back at once, not after the dead one's session.
    static = (
        ["--group-instance-id", "the-runner", "--session-timeout-ms", "120000"]
        if exactly_once
        else []
    )

    def start(name: str) -> PipelineProcess:
        process = PipelineProcess(
            bootstrap_servers, None, prefix, tmp_path, "--delivery", delivery, *static, name=name
        )
        processes.append(process)
        process.wait_ready()
        return process

    try:
        current = start("first")
        isolation = "read_committed" if exactly_once else "read_uncommitted"
        async with Watcher(bootstrap_servers, prefix, isolation) as watcher:
            messages = [
                request(b["request_id"], **{k: v for k, v in b.items() if k != "request_id"})
                for b in bodies
            ]
            await publish(bootstrap_servers, f"{prefix}.requests", messages)
            partial_before_kill = []
            for finals_before_kill in (3, 9):

                def enough(s: Streams, n=finals_before_kill) -> bool:
                    return sum(1 for rid in ids if s.finals(rid)) >= n

                await watcher.wait_for(enough, 240, f"{finals_before_kill} finals")
                current.kill()
                killed = time.monotonic()
                if not exactly_once:  # (read_committed waits for the dead transaction's abort)
                    await watcher.caught_up()
                partial = {
                    rid
                    for rid in ids
                    if watcher.streams.events[rid] and not watcher.streams.finals(rid)
                }
                partial_before_kill.append(partial)
                seen = sum(len(e) for e in watcher.streams.events.values())
                current = start(f"after-kill-{len(partial_before_kill)}")
                if static:
                    # before the killed member's session (120 s) could have expired: a dynamic
                    # member is handed no partition until then

                    def resumed(s: Streams, seen=seen) -> bool:
                        return sum(len(e) for e in s.events.values()) > seen

                    left = killed + 100 - time.monotonic()
                    await watcher.wait_for(resumed, left, "an event within 100 s of the kill")
            streams = await watcher.wait_finals(ids, timeout=300)
        assert await committed_everything(bootstrap_servers, f"{prefix}.requests", prefix)
        code = current.stop()
        assert code == 0, current.tail()
    finally:
        for process in processes:
            process.kill()
    assert all(partial_before_kill), f"a kill found no stream half done: {partial_before_kill}"

    for body in bodies:
        rid = body["request_id"]
        final = assert_one_consistent_stream(streams.events[rid], rid, lengths[rid])
        if exactly_once:
            assert_exactly_once(streams.events[rid], rid)
        if "seed" in body:
            assert final["seed"] == body["seed"], rid
        else:
            assert isinstance(final["seed"], int), rid  # given one, and told which


async def test_a_runner_sigkilled_among_two_hands_its_requests_to_the_other(
    bootstrap_servers, tmp_path
):
    """One role per process and two runners: SIGKILL one in the middle of generation. Its work
    partitions move to the other runner, which reads the progress the dead one recorded and
    resumes its requests: every stream complete and consistent, as after a whole-process crash."""
    prefix = new_prefix()
    bodies = mixed_requests()
    ids = {b["request_id"] for b in bodies}
    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs: list[PipelineProcess] = []

    def start(role: str, *extra: str, name: str | None = None) -> PipelineProcess:
        process = PipelineProcess(
            bootstrap_servers,
            None,
            prefix,
            tmp_path,
            "--role",
            role,
            *extra,
            name=name or role,
            env=one_thread if role == "runner" else None,
        )
        procs.append(process)
        return process

    runners = [start("runner", "--runner-id", f"runner-{c}", name=f"runner-{c}") for c in "ab"]
    for role in ("tokenizer", "scheduler", "streamer"):
        start(role)
    try:
        for process in procs:
            process.wait_ready(timeout=180)
        deadline = time.monotonic() + 60
        while not all(
            " partitions assigned" in r.text() and "internal.work:" in r.text() for r in runners
        ):
            assert time.monotonic() < deadline, [r.tail() for r in runners]
            await asyncio.sleep(0.3)
        async with Watcher(bootstrap_servers, prefix) as watcher:
            messages = [
                request(b["request_id"], **{k: v for k, v in b.items() if k != "request_id"})
                for b in bodies
            ]
            await publish(bootstrap_servers, f"{prefix}.requests", messages)

            def some_finished(s: Streams) -> bool:
                return sum(1 for rid in ids if s.finals(rid)) >= 3

            await watcher.wait_for(some_finished, 240, "the first finals")
            victim = runners[0]
            victim.kill()
            streams = await watcher.wait_finals(ids, timeout=300)
        survivor = runners[1].text()
    finally:
        for process in procs:
            process.stop()
    assert "resumes after its" in survivor, "the other runner resumed nothing"
    for body in bodies:
        rid = body["request_id"]
        final = assert_one_consistent_stream(streams.events[rid], rid, body["max_tokens"])
        if "seed" in body:
            assert final["seed"] == body["seed"], rid
