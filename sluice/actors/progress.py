"""What the runner remembers of every request it serves, so that one taken up again (after a crash,
a restart, a rebalance) goes on from what was published instead of generating it anew.

The record of a request lives in the progress changelog (`PREFIX.progress`, compacted, key =
request id; `connectors.changelog`): its seed, every token message handed to the streamer, and its
final message once there is one. The runner writes a step's records, and waits until the broker
has them, before it hands that step's messages on, so a record always holds at least what a
client may have read. A request seen again then

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

from pydantic import BaseModel, ConfigDict, Field

from sluice.actors.messages import StepMessage
from sluice.connectors.changelog import Changelog
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


class Progress(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_id: str
    digest: str  # of the request as sent: another request under the same id does not resume
    seed: int
    tokens: list[RecordedTokens] = Field(default_factory=list)  # in seq order
    final: StepMessage | None = None

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


def request_digest(request: GenerateRequest) -> str:
    """A fingerprint of the request as the client sent it."""
    return hashlib.sha256(request.model_dump_json().encode()).hexdigest()[:32]


class ProgressLog:
    """The runner's view of the progress changelog."""

    def __init__(self, changelog: Changelog):
        self.changelog = changelog

    async def start(self) -> None:
        await self.changelog.start()

    async def stop(self) -> None:
        await self.changelog.stop()

    async def catch_up(self) -> None:
        await self.changelog.catch_up()

    def get(self, request: GenerateRequest) -> Progress | None:
        """The record of this request, if one is left from an earlier delivery."""
        raw = self.changelog.get(request.request_id)
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
        return record

    async def save(self, records: list[Progress]) -> None:
        """Write the records and wait until the broker has them. While the broker refuses, keep
        trying: the step's messages wait, and behind them the engine (its results are bounded)."""
        payload = {r.request_id: r.model_dump_json(exclude_none=True).encode() for r in records}
        attempt = 0
        while True:
            try:
                await self.changelog.put(payload)
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

    async def forget(self, request_ids: list[str]) -> None:
        """Tombstone the records of requests that will not be delivered again."""
        known = [rid for rid in request_ids if self.changelog.get(rid) is not None]
        if known:
            try:
                await self.changelog.delete(*known)
            except Exception:  # noqa: BLE001 - a missed tombstone costs a stale record, no more
                log.warning("tombstoning %d progress record(s) failed", len(known), exc_info=True)
