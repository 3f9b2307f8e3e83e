"""The `--response-format` flag of the commands that make requests (structured output)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def response_format_arg(text: str) -> dict[str, Any]:
    """`--response-format`: a JSON object, or @FILE holding one."""
    source = text
    if text.startswith("@"):
        try:
            source = open(text[1:], encoding="utf-8").read()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {exc.strerror}") from None
    try:
        value = json.loads(source)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. {"type": "json_object"}')
    return value


RESPONSE_FORMAT_HELP = (
    'structured output: a JSON object or @FILE, e.g. \'{"type": "json_object"}\', '
    '\'{"type": "regex", "regex": "[0-9]+"}\' or a json_schema (docs/SCHEMAS.md)'
)
