"""The harness's wire: a `HarnessRequest` on ``PREFIX.harness`` asks for a run (a question, the
tools the model may use, its budgets), and the run's events come back on ``PREFIX.harness-events``
(key: the run id): a `HarnessStep` for each model turn, tool call and tool result as it happens,
then one `HarnessFinal` with the answer and the trace. As every sluice event, each carries
``(run_id, seq)``: a copy sent again after a crash has the same content, and a consumer drops a
``seq`` it has seen.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, model_validator

from .request import MAX_ID_LENGTH, Message, SessionId, Tenant, _request_id
from .tools import FUNCTION_NAME, MAX_TOOLS, Tool, ToolChoice, check_tools
from .version import SCHEMA_VERSION

StopReason = Literal[
    "answer",
    "max_tokens",
    "max_steps",
    "max_tool_calls",
    "budget",
    "timeout",
    "tool_failures",
    "rejected",
    "error",
]


class Verifier(BaseModel):
    """How a run's answer is checked or chosen: a judging tool that accepts it or sends it back
    with its reasons (``tool``), or several samples, each a whole run of its own (its turns, calls
    and limits, its own seed), of which one is chosen (``self-consistency``, ``best-of-n``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["tool", "self-consistency", "best-of-n"] = Field(
        description="tool: the judge accepts the answer, or the model hears why not and answers "
        "again; self-consistency: the answer most samples give; best-of-n: the answer the "
        "scoring tool scores highest."
    )
    n: int = Field(
        3,
        ge=2,
        le=16,
        description="Samples (whole runs); tool: the most answers the judge sees (the first and "
        "its corrections).",
    )
    answer_pattern: str | None = Field(
        None,
        max_length=200,
        description="self-consistency: a regular expression; samples vote with its last match "
        "in their answers (default: the whole answer, case and spacing aside).",
    )
    scorer: str | None = Field(
        None,
        pattern=FUNCTION_NAME,
        description="best-of-n: a tool served on PREFIX.tools.<scorer>, called with the question "
        "and an answer ({question, answer}); its result is the score, a number.",
    )
    judge: str | None = Field(
        None,
        pattern=FUNCTION_NAME,
        description="tool: a tool served on PREFIX.tools.<judge>, called with the question and "
        'the answer ({question, answer}); its result passes when it is JSON true or {"pass": '
        'true}; otherwise the model is shown its "feedback" (or the whole result) and answers '
        "again.",
    )

    @property
    def samples(self) -> bool:
        """Whether it runs several samples (a tool verifier judges the run's own answers)."""
        return self.type != "tool"

    @model_validator(mode="after")
    def _fits(self) -> Verifier:
        if (self.type == "tool") != (self.judge is not None):
            raise ValueError("a judge is the tool verifier's, and it needs one")
        if self.type == "best-of-n" and self.scorer is None:
            raise ValueError("best-of-n needs a scorer (the tool that scores an answer)")
        if self.type != "best-of-n" and self.scorer is not None:
            raise ValueError("a scorer is for best-of-n")
        if self.answer_pattern is not None:
            if self.type != "self-consistency":
                raise ValueError("answer_pattern is for self-consistency")
            try:
                re.compile(self.answer_pattern)
            except re.error as e:
                raise ValueError(f"answer_pattern is not a regular expression: {e}") from None
        return self


class HarnessRequest(BaseModel):
    """A run: the model turns and tool calls that answer `messages`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    schema_version: int = SCHEMA_VERSION
    run_id: Annotated[
        str, Field(min_length=1, max_length=MAX_ID_LENGTH - 16), AfterValidator(_request_id)
    ] = Field(
        default_factory=lambda: uuid.uuid4().hex,
        description="Echoed on every event; its model turns are requests RUN_ID.m0, .m1, ...",
    )
    messages: list[Message] = Field(min_length=1)
    session_id: SessionId | None = Field(
        None,
        description="The run continues this session's conversation (from Redis) and, answered, "
        "adds itself to it, so that a later run or chat request goes on from there.",
    )
    tenant: Tenant | None = Field(None, description="The session's tenant; its turns' tenant.")
    tools: list[Tool] = Field(min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice = Field(
        "auto",
        description="For the first turn (required: make it call); later turns choose (auto), "
        "so that a run cannot be held to calling forever.",
    )
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**64)
    max_tokens: int = Field(512, ge=1, le=32768, description="Most tokens of one model turn.")
    max_steps: int = Field(8, ge=1, le=64, description="Most model turns.")
    max_tool_calls: int = Field(16, ge=0, le=1024)
    max_total_tokens: int = Field(8192, ge=1, description="Most tokens generated over the run.")
    timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False, description="Wall-clock budget.")
    max_tool_failures: int = Field(
        3, ge=1, description="Tool calls failing in a row (each shown to the model) that end it."
    )
    verifier: Verifier | None = Field(
        None, description="Sample several runs and choose the answer (default: one run)."
    )
    needs_approval: list[Annotated[str, Field(pattern=FUNCTION_NAME)]] = Field(
        default_factory=list,
        max_length=MAX_TOOLS,
        description="Tools whose calls wait for an `Approval` on PREFIX.harness-approvals.",
    )
    stream: bool = Field(
        False,
        description="Send each model turn's text as it is generated (`delta` events), besides "
        "its step when it ends.",
    )
    approval_timeout_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="A call not approved this long after it was made is denied (approval_expired).",
    )
    metadata: dict[str, JsonValue] | None = None

    @model_validator(mode="after")
    def _tools_fit(self) -> HarnessRequest:
        check_tools(self.tools, self.tool_choice, prompt_is_chat=True)
        unknown = set(self.needs_approval) - {t.function.name for t in self.tools}
        if unknown:
            raise ValueError(
                f"needs_approval names no tool of the run: {', '.join(sorted(unknown))}"
            )
        if self.verifier is not None and self.verifier.samples and self.temperature == 0:
            raise ValueError(
                "a verifier samples: give a temperature above 0 (else every sample is the same)"
            )
        return self


class Approval(BaseModel):
    """A decision on a call of a tool marked `needs_approval`, on ``PREFIX.harness-approvals``
    (key: the run id). The first decision on a call counts; later ones are dropped."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    schema_version: int = SCHEMA_VERSION
    type: Literal["approval"] = "approval"
    run_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    key: str = Field(min_length=1, max_length=256, description="The call's idempotency key.")
    approved: bool
    reason: str | None = Field(
        None, max_length=2000, description="Shown to the model with a denial."
    )
    by: str | None = Field(None, max_length=200, description="Who decided (for the record).")


class HarnessDelta(BaseModel):
    """Text a model turn of a run with ``stream`` added (a token event of the turn, passed on).
    Not one of the run's numbered events: ``(run_id, step, index)`` names it, and a copy (a
    turn resumed after a crash sends its tokens again, the same) is dropped by that."""

    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION
    type: Literal["delta"] = "delta"
    run_id: str
    step: int = Field(ge=0, description="The model turn.")
    index: int = Field(ge=0, description="The token event's seq within the turn.")
    text: str = ""
    reasoning: str | None = None


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION
    run_id: str
    seq: int = Field(ge=0)


class HarnessStep(_Event):
    """One thing that happened in a run."""

    type: Literal["step"] = "step"
    step: int = Field(ge=0, description="The model turn it belongs to.")
    kind: Literal["model", "tool_call", "awaiting_approval", "approval", "tool_result"]
    text: str | None = Field(None, description="model: what the turn said besides its calls.")
    tool_calls: list[dict[str, Any]] | None = Field(None, description="model: the calls made.")
    call: dict[str, Any] | None = Field(None, description="tool_call: the call as published.")
    result: dict[str, Any] | None = Field(None, description="tool_result: the worker's answer.")
    approval: dict[str, Any] | None = Field(
        None, description="approval: the decision on a call that awaited one."
    )
    seed: int | None = Field(None, description="model: the turn's seed (`sluice replay`).")
    provenance: dict[str, Any] | None = Field(
        None, description="model: the engine and settings that served the turn."
    )


class HarnessFinal(_Event):
    """How a run ended: its answer (the last turn's text), why it stopped, what it cost."""

    type: Literal["harness_final"] = "harness_final"
    answer: str
    stop_reason: StopReason
    steps: int = Field(ge=0, description="Model turns taken.")
    tool_calls: int = Field(ge=0, description="Tool calls made.")
    completion_tokens: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0, description="Over every turn (cached ones included).")
    seconds: float = Field(ge=0)
    trace: list[dict[str, Any]] = Field(
        default_factory=list, description="Every step: the turns, calls and results, in order."
    )
    error: str | None = None
    metadata: dict[str, JsonValue] | None = None
    request: dict[str, Any] | None = Field(
        None, description="The run as asked for: with the trace, what `sluice replay` runs again."
    )
    candidates: list[dict[str, Any]] | None = Field(
        None,
        description="With a verifier: each sample's run id, answer, stop reason and its votes "
        "or score; the final's answer is the chosen one's, its counts the samples' sums.",
    )
    provenance: dict[str, Any] | None = Field(
        None, description="The engine and settings that served the last model turn."
    )
    history: list[dict[str, Any]] | None = Field(
        None,
        description="The session's conversation the run continued (before its messages): with "
        "`request`, what `sluice replay` starts from.",
    )
