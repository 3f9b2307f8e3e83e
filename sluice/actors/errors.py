"""What a client is told when its request fails inside the pipeline: the error step message the
streamer turns into its error event, and the wire code of an engine error."""

from __future__ import annotations

from sluice.actors.messages import RequestHandle, StepMessage
from sluice.engine.errors import EngineError
from sluice.engine.errors import ErrorCode as EngineErrorCode
from sluice.schemas import ErrorEvent, GenerateRequest
from sluice.schemas.events import ErrorCode

# Engine codes with a wire code of their own; every other engine error is an invalid request.
_WIRE_CODES = {EngineErrorCode.PROMPT_TOO_LONG: ErrorCode.PROMPT_TOO_LONG}


def wire_code(exc: EngineError) -> ErrorCode:
    return _WIRE_CODES.get(exc.code, ErrorCode.INVALID_REQUEST)


def error_step(
    request: GenerateRequest,
    code: str,
    message: str,
    field: str | None = None,
    *,
    to_default_stream: bool = False,
) -> StepMessage:
    """An error for a request that never reached a runner: its only event, seq 0; on the default
    tokens topic instead of the request's reply topic when that topic is the problem."""
    event = ErrorEvent.for_request(request, code, message, field=field, seq=0)
    return StepMessage(
        request_id=request.request_id,
        seq=0,
        finished=True,
        finish_reason="error",
        error=event,
        request=RequestHandle(
            reply_topic=None if to_default_stream else request.reply_topic,
            session_id=request.session_id,
            tenant=request.tenant,
            metadata=request.metadata,
            stream=request.stream,
            event_format=request.event_format,
            chat=request.is_chat,
        ),
    )
