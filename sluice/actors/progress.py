"""What the runner remembers of every request it serves, so that one taken up again (after a crash,
a restart, a rebalance) goes on from what was published instead of generating it anew.

The record of a request lives in the progress changelog (`PREFIX.progress`, compacted;
`connectors.changelog`): under its request id a header (digest, seed, and the final message once
there is one), under `request_id seq` each token message handed to the streamer, one record each
so that a step writes only what is new. The runner writes a step's records, and waits until the
broker has them, before it hands that step's messages on, so the records always hold at least what
a client may have read. A request seen again then

- re-sends its recorded messages (the same seq, the same content: consumers drop the copies),
- and, if it had not finished, continues in the engine after the recorded tokens with the same
  seed (`LLMEngine.add_request(resume=...)`), so its next draws are the ones it would have made.

A record is deleted (tombstoned) once the input offset of its request is committed: from then on
the request is never delivered again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

from aiokafka.structs import TopicPartition
from pydantic import BaseModel, ConfigDict, Field

from sluice.actors.messages import StepMessage
from sluice.connectors.changelog import Changelog
from sluice.connectors.transactions import NotOwned
from sluice.schemas import GenerateRequest
from sluice.schemas.events import TokenLogprob

log = logging.getLogger(__name__)

RETRY_S = (0.1, 0.5, 1.0, 2.0, 5.0)  # waits between attempts to write a step's records


class RecordedTokens(BaseModel):
    """One token message as it was handed to the streamer."""

    model_config = ConfigDict(extra="ignore")

    seq: int
    index: int = 0
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    content: str | None = None  # as the message had them (a request with tools)
    tool_calls: list[dict] | None = None


class Progress(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_id: str
    digest: str  # of the request as sent: another request under the same id does not resume
    seed: int
    # How its stints in an engine ended: `crashes` counts those in a row that ended (the process
    # stopped) with nothing published since the stint began (at `seq_at_admission`).
    admissions: int = 0
    seq_at_admission: int = 0
    crashes: int = 0
    final: StepMessage | None = None
    # The decode runner a prefill runner passed it to (prefill/decode separation): delivered to
    # the prefill runner again, it is passed on again, not served there.
    handed_to: str | None = None
    tokens: list[RecordedTokens] = Field(default_factory=list, exclude=True)  # in seq order
    # What `ProgressLog.save` has still to write (not part of any record).
    unsaved_tokens: int = Field(default=0, exclude=True)
    header_saved: bool = Field(default=False, exclude=True)
    # Its request's input partition, into whose transaction its records go (exactly-once).
    origin: TopicPartition | None = Field(default=None, exclude=True)

    def add_tokens(self, tokens: RecordedTokens) -> None:
        self.tokens.append(tokens)
        self.unsaved_tokens += 1

    def delivered_again(self) -> None:
        """The request is here again: its last stint in an engine ended with the process (or its
        ownership of the request). Count it as a crash when it had published nothing since."""
        if self.admissions:
            stalled = self.next_seq == self.seq_at_admission
            self.crashes = self.crashes + 1 if stalled else 0
            self.header_saved = False

    def admitted(self) -> None:
        """A new stint in the engine begins (record it before the engine sees the request)."""
        self.admissions += 1
        self.seq_at_admission = self.next_seq
        self.header_saved = False

    def finish(self, final: StepMessage) -> None:
        self.final = final
        self.header_saved = False

    @property
    def next_seq(self) -> int:
        return self.tokens[-1].seq + 1 if self.tokens else 0

    def resume(self) -> dict[int, list[int]]:
        """The output token ids of each completion, for the engine to continue after."""
        out: dict[int, list[int]] = {}
        for t in self.tokens:
            out.setdefault(t.index, []).extend(t.token_ids)
        return out

    def texts(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for t in self.tokens:
            out[t.index] = out.get(t.index, "") + t.text
        return out


# Request fields added after records were first written, and their unset values: left out of the
# digest while unset, so that a request recorded by an earlier version resumes after an upgrade.
_LATER_FIELDS: dict[str, object] = {
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": True,
    "keep_kv": None,
}
_LATER_MESSAGE_FIELDS = {"tool_calls": True, "tool_call_id": True}


def request_digest(request: GenerateRequest) -> str:
    """A fingerprint of the request as the client sent it."""
    leave_out: dict[str, Any] = {
        name: True for name, unset in _LATER_FIELDS.items() if getattr(request, name) == unset
    }
    if request.messages and not any(m.tool_calls or m.tool_call_id for m in request.messages):
        leave_out["messages"] = {"__all__": _LATER_MESSAGE_FIELDS}
    return hashlib.sha256(request.model_dump_json(exclude=leave_out).encode()).hexdigest()[:32]


class ProgressLog:
    """The runner's view of the progress changelog."""

    def __init__(self, changelog: Changelog):
        self.changelog = changelog
        # Exactly-once: the records commit with the events they describe, so a record holds
        # exactly what a read_committed client can see (never more).
        self.transactional = changelog.transactional
        # Requests passed on to a decode runner: their records are that runner's now, which
        # deletes them once it is done; committing their input here must not.
        self.handed_over: set[str] = set()

    async def start(self) -> None:
        await self.changelog.start()

    async def stop(self) -> None:
        await self.changelog.stop()

    async def catch_up(self) -> None:
        await self.changelog.catch_up()

    def get(self, request: GenerateRequest) -> Progress | None:
        """The record of this request, if one is left from an earlier delivery."""
        rid = request.request_id
        raw = self.changelog.get(rid)
        if raw is None:
            return None
        record = Progress.model_validate_json(raw)
        if record.digest != request_digest(request):
            log.warning(
                "request %s: a progress record of another request under the same id is "
                "ignored (the request is served afresh)",
                request.request_id,
            )
            return None
        record.header_saved = True
        while (tokens := self.changelog.get(_token_key(rid, len(record.tokens)))) is not None:
            record.tokens.append(RecordedTokens.model_validate_json(tokens))
        return record

    def stage(self, record: Progress) -> list[tuple[str, str, bytes | None]]:
        """What is new in the record, as (topic, key, value) records for the caller to write in
        one piece with the event they describe (exactly-once); the table holds them already."""
        payload = self._payload([record])
        record.header_saved, record.unsaved_tokens = True, 0
        return self.changelog.stage(payload)

    def _payload(self, records: list[Progress]) -> dict[str, bytes]:
        payload: dict[str, bytes] = {}
        for r in records:
            if not r.header_saved:
                payload[r.request_id] = r.model_dump_json(exclude_none=True).encode()
            for tokens in r.tokens[len(r.tokens) - r.unsaved_tokens :]:
                payload[_token_key(r.request_id, tokens.seq)] = tokens.model_dump_json(
                    exclude_none=True
                ).encode()
        return payload

    async def save(self, records: list[Progress]) -> None:
        """Write what is new in the records and wait until the broker has it. While the broker
        refuses, keep trying: the step's messages wait, and behind them the engine (whose results
        waiting to be read are bounded)."""
        by_origin: dict[TopicPartition | None, list[Progress]] = {}
        for r in records:
            by_origin.setdefault(r.origin, []).append(r)
        for origin, group in by_origin.items():
            await self._save(group, origin)

    async def _save(self, records: list[Progress], origin: TopicPartition | None) -> None:
        payload = self._payload(records)
        if payload:
            await self._put(payload, origin)
        for r in records:
            r.header_saved, r.unsaved_tokens = True, 0

    async def _put(self, payload: dict[str, bytes], origin: TopicPartition | None) -> None:
        attempt = 0
        while True:
            try:
                await self.changelog.put(payload, origin=origin)
                return
            except NotOwned:
                log.info(
                    "not writing %d progress record(s): their partition moved away", len(payload)
                )
                return
            except Exception as exc:  # noqa: BLE001 - the broker's errors are many; all retried
                delay = RETRY_S[min(attempt, len(RETRY_S) - 1)]
                attempt += 1
                log.warning(
                    "writing %d progress record(s) failed (%s); retrying in %.1f s",
                    len(payload),
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)

    async def forget(self, requests: list[tuple[str, TopicPartition | None]]) -> None:
        """Tombstone the records of requests (id, input partition) that will not be delivered
        again."""
        keys: dict[TopicPartition | None, list[str]] = {}
        for rid, origin in requests:
            if rid in self.handed_over:
                self.handed_over.discard(rid)
                continue
            if self.changelog.get(rid) is None:
                continue
            mine = keys.setdefault(origin, [])
            mine.append(rid)
            seq = 0
            while self.changelog.get(_token_key(rid, seq)) is not None:
                mine.append(_token_key(rid, seq))
                seq += 1
        for origin, group in keys.items():
            try:
                await self.changelog.delete(*group, origin=origin)
            except Exception:  # noqa: BLE001 - a missed tombstone costs a stale record, no more
                log.warning("tombstoning %d progress record(s) failed", len(group), exc_info=True)


def _token_key(request_id: str, seq: int) -> str:
    # A space never appears in a request id (printable ASCII without spaces): no key collides.
    return f"{request_id} {seq}"
