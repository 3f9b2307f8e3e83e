"""Rank 0's side of a tensor-parallel engine: it starts the workers, hands each its share of the
model, and sends every step to them before running its own share (`TensorParallelRunner`).

    workers = Workers.launch(engine_config)      # early: their Python starts while we load
    group = workers.start(plan, tensors, ...)    # spec and weight slices to each worker
    ... rank 0 builds its own share of the model ...
    runner = TensorParallelRunner(workers, group, model, ...)   # waits until they are ready

Rank 0 talks to a worker over two pipes (its stdin: the spec, then each step's `StepInputs`; its
stdout: "joining", "ready" or the error that ended it) and the process group (weights at start,
then the embedding broadcast and the all-reduces of every step). A worker that dies or hangs
breaks rank 0's next pipe write or collective; rank 0 then stops the others and raises a
`TensorParallelError` saying which rank and why, for this and every later step.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

import torch

from ..config import EngineConfig, ModelConfig
from ..errors import ConfigError, TensorParallelError
from ..forward import StepInputs
from ..model import CausalLM
from ..model_runner import ModelRunner
from .group import TensorParallelGroup, rank_device, rendezvous_store
from .sharding import ShardPlan
from .worker import WorkerSpec

T = TypeVar("T")

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0  # how long a worker has to exit after its stdin closed before it is killed
# How long a worker has to finish loading (Python, torch), build its share of the model and join
# the group. Not a collective, so not `SLUICE_TP_TIMEOUT_S`'s: a short collective timeout, set to
# catch a hung rank fast, must not fail a start that takes a few seconds on a slow machine.
START_TIMEOUT_S = 300.0
REPORT_WAIT_S = 1.0  # after a failure: how long to wait for a worker's own account of it


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen, inbox: Connection, report: Connection):
        self.rank, self.proc, self.inbox, self.report = rank, proc, inbox, report
        self.error: str | None = None  # what the worker reported before it exited

    @property
    def name(self) -> str:
        return f"rank {self.rank} (pid {self.proc.pid})"

    def expect(self, what: str, timeout_s: float | None = None) -> None:
        """Wait for the worker to say `what`; TensorParallelError when it says otherwise, dies,
        or stays silent past `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.report.poll(0.2):
            if deadline is not None and time.monotonic() > deadline:
                raise TensorParallelError(f"tensor parallel: {self.name} did not start in time")
            if self.proc.poll() is not None:
                break
        try:
            message = self.report.recv()
        except EOFError:
            try:
                self.proc.wait(REPORT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
            why = self.why_gone() or f"{self.name} closed its pipe to rank 0"
            raise TensorParallelError(f"tensor parallel: {why}") from None
        if message[0] != what:
            raise TensorParallelError(f"tensor parallel: {self.name} failed: {message[-1]}")

    def why_gone(self) -> str:
        """What ended the worker, from its report and exit status; '' while it runs on and has
        reported nothing."""
        try:
            while self.report.poll(0):
                message = self.report.recv()
                if message[0] == "error":
                    self.error = message[1]
        except (EOFError, OSError):
            pass
        code = self.proc.poll()
        if self.error:
            return f"{self.name} failed: {self.error}"
        if code is None:
            return ""
        if code < 0:
            return f"{self.name} was killed by signal {signal.Signals(-code).name}"
        return f"{self.name} exited with code {code}"


def _stop(workers: list[_Worker], threads: int | None, grace_s: float = STOP_GRACE_S) -> None:
    """Close the workers' stdin (an idle worker exits), kill what is left after `grace_s`, reap
    them; give rank 0 its torch threads back."""
    for w in workers:
        w.inbox.close()
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.report.close()
    workers.clear()
    if threads is not None:
        torch.set_num_threads(threads)


class Workers:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, workers: list[_Worker], store, threads: int, previous_threads: int):
        self.workers = workers
        self.plan: ShardPlan | None = None
        self.store = store  # the group's rendezvous, served by rank 0
        self.threads = threads  # torch threads of each rank
        self._finalizer = weakref.finalize(self, _stop, workers, previous_threads)
        self._previous_threads = previous_threads

    @classmethod
    def launch(cls, config: EngineConfig) -> Workers:
        """Start ranks 1..N-1 (they wait for `start`), and give rank 0 its share of the threads."""
        n = config.tensor_parallel_size
        device = torch.device(config.device)
        if device.type == "cuda":
            needed = (device.index or 0) + n
            if torch.cuda.device_count() < needed:
                raise ConfigError(
                    f"tensor_parallel_size={n} on {device} needs GPUs {device.index or 0}.."
                    f"{needed - 1}; {torch.cuda.device_count()} are visible",
                    field="tensor_parallel_size",
                )
        previous = torch.get_num_threads()
        threads = max(1, previous // n)
        store = rendezvous_store("127.0.0.1", 0, n, is_master=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        # the worker imports sluice from where this process did, installed or not
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        workers = []
        for rank in range(1, n):
            command = [sys.executable, "-m", "sluice.engine.tensor_parallel.worker"]
            command += ["--rank", str(rank), "--world-size", str(n)]
            command += ["--store-port", str(store.port)]
            stdin_read, stdin_write = os.pipe()
            report_read, report_write = os.pipe()
            try:
                proc = subprocess.Popen(command, stdin=stdin_read, stdout=report_write, env=env)
            finally:
                os.close(stdin_read)
                os.close(report_write)
            inbox = Connection(stdin_write, readable=False)
            workers.append(_Worker(rank, proc, inbox, Connection(report_read, writable=False)))
        torch.set_num_threads(threads)
        return cls(workers, store, threads, previous)

    @property
    def world_size(self) -> int:
        return len(self.workers) + 1

    def shard_plan(self, config: ModelConfig) -> ShardPlan:
        """The split of the model over the ranks (ConfigError where it cannot be split)."""
        self.plan = ShardPlan.of(config, self.world_size)
        return self.plan

    def start(
        self,
        tensors: Mapping[str, torch.Tensor],
        engine_config: EngineConfig,
        kernels: str,
        num_blocks: int,
        source: str,
    ) -> TensorParallelGroup:
        """Tell each worker what it runs, form the group, send each its weight slices; rank 0's
        end of the group."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("Workers.start before shard_plan")
        slices = {}
        for w in self.workers:
            mine = plan.rank_tensors(tensors, w.rank, layers_only=True)
            slices[w.rank] = mine
            device = rank_device(engine_config.device, w.rank)
            spec = WorkerSpec(
                model_config=plan.rank_config(w.rank),
                engine_config=replace(engine_config, device=str(device)),
                kernels=kernels,
                num_blocks=num_blocks,
                threads=self.threads,
                tensors=[(name, tuple(t.shape), t.dtype) for name, t in mine.items()],
                source=source,
            )
            w.inbox.send(spec)
        for w in self.workers:
            w.expect("joining", START_TIMEOUT_S)
        group = TensorParallelGroup(
            self.store, 0, plan.world_size, rank_device(engine_config.device, 0)
        )
        for w in self.workers:
            group.send([t.to(group.device) for t in slices.pop(w.rank).values()], w.rank)
        log.info(
            "tensor parallel: %d ranks over %s, %d torch threads each; %s; rank 0 embeds, "
            "computes the logits and samples; the layers run one by one, with an all-reduce "
            "after o_proj and after down; the weights and KV cache reported are rank 0's",
            plan.world_size,
            group.backend,
            self.threads,
            plan.describe(),
        )
        return group

    def wait_ready(self) -> None:
        for w in self.workers:
            w.expect("ready")

    def send_step(self, inputs: StepInputs) -> None:
        for w in self.workers:
            w.inbox.send(inputs)

    def failure(self, cause: BaseException) -> TensorParallelError:
        """The error to raise after a step failed on rank 0 with `cause`, once every worker is
        stopped: which ranks are gone and why, or rank 0's own failure."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while not (reasons := [r for r in (w.why_gone() for w in self.workers) if r]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)  # a worker that broke the step may take a moment to say so and exit
        self.stop(grace_s=0)  # the others may be mid-step, in a collective: no use waiting
        if not reasons:
            reasons = [f"rank 0's step failed ({type(cause).__name__}: {cause})"]
        return TensorParallelError(
            "tensor parallel: " + "; ".join(reasons) + "; the engine's ranks are stopped"
        )

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the workers: those idle exit once their stdin closes; what is left after
        `grace_s` is killed."""
        if self._finalizer.detach() is not None:
            _stop(self.workers, self._previous_threads, grace_s)


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: each step goes to the workers first; the step's embeddings are
    broadcast from here; the forward takes part in the all-reduces."""

    def __init__(
        self, workers: Workers, group: TensorParallelGroup, model: CausalLM, *args, **kwargs
    ):
        self.workers, self.group = workers, group
        model.shard(group.all_reduce)  # before the runner chooses its route: layer by layer
        super().__init__(model, *args, **kwargs)
        self.broken: TensorParallelError | None = None
        workers.wait_ready()

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        return self._on_all_ranks(super().forward, inputs)

    def logits(self, inputs: StepInputs, sample: list[bool]) -> torch.Tensor:
        return self._on_all_ranks(super().logits, inputs, sample)

    def _on_all_ranks(self, run: Callable[..., T], inputs: StepInputs, *args) -> T:
        """The step sent to the workers, then `run` here: rank 0's part of it."""
        if self.broken is not None:
            raise self.broken
        try:
            self.workers.send_step(inputs)
            return run(inputs, *args)
        except BaseException as exc:
            # the workers may be mid-step, waiting in a collective: they cannot be brought back
            # in step with rank 0, so the group ends here
            self.broken = self.workers.failure(exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like go on as they are
            raise self.broken from exc

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        return self.group.broadcast(super().embed(token_ids))

    def close(self) -> None:
        super().close()
        self.workers.stop()
