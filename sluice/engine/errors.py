"""The one error type the engine raises for bad input: a request parameter, a model file, a setting
(and `TensorParallelError`, for an engine that cannot go on).

It subclasses ValueError so callers that only know "bad value" still catch it. It carries the name
of what was at fault (`field`), so an error event can point the client at it, and a `code` saying
what kind of fault it is, so a caller maps it to its own error codes without reading the message.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"  # a request parameter is malformed or out of its range
    PROMPT_TOO_LONG = "prompt_too_long"  # the prompt leaves no room to generate in the context
    EXCEEDS_KV_CACHE = "exceeds_kv_cache"  # the request could never fit in this engine's KV cache
    INVALID_MODEL = "invalid_model"  # a model file, its configuration or its tokenizer
    INVALID_CONFIG = "invalid_config"  # an engine setting


class EngineError(ValueError):
    """Bad input to the engine. `field` names the parameter or file at fault (None if neither)."""

    default_code = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, field: str | None = None, code: ErrorCode | None = None):
        self.field = field
        self.reason = message
        self.code = code or self.default_code
        # The message names the field, so a log line or an error event is useful on its own.
        super().__init__(f"{field}: {message}" if field else message)


class ModelError(EngineError):
    """A model that cannot be loaded: a file, its configuration, its tokenizer."""

    default_code = ErrorCode.INVALID_MODEL


class ConfigError(EngineError):
    """An engine setting that cannot work (here, with this model, on this device)."""

    default_code = ErrorCode.INVALID_CONFIG


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed or is gone: no step can run any more, and no
    request is at fault (the engine does not end requests one by one for it)."""


def check_prompt_fits(
    num_tokens: int, max_model_len: int, field: str = "prompt", detail: str = ""
) -> None:
    """The one check that a prompt leaves room to generate: at least one token must fit after it
    in the model's context. `detail` is added after the prompt's length (e.g. where it came
    from)."""
    if num_tokens >= max_model_len:
        raise EngineError(
            f"the prompt has {num_tokens} tokens{detail}; the model's context is {max_model_len} "
            "tokens and at least one must be left to generate",
            field=field,
            code=ErrorCode.PROMPT_TOO_LONG,
        )
