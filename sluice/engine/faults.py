"""What a fault inside one request does, and how tests make one happen.

A step that raises is bisected (`isolate_fault`): halves of its requests run again until the one
whose tokens fail alone is found; that request ends with finish_reason "error", the others go on.

Fault injection makes the engine fail while serving one request, as a bug in a kernel or an
input no code path expected would.

`SLUICE_INJECT_FAULT=raise:MARKER` makes every step that computes a sequence whose prompt text
contains MARKER raise (the engine then ends that request alone with finish_reason "error");
`exit:MARKER` ends the process on the spot instead, as a crash in native code would (the pipeline,
restarted, then meets the request again: after a few such crashes it goes to the dead-letter topic).
Nothing is injected without the variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from sluice.engine.errors import TensorParallelError
from sluice.engine.outputs import StepOutput
from sluice.engine.scheduler import ScheduledBatch
from sluice.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ENV = "SLUICE_INJECT_FAULT"


def isolate_fault(
    suspects: list[str],
    exc: Exception,
    run: Callable[[set[str]], list[StepOutput]],
    alive: Callable[[str], bool],
    fail: Callable[[str, Exception], list[StepOutput]],
) -> list[StepOutput]:
    """After a step of the requests `suspects` failed with `exc`: `run` (a step of only the
    requests given) halves of them until the one request whose tokens fail alone is found, and
    `fail` it. Returns what the halves that ran produced. (Nothing of the failed step was kept:
    its tokens are computed again.) `alive`: whether a request is still in the engine. A
    TensorParallelError is no request's fault: it goes on up."""
    log.warning(
        "a step of %d request(s) failed (%s: %s); looking for the one that fails it",
        len(suspects),
        type(exc).__name__,
        exc,
    )
    outputs: list[StepOutput] = []
    while len(suspects) > 1:
        half, rest = suspects[: len(suspects) // 2], suspects[len(suspects) // 2 :]
        try:
            outputs += run(set(half))
            suspects = rest
        except TensorParallelError:
            raise
        except Exception as again:  # noqa: BLE001
            suspects, exc = half, again
        suspects = [rid for rid in suspects if alive(rid)]
    if suspects:
        try:
            outputs += run(set(suspects))
        except TensorParallelError:
            raise
        except Exception as alone:  # noqa: BLE001
            outputs += fail(suspects[0], alone)
    return outputs


class InjectedFault(RuntimeError):
    """The fault `SLUICE_INJECT_FAULT` asked for."""


def fault_hook_from_env(tokenizer: Tokenizer | None) -> Callable[[ScheduledBatch], None] | None:
    spec = os.environ.get(ENV)
    if not spec or tokenizer is None:
        return None
    mode, _, marker = spec.partition(":")
    if mode not in ("raise", "exit") or not marker:
        raise ValueError(f"{ENV} must be raise:MARKER or exit:MARKER, not {spec!r}")
    log.warning(
        "%s is set: steps computing a prompt that contains %r will %s",
        ENV,
        marker,
        "raise" if mode == "raise" else "end the process",
    )
    poisoned: dict[int, bool] = {}  # seq id -> its prompt holds the marker

    def hook(batch: ScheduledBatch) -> None:
        for seq in batch.seqs:
            hit = poisoned.get(seq.seq_id)
            if hit is None:
                text = tokenizer.decode(seq.prompt_token_ids, skip_special_tokens=False)
                hit = poisoned[seq.seq_id] = marker in text
            if hit:
                if mode == "exit":
                    os._exit(70)  # no cleanup, as a crash
                raise InjectedFault(f"injected fault for a prompt containing {marker!r}")

    return hook
