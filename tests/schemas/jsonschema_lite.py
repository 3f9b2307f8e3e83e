"""A small JSON Schema (2020-12) checker for the keywords our schemas use.

The `jsonschema` package is not a dependency; when it is installed, ``validate`` also runs it and
both must agree.
"""

from __future__ import annotations

import math
import re
from typing import Any

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}

_IGNORED = {
    "$schema",
    "$id",
    "$defs",
    "title",
    "description",
    "default",
    "examples",
    "format",
    "discriminator",
    "readOnly",
    "writeOnly",
}


def errors(
    instance: Any, schema: dict[str, Any], root: dict[str, Any] | None = None, path: str = "$"
) -> list[str]:
    """Every violation of ``schema`` by ``instance`` (empty when valid)."""
    root = schema if root is None else root
    out: list[str] = []
    for key, want in schema.items():
        if key in _IGNORED:
            continue
        if key == "$ref":
            assert want.startswith("#/$defs/"), want
            out += errors(instance, root["$defs"][want[len("#/$defs/") :]], root, path)
        elif key == "type":
            kinds = want if isinstance(want, list) else [want]
            if not any(_TYPES[k](instance) for k in kinds):
                out.append(f"{path}: not of type {want}")
        elif key == "const":
            if instance != want or (type(instance) is bool) != (type(want) is bool):
                out.append(f"{path}: not {want!r}")
        elif key == "enum":
            if instance not in want:
                out.append(f"{path}: not one of {want}")
        elif key == "properties":
            if isinstance(instance, dict):
                for name, sub in want.items():
                    if name in instance:
                        out += errors(instance[name], sub, root, f"{path}.{name}")
        elif key == "required":
            if isinstance(instance, dict):
                out += [f"{path}: missing {name}" for name in want if name not in instance]
        elif key == "additionalProperties":
            if isinstance(instance, dict):
                extra = [k for k in instance if k not in schema.get("properties", {})]
                for name in extra:
                    if want is False:
                        out.append(f"{path}: unexpected {name}")
                    elif isinstance(want, dict):
                        out += errors(instance[name], want, root, f"{path}.{name}")
        elif key == "items":
            if isinstance(instance, list):
                for i, item in enumerate(instance):
                    out += errors(item, want, root, f"{path}[{i}]")
        elif key == "minItems":
            if isinstance(instance, list) and len(instance) < want:
                out.append(f"{path}: fewer than {want} items")
        elif key == "maxItems":
            if isinstance(instance, list) and len(instance) > want:
                out.append(f"{path}: more than {want} items")
        elif key == "minLength":
            if isinstance(instance, str) and len(instance) < want:
                out.append(f"{path}: shorter than {want}")
        elif key == "maxLength":
            if isinstance(instance, str) and len(instance) > want:
                out.append(f"{path}: longer than {want}")
        elif key == "pattern":
            if isinstance(instance, str) and not re.search(want, instance):
                out.append(f"{path}: does not match {want}")
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if _TYPES["number"](instance) and math.isfinite(instance):
                ok = {
                    "minimum": instance >= want,
                    "maximum": instance <= want,
                    "exclusiveMinimum": instance > want,
                    "exclusiveMaximum": instance < want,
                }[key]
                if not ok:
                    out.append(f"{path}: fails {key} {want}")
        elif key == "anyOf":
            if not any(not errors(instance, sub, root, path) for sub in want):
                out.append(f"{path}: matches none of anyOf")
        elif key == "oneOf":
            matched = sum(not errors(instance, sub, root, path) for sub in want)
            if matched != 1:
                out.append(f"{path}: matches {matched} of oneOf")
        elif key == "allOf":
            for sub in want:
                out += errors(instance, sub, root, path)
        else:
            raise AssertionError(f"jsonschema_lite: unsupported keyword {key!r} at {path}")
    return out


def is_valid(instance: Any, schema: dict[str, Any]) -> bool:
    ok = not errors(instance, schema)
    try:
        import jsonschema  # optional cross-check
    except ImportError:
        return ok
    assert jsonschema.Draft202012Validator(schema).is_valid(instance) == ok
    return ok
