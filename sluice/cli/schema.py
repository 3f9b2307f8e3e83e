"""`sluice schema`: the JSON Schema of every wire message, for clients in any language."""

from __future__ import annotations

import argparse
import json

from sluice.schemas import json_schemas


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "schema", help="print the JSON Schema of the request and event messages"
    )
    parser.add_argument(
        "name",
        nargs="?",
        help="one message: GenerateRequest, TokenEvent, FinalEvent, "
        "ErrorEvent or OutputEvent (default: all, keyed by name)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    schemas = json_schemas()
    if args.name:
        if args.name not in schemas:
            print(f"sluice schema: unknown message {args.name!r}; choose from {', '.join(schemas)}")
            return 2
        print(json.dumps(schemas[args.name], indent=2))
    else:
        print(json.dumps(schemas, indent=2))
    return 0
