"""The messages between whoever calls a tool (the harness, a client) and the workers that serve it,
over Kafka, so that a tool can be written in any language:

* a call goes to ``PREFIX.tools.<name>`` (key: its idempotency key) as a `ToolCallMessage`;
* its answer goes to the call's ``reply_topic`` (default ``PREFIX.tool-results``; key: the
  request id) as a `ToolResultMessage` with the same idempotency key.

The idempotency key names one call once and for all (sluice's harness makes it from the request,
the step and the call's place: ``<request_id>/<step>/<index>``). A worker runs a call once: a call
delivered again is answered with the answer it already gave, and a result may itself be delivered
twice (a worker stopped after publishing it and before committing its offset), so a reader keeps
the first result of each key and drops the rest.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .request import _topic
from .tools import FUNCTION_NAME
from .version import SCHEMA_VERSION

MAX_KEY_LENGTH = 256
ToolFailure = Literal[
    "invalid_arguments", "unknown_tool", "failed", "interrupted", "expired", "denied"
]


class ToolCallMessage(BaseModel):
    """A call of one tool, on ``PREFIX.tools.<name>``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    schema_version: int = SCHEMA_VERSION
    type: Literal["tool_call"] = "tool_call"
    key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH, description="Idempotency key.")
    request_id: str = Field(min_length=1, max_length=128)
    call_id: str = Field(min_length=1, max_length=128, description="The model's id of the call.")
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="A JSON object, as text (as the model wrote it).")
    reply_topic: Annotated[str, AfterValidator(_topic)] | None = Field(
        None, description="Where the result goes (a topic name); null: the default."
    )
    deadline: float | None = Field(
        None, ge=0, description="Unix seconds: a call read after it is answered with an error."
    )


class ToolResultMessage(BaseModel):
    """The answer to one call, on the call's reply topic."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: int = SCHEMA_VERSION
    type: Literal["tool_result"] = "tool_result"
    key: str
    request_id: str
    call_id: str
    name: str
    ok: bool = Field(description="false: `content` says why the call failed.")
    content: str = Field(description="The result (or the error) as the model will read it.")
    error: ToolFailure | None = Field(
        None,
        description="Why it failed: arguments that do not fit the tool; no such tool; the "
        "tool raised; the worker stopped while running it and it may not run twice; its "
        "deadline had passed.",
    )
    seconds: float = Field(0.0, ge=0, description="How long the tool ran.")
    worker: str = Field("", description="The worker that answered.")
