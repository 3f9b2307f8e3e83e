"""Tokenizer actor: a valid request becomes token ids, continuing its session's conversation.

It looks the session up in Redis (the conversation so far, as messages and token ids), renders the
chat template, checks the prompt fits the model's context and the deadline has not passed, and
hands the work on. Anything wrong becomes an error event for the client instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from sluice.actors.conversation import build_prompt
from sluice.actors.errors import error_step, wire_code
from sluice.actors.messages import Envelope, TokenizedRequest
from sluice.actors.reply_topics import ReplyTopics
from sluice.actors.runtime import Actor
from sluice.actors.transport import Sink
from sluice.connectors.sessions import SessionStore
from sluice.engine.errors import EngineError, check_prompt_fits
from sluice.engine.tokenizer import Tokenizer
from sluice.schemas import GenerateRequest
from sluice.schemas.events import ErrorCode

log = logging.getLogger(__name__)

TURN_WAIT_S = 300.0  # the longest a turn waits for its session's previous one
TURN_POLL_S = 0.05


class TokenizerActor(Actor):
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        sessions: SessionStore | None,
        send_work: Sink,
        send_error: Sink,
        *,
        reply_topics: ReplyTopics | None = None,
        turn_wait_s: float = TURN_WAIT_S,
        name: str = "tokenizer",
        capacity: int = 256,
    ):
        super().__init__(name, capacity=capacity)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.sessions = sessions
        self.send_work = send_work
        self.send_error = send_error
        self.reply_topics = reply_topics
        self.turn_wait_s = turn_wait_s
        # Turns waiting for their session's previous turn, per (tenant, session), in order.
        self._waiting: dict[tuple[str | None, str], deque[Envelope[GenerateRequest]]] = {}

    async def handle(self, envelope: Envelope[GenerateRequest]) -> None:
        request: GenerateRequest = envelope.body
        if request.deadline is not None and request.deadline < time.time():
            await self._reject(
                envelope,
                ErrorCode.DEADLINE_EXCEEDED,
                "deadline: already passed when the request was read",
                "deadline",
            )
            return
        if request.reply_topic is not None and self.reply_topics is not None:
            why = await self.reply_topics.check(request.reply_topic)
            if why is not None:
                step = error_step(
                    request,
                    ErrorCode.INVALID_REQUEST,
                    f"reply_topic: {why}",
                    "reply_topic",
                    to_default_stream=True,
                )
                await self.send_error(envelope.derive(step))
                return
        if request.session_id is None or self.sessions is None:
            await self._tokenize(envelope)
            return
        # Each session's turns in order, in a task of the session's own: a turn that waits (for
        # the one before it, or for Redis to come back) holds up no other session's requests.
        turn = (request.tenant, request.session_id)
        if turn in self._waiting:
            self._waiting[turn].append(envelope)
        else:
            self._waiting[turn] = deque([envelope])
            self.spawn(self._serve_turns(turn), name=f"turns-{request.session_id}")

    async def _serve_turns(self, turn: tuple[str | None, str]) -> None:
        """Hand on a session's turns in order, each once the turn before it answered (its prompt
        then continues the answer), or after `turn_wait_s` without it."""
        assert self.sessions is not None
        queue = self._waiting[turn]
        while queue:
            envelope = queue[0]
            request: GenerateRequest = envelope.body
            position = envelope.delivery.position()
            deadline = time.monotonic() + self.turn_wait_s
            while not await self.sessions.begin_turn(
                *turn,
                request.request_id,
                position=position,
                force=(forced := time.monotonic() > deadline),
            ):
                await asyncio.sleep(TURN_POLL_S)
            if forced:
                log.warning(
                    "turn %s of session %s waited %.0f s for the session's previous turn, which "
                    "never ended; served without it",
                    request.request_id,
                    request.session_id,
                    self.turn_wait_s,
                )
            queue.popleft()
            try:
                await self._tokenize(envelope)
            except Exception as exc:  # as in `handle`: the client hears of it, the session goes on
                log.exception("tokenizing %s failed", request.request_id)
                await self.on_failure(envelope, exc)
        del self._waiting[turn]

    async def _tokenize(self, envelope: Envelope[GenerateRequest]) -> None:
        request: GenerateRequest = envelope.body
        history_messages, history_ids = None, None
        if request.session_id is not None and self.sessions is not None:
            # Before this turn's own entry, when it is served again after a crash.
            history = await self.sessions.history_for(
                request.tenant, request.session_id, request.request_id
            )
            if history is not None:
                history_messages, history_ids = history
        prompt = build_prompt(self.tokenizer, request, history_messages, history_ids)
        try:
            check_prompt_fits(
                len(prompt.token_ids),
                self.max_model_len,
                field="messages" if request.messages is not None else "prompt",
                detail=f" ({prompt.history_tokens} from earlier turns of the session)"
                if prompt.history_tokens
                else "",
            )
        except EngineError as exc:
            await self._reject(envelope, wire_code(exc), str(exc), exc.field)
            return
        work = TokenizedRequest(
            request=request,
            prompt_token_ids=prompt.token_ids,
            conversation=prompt.messages,
            history_messages=len(history_messages or []),
            history_tokens=prompt.history_tokens,
            received_at=envelope.delivery.received_at or time.time(),
            published_at=envelope.delivery.published_at,
        )
        await self.send_work(envelope.derive(work))

    async def _reject(
        self, envelope: Envelope[GenerateRequest], code: str, message: str, field: str | None
    ) -> None:
        request: GenerateRequest = envelope.body
        if request.session_id is not None and self.sessions is not None:
            await self.sessions.end_turn(request.tenant, request.session_id, request.request_id)
        await self.send_error(envelope.derive(error_step(request, code, message, field)))

    async def on_failure(self, message, exc: BaseException) -> None:
        # A bug must not lose the request silently: the client gets an internal error.
        if isinstance(message, Envelope) and isinstance(message.body, GenerateRequest):
            await self._reject(
                message, ErrorCode.INTERNAL, f"tokenizer failed: {type(exc).__name__}: {exc}", None
            )
