"""A tensor-parallel worker: rank 1..N-1 of an engine, a process rank 0 starts
(`python -m sluice.engine.tensor_parallel.worker`).

It receives from rank 0, over its stdin, a `WorkerSpec`, then its slices of the layers' weights
through the process group; builds its share of the model and KV cache; says "ready" on its stdout;
then runs each step rank 0 sends (`StepInputs`): the block copies, the step's plan, the forward
from rank 0's embeddings (a broadcast) through its heads and columns, taking part in the
all-reduces. It computes no logits and holds no vocabulary matrix.

It lives exactly as long as rank 0 wants it: its stdin closing (rank 0 closed the engine, or died
and the OS closed the pipe) or its parent changing ends it; SIGINT and SIGTERM are rank 0's to act
on (a Ctrl-C or a graceful stop must not kill a worker while rank 0 drains). A failure is written
to stdout for rank 0 to report, and the process exits, which breaks rank 0's next collective.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import torch

from ..config import EngineConfig, ModelConfig
from ..forward import StepInputs
from ..kernel_ops import resolve_kernel_ops
from ..loader import build_model
from ..model import CausalLM
from ..model_runner import ModelRunner
from .group import TensorParallelGroup, rendezvous_store

log = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0  # how often an idle worker checks that rank 0 is still its parent


@dataclass
class WorkerSpec:
    """What rank 0 tells a worker before anything else."""

    model_config: ModelConfig  # the worker's share of the model (`ShardPlan.rank_config`)
    engine_config: EngineConfig  # dtype resolved; the worker's device
    kernels: str  # the family rank 0 runs (`KernelOps.name`)
    num_blocks: int  # KV blocks, as many as rank 0's
    threads: int  # torch threads of this rank
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]]  # sent in this order, these shapes
    source: str  # where the model came from (for error messages)


def stand_in_config(config: ModelConfig) -> ModelConfig:
    """A worker's model never embeds nor computes logits (rank 0 does): it is built with a
    one-row vocabulary instead of the real matrices."""
    return replace(config, vocab_size=1, tie_word_embeddings=True)


def stand_in_tensors(config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    h = config.hidden_size
    return {
        "model.embed_tokens.weight": torch.zeros(1, h, dtype=dtype),
        "model.norm.weight": torch.ones(h, dtype=dtype),
    }


class WorkerRunner(ModelRunner):
    """A worker's model runner: the step's embeddings come from rank 0."""

    def __init__(self, group: TensorParallelGroup, model: CausalLM, *args, **kwargs):
        self.group = group
        model.shard(group.all_reduce)  # before the runner chooses its route: layer by layer
        super().__init__(model, *args, **kwargs)

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        x = torch.empty(
            len(token_ids), self.config.hidden_size, dtype=self.model.dtype, device=self.device
        )
        return self.group.broadcast(x)


class Inbox:
    """Messages from rank 0 (stdin); EOFError when rank 0 closed it or is gone."""

    def __init__(self, fd: int):
        self._conn = Connection(fd, writable=False)
        self._parent = os.getppid()

    def receive(self):
        while not self._conn.poll(PARENT_CHECK_S):
            if os.getppid() != self._parent:  # rank 0 died and something else holds the pipe
                raise EOFError("rank 0 is gone")
        return self._conn.recv()


def serve(rank: int, world_size: int, store_port: int, inbox: Inbox, report: Connection) -> None:
    spec: WorkerSpec = inbox.receive()
    torch.set_num_threads(spec.threads)
    engine_config = spec.engine_config
    device = torch.device(engine_config.device)  # this rank's (`group.rank_device`)
    report.send(("joining",))
    store = rendezvous_store("127.0.0.1", store_port, world_size, is_master=False)
    group = TensorParallelGroup(store, rank, world_size, device)

    tensors = {
        name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in spec.tensors
    }
    group.receive(list(tensors.values()))
    config = stand_in_config(spec.model_config)
    loaded_dtype = next(iter(tensors.values())).dtype
    tensors.update(stand_in_tensors(config, loaded_dtype))
    ops = resolve_kernel_ops(spec.kernels, device.type)
    model = build_model(
        config,
        tensors,
        engine_config.torch_dtype,
        device,
        quantization=engine_config.quantization,
        ops=ops,
        source=spec.source,
    )
    del tensors
    runner = WorkerRunner(group, model, config, engine_config, spec.num_blocks)
    ops.check(runner.attention)
    report.send(("ready",))

    with torch.inference_mode():
        while True:
            inputs: StepInputs | None = inbox.receive()
            if inputs is None:
                return
            runner.forward(inputs)


def _parent_gone(parent: int, within_s: float = 0.5) -> bool:
    """Whether rank 0 is gone (it may take a moment after its sockets closed to be reaped)."""
    deadline = time.monotonic() + within_s
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # stdout is the report pipe to rank 0: anything else printed goes to stderr
    report = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    logging.basicConfig(
        level=logging.WARNING,
        format=f"tensor-parallel rank {args.rank}: %(levelname)s %(name)s: %(message)s",
    )
    code, parent = 0, os.getppid()
    try:
        serve(args.rank, args.world_size, args.store_port, Inbox(os.dup(0)), report)
    except EOFError:
        pass  # rank 0 closed the engine or is gone
    except BaseException as exc:  # noqa: BLE001 - whatever it is, rank 0 must hear of it
        if _parent_gone(parent):
            os._exit(0)  # rank 0 died mid-step, which is what broke the collective
        code = 1
        traceback.print_exc()
        try:
            report.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass  # rank 0 is gone
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a broken process group may hang in it


if __name__ == "__main__":
    main()
