"""The `--response-format`, `--tools` and `--tool-choice` flags of the commands that make
requests."""

from __future__ import annotations

import argparse
import json
from typing import Any


def _json_arg(text: str) -> Any:
    """JSON, or @FILE holding it."""
    source = text
    if text.startswith("@"):
        try:
            source = open(text[1:], encoding="utf-8").read()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {exc.strerror}") from None
    try:
        return json.loads(source)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None


def response_format_arg(text: str) -> dict[str, Any]:
    """`--response-format`: a JSON object, or @FILE holding one."""
    value = _json_arg(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. {"type": "json_object"}')
    return value


RESPONSE_FORMAT_HELP = (
    'structured output: a JSON object or @FILE, e.g. \'{"type": "json_object"}\', '
    '\'{"type": "regex", "regex": "[0-9]+"}\' or a json_schema (docs/SCHEMAS.md)'
)


def tools_arg(text: str) -> list[Any]:
    """`--tools`: a JSON array of tool definitions (or one), or @FILE holding it (the output of
    `sluice tools list`)."""
    value = _json_arg(text)
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("must be a JSON array of tools (sluice tools list)")
    return value


def tool_choice_arg(text: str) -> str | dict[str, Any]:
    """`--tool-choice`: auto, none, required, or a function's name."""
    if text in ("auto", "none", "required"):
        return text
    return {"type": "function", "function": {"name": text}}


TOOLS_HELP = (
    "tools the model may call (with --chat): a JSON array or @FILE, e.g. the output of "
    "`sluice tools list module:obj`; their calls are printed as they are made"
)
TOOL_CHOICE_HELP = "auto (default), none, required, or the name of the one function to call"
