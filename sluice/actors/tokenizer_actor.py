"""Tokenizer actor: a valid request becomes token ids, continuing its session's conversation.

It looks the session up in Redis (the conversation so far, as messages and token ids), renders the
chat template, checks the prompt fits the model's context and the deadline has not passed, and
hands the work on. Anything wrong becomes an error event for the client instead.
"""

from __future__ import annotations

import logging
import time

from sluice.actors.conversation import build_prompt
from sluice.actors.messages import Envelope, StepMessage, TokenizedRequest
from sluice.actors.runtime import Actor
from sluice.actors.transport import Sink
from sluice.connectors.sessions import SessionStore
from sluice.engine.tokenizer import Tokenizer
from sluice.schemas import ErrorEvent, GenerateRequest
from sluice.schemas.events import ErrorCode

log = logging.getLogger(__name__)


def error_step(request: GenerateRequest, code: str, message: str, field: str | None = None) -> StepMessage:
    """An error for a request that never reached a runner: its only event, seq 0."""
    event = ErrorEvent.for_request(request, code, message, field=field, seq=0)
    return StepMessage(request_id=request.request_id, seq=0, finished=True, finish_reason="error",
                       error=event, reply_topic=request.reply_topic, session_id=request.session_id,
                       tenant=request.tenant, metadata=request.metadata)


class TokenizerActor(Actor):
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, sessions: SessionStore | None,
                 send_work: Sink, send_error: Sink, *, name: str = "tokenizer", capacity: int = 256):
        super().__init__(name, capacity=capacity)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.sessions = sessions
        self.send_work = send_work
        self.send_error = send_error

    async def handle(self, envelope: Envelope) -> None:
        request: GenerateRequest = envelope.body
        if request.deadline is not None and request.deadline < time.time():
            await self._reject(envelope, ErrorCode.DEADLINE_EXCEEDED,
                               "deadline: already passed when the request was read", "deadline")
            return
        history_messages, history_ids = None, None
        if request.session_id is not None and self.sessions is not None:
            record = await self.sessions.get(request.tenant, request.session_id)
            if record is not None:
                history_messages, history_ids = record.messages, record.token_ids
        prompt = build_prompt(self.tokenizer, request, history_messages, history_ids)
        if len(prompt.token_ids) >= self.max_model_len:
            field = "messages" if request.messages is not None else "prompt"
            await self._reject(
                envelope, ErrorCode.PROMPT_TOO_LONG,
                f"{field}: the prompt is {len(prompt.token_ids)} tokens"
                + (f" ({prompt.history_tokens} from earlier turns of the session)" if prompt.history_tokens else "")
                + f"; the model's context is {self.max_model_len} tokens and one must be left to generate",
                field)
            return
        work = TokenizedRequest(request=request, prompt_token_ids=prompt.token_ids,
                                conversation=prompt.messages, history_tokens=prompt.history_tokens,
                                received_at=envelope.received_at or time.time())
        await self.send_work(Envelope(work, envelope.ack, envelope.received_at))

    async def _reject(self, envelope: Envelope, code: str, message: str, field: str) -> None:
        await self.send_error(Envelope(error_step(envelope.body, code, message, field), envelope.ack))

    async def on_failure(self, message, exc: BaseException) -> None:
        # A bug must not lose the request silently: the client gets an internal error.
        if isinstance(message, Envelope) and isinstance(message.body, GenerateRequest):
            await self._reject(message, ErrorCode.INTERNAL, f"tokenizer failed: {type(exc).__name__}: {exc}", None)
