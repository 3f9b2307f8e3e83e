"""The ranks of a tensor-parallel engine as one torch.distributed process group: the all-reduce
that adds up the partial sums of row-parallel layers, the broadcast of rank 0's embeddings, and
point-to-point sends of the weights at start.

Gloo on the CPU, NCCL on CUDA. The group is built from its own store and is no default group
(`init_process_group` is not called), so one process may hold several engines, one after the
other or at once. Every collective waits at most `collective_timeout()`; a rank that died breaks
the others' collectives at once (the connection closes), one that hangs after that timeout.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_ENV = "SLUICE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # far above one half-layer of compute, the longest a rank waits in one


def collective_timeout() -> timedelta:
    """How long a rank waits for the others in one collective before the group is given up."""
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device when rank 0 runs on `device`: the next GPUs on CUDA, the CPU else."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


def rendezvous_store(host: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """The store the group's ranks meet at (rank 0 holds it; port 0: any free port)."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master,
        timeout=collective_timeout(),
        wait_for_workers=False,
    )


class TensorParallelGroup:
    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device):
        """Join the group (blocks until every rank has)."""
        self.rank, self.world_size, self.device = rank, world_size, device
        timeout = collective_timeout()
        # ProcessGroupGloo or ProcessGroupNCCL: torch's stubs give them no common type with these
        # methods
        self._pg: Any
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.backend = "nccl"
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.backend = "gloo"
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the sum)."""
        x = x.contiguous()
        self._pg.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._pg.broadcast([x], options).wait()
        return x

    def send(self, tensors: list[torch.Tensor], rank: int) -> None:
        """Tensors to rank `rank`, which takes them with `receive` in the same order."""
        for t in tensors:
            self._pg.send([t.contiguous()], rank, 0).wait()

    def receive(self, tensors: list[torch.Tensor]) -> None:
        """Fill `tensors` with what rank 0 `send`s, in order."""
        for t in tensors:
            self._pg.recv([t], 0, 0).wait()
