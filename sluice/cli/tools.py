"""`sluice tools`: serve tools to models over Kafka, or print their definitions.

``sluice tools serve module:obj [module:obj ...]`` reads calls from PREFIX.tools.<name> for each
tool and answers on PREFIX.tool-results (`sluice/tools/worker.py`); ``obj`` is a ``@tool``
function, a list of them or a `Toolbox` (``sluice.tools.python_tool:python`` is the sandboxed
Python tool sluice ships). ``sluice tools list module:obj`` prints their definitions as a
request's ``tools`` lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
from typing import Any

from sluice.cli.client import EXIT_FAILED, EXIT_OK, add_kafka_arguments, bootstrap_from_args

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tools",
        help="serve tools to models over Kafka, or print their definitions",
        description="Serve @tool functions (module:obj) to models over Kafka, each call answered "
        "once, or print their definitions.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = actions.add_parser(
        "serve",
        help="answer calls from PREFIX.tools.<name> on PREFIX.tool-results until stopped",
    )
    serve.add_argument("objects", nargs="+", metavar="MODULE:OBJ")
    serve.add_argument(
        "--group",
        help="consumer group of the workers that share the calls (default: PREFIX.tool-workers)",
    )
    serve.add_argument("--worker-id", help="this worker's name in the answers it gives")
    add_kafka_arguments(serve)
    serve.set_defaults(func=run_serve)
    listing = actions.add_parser("list", help="print the tools' definitions (JSON)")
    listing.add_argument("objects", nargs="+", metavar="MODULE:OBJ")
    listing.set_defaults(func=run_list)


def load(spec: str) -> Any:
    """The object `module:obj` names."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"sluice tools: {spec!r} is not MODULE:OBJ")
    sys.path.insert(0, ".")  # (a module beside the caller, as uvicorn and gunicorn find theirs)
    try:
        module = importlib.import_module(module_name)
    finally:
        sys.path.pop(0)
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise SystemExit(f"sluice tools: module {module_name} has no {attribute!r}") from None


def toolbox_of(specs: list[str]):
    from sluice.tools.registry import Toolbox

    tools = [t for spec in specs for t in Toolbox.of(load(spec)).tools.values()]
    return Toolbox(tools)


def run_list(args: argparse.Namespace) -> int:
    print(json.dumps(toolbox_of(args.objects).definitions, indent=2, ensure_ascii=False))
    return EXIT_OK


def run_serve(args: argparse.Namespace) -> int:
    from sluice.tools.worker import serve

    toolbox = toolbox_of(args.objects)
    try:
        asyncio.run(
            serve(
                bootstrap_from_args(args),
                args.topic_prefix,
                toolbox,
                group=args.group,
                worker_id=args.worker_id,
            )
        )
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception:
        log.exception("the tool worker stopped")
        return EXIT_FAILED
    return EXIT_OK
