"""Messages between the actors. In one process they travel through mailboxes; with one role per
process they travel as JSON on internal Kafka topics, so each is a pydantic model.

Every message travels in an `Envelope` with the `Delivery` of the Kafka record it came from. The
delivery goes with the work until the work's output crosses a Kafka boundary (the final event on
the tokens topic, or an internal topic in role mode), and only then is done: an input offset is
committed only after its output is safely written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.actors.delivery import Delivery
from sluice.schemas import ErrorEvent, GenerateRequest
from sluice.schemas.events import FinishReason, Provenance, Timings, TokenLogprob, Usage


class _Internal(BaseModel):
    model_config = ConfigDict(extra="ignore")


class KvHandoff(_Internal):
    """A prefill runner passing a request on to a decode runner (`kv_handoff.py`): the request's
    first token is in the progress changelog, its prompt's KV in a file of the transfer directory
    (when the prefill runner had any to pass)."""

    from_runner: str
    kv_file: str | None = None  # a name in the KV transfer directory
    kv_tokens: int = 0  # prompt tokens whose KV the file holds
    kv_source: str | None = None  # "host:port" of the prefill runner's KV file server, if any


class TokenizedRequest(_Internal):
    """tokenizer → scheduler → runner: a valid request with its prompt as token ids."""

    request: GenerateRequest
    prompt_token_ids: list[int]
    # The conversation that the prompt continues (chat messages so far), for the session update.
    conversation: list[dict] = Field(default_factory=list)
    history_messages: int = 0  # messages of the conversation before this turn
    history_tokens: int = 0  # prompt tokens that came from earlier turns of the session
    received_at: float  # unix time the request was read from Kafka (queue time starts here)
    published_at: float | None = None  # unix time the client published it (its record's time)
    # The runner it was first sent to, when that runner died before finishing it and the
    # scheduler moved it (`failover.py`): its progress may be newer than this runner has read.
    taken_over_from: str | None = None
    handoff: KvHandoff | None = None  # from a prefill runner, to a decode runner


class RequestHandle(_Internal):
    """What the streamer needs of a step's request, so that it keeps no state of its own: where
    its events go and how they look. The runner makes it once per request."""

    reply_topic: str | None = None
    session_id: str | None = None
    tenant: str | None = None
    metadata: dict | None = None
    model: str = ""
    runner_id: str = ""
    # How the request wants its events (see GenerateRequest.stream and .event_format).
    stream: bool = True
    event_format: str | None = None
    chat: bool = False
    created: int = 0  # unix second the request was published (OpenAI's `created`)


class StepMessage(_Internal):
    """runner → streamer: what one engine step produced for one request, or its failure."""

    request_id: str
    seq: int  # per request: 0, 1, 2, ...; the final or error message takes the next number
    index: int = 0
    position: int = 0  # tokens of this completion before these
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    # With tools or a reasoning parser: the text the client sees as content (`text` less the
    # reasoning and the calls' text, and less what may still become either), the reasoning, and
    # the calls completed (`output_reader.py`). On the final message: completion 0's whole
    # content, reasoning and every call it made.
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None  # the engine's (`SequenceStatus.finish_reason`)
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    full_text: str | None = None  # on the final message
    choices: list[dict] | None = None  # on the final message when n > 1
    # On the final message of a request that streams nothing but asked for logprobs: all of
    # them, per completion (its one event carries them).
    choice_logprobs: dict[int, list[TokenLogprob]] | None = None
    seed: int | None = None  # on the final message: the request's seed (or the one it was given)
    provenance: Provenance | None = None  # on the final message: what produced it
    # On a final delivered again whose events are committed already (exactly-once): publish
    # nothing, only finish the request (its session turn, its offset).
    published: bool = False
    failure: str | None = None  # on a final with finish_reason "error": what went wrong
    dead_letter: str | None = None  # the request (JSON), when it goes to the dead-letter topic
    error: ErrorEvent | None = None  # set instead of tokens when the request failed
    request: RequestHandle = Field(default_factory=RequestHandle)
    # On the final message of a session's turn: the conversation to remember.
    session_messages: list[dict] | None = None
    session_token_ids: list[int] | None = None
    session_start: tuple[int, int] | None = None  # (messages, token ids) before this turn

    @model_validator(mode="before")
    @classmethod
    def _flat_handle(cls, data: Any) -> Any:
        """A final kept in a progress record by an earlier version holds its handle's fields
        flat: read them into the handle, so such a request still resumes after an upgrade."""
        if isinstance(data, dict) and "request" not in data:
            flat = {k: data[k] for k in RequestHandle.model_fields if k in data}
            if flat:
                data = {**data, "request": flat}
        return data


# What an envelope carries: a client's request (to the tokenizer), a tokenized one (to the
# scheduler and a runner), a step's output (to the streamer).
Work = TokenizedRequest | StepMessage | GenerateRequest
Body = TypeVar("Body", bound=Work)
Derived = TypeVar("Derived", bound=Work)


@dataclass
class Envelope(Generic[Body]):
    """A message and the delivery of the input it follows from (`delivery.py`: done once its
    output is written). Typed by its body (`Envelope[StepMessage]`): each actor knows which kind
    of work it is sent."""

    body: Body
    delivery: Delivery = field(default_factory=Delivery)
    # Records to write in one piece with this message's event (exactly-once: its request's
    # progress records, so that both commit in the same transaction): (topic, key, value).
    writes: list[tuple[str, str, bytes | None]] = field(default_factory=list)

    def derive(self, body: Derived) -> Envelope[Derived]:
        """An envelope for work that follows from this one (the same input's delivery)."""
        return Envelope(body, self.delivery)
