"""`sluice run --config FILE`: settings from a TOML file, under the command line and the
environment.

The file's keys are the flags' long names, with dashes or underscores (``max-in-flight = 32``,
``bootstrap_servers = "kafka:9092"``, ``no-sessions = true``), all at the top level. What decides
a setting, first match wins: a flag on the command line, then its environment variable
(``KAFKA_BOOTSTRAP_SERVERS``, ``REDIS_URL``, ``KAFKA_SECURITY_PROTOCOL`` and the other Kafka
security variables), then the file, then the default. An unknown key or
a value of the wrong type is an error naming the key, before anything starts.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from pathlib import Path
from typing import Any

from sluice.cli.kafka_security_flags import ENVIRONMENT as KAFKA_SECURITY_ENVIRONMENT
from sluice.connectors.settings import ENV_KAFKA_BOOTSTRAP, ENV_REDIS_URL

# Settings that an environment variable also sets: the variable wins over the file.
ENVIRONMENT = {
    "bootstrap_servers": ENV_KAFKA_BOOTSTRAP,
    "redis_url": ENV_REDIS_URL,
    **KAFKA_SECURITY_ENVIRONMENT,
}

_NOT_SETTINGS = {"help", "config", "func"}


class ConfigError(ValueError):
    """A config file that cannot be used, said in one line."""


def _kind(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "true or false"
    if isinstance(action, argparse._AppendAction):
        return "an array"
    if action.type is int:
        return "an integer"
    if action.type is float:
        return "a number"
    return "a string"


def _fits(action: argparse.Action, value: Any) -> bool:
    kind = _kind(action)
    if kind == "true or false":
        return isinstance(value, bool)
    if kind == "an array":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if isinstance(value, bool):
        return False
    if kind == "an integer":
        return isinstance(value, int)
    if kind == "a number":
        return isinstance(value, (int, float))
    return isinstance(value, str)


def defaults_from_file(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's settings as defaults for `parser` (flags given on the command line still win),
    leaving out those whose environment variable is set."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not TOML: {exc}") from None
    actions = {a.dest: a for a in parser._actions if a.dest not in _NOT_SETTINGS}
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            names = [name.replace("_", "-") for name in actions]
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: {key}: not a setting of this command{hint}")
        if not _fits(action, value):
            raise ConfigError(f"{path}: {key}: must be {_kind(action)} (got {value!r})")
        if action.type is str.upper and isinstance(value, str):
            value = value.upper()  # as the flag takes it: sasl_ssl is SASL_SSL
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise ConfigError(f"{path}: {key}: must be one of {choices} (got {value!r})")
        if dest in ENVIRONMENT and os.environ.get(ENVIRONMENT[dest]):
            continue
        out[dest] = value
    return out
