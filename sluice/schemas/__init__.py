"""Wire messages of sluice (pydantic v2, JSON on the wire, versioned).

Requests are strict (unknown fields rejected); events are lenient for consumers (unknown fields
ignored). See ``docs/SCHEMAS.md``. This package imports nothing else from sluice.
"""

from .events import (
    Choice,
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    FinishReason,
    OutputEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .jsonschema import json_schemas
from .parse import RequestRejected, UnknownEventType, decode_event, decode_request, encode
from .request import SAMPLING_FIELDS, GenerateRequest, Message, new_request_id
from .version import SCHEMA_VERSION, SUPPORTED_VERSIONS

__all__ = [
    "SAMPLING_FIELDS",
    "SCHEMA_VERSION",
    "SUPPORTED_VERSIONS",
    "Choice",
    "ErrorCode",
    "ErrorEvent",
    "FinalEvent",
    "FinishReason",
    "GenerateRequest",
    "Message",
    "OutputEvent",
    "RequestRejected",
    "Timings",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "UnknownEventType",
    "Usage",
    "decode_event",
    "decode_request",
    "encode",
    "json_schemas",
    "new_request_id",
]
