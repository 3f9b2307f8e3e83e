"""Prefill/decode separation: a prefill runner computes a prompt and its first token, then passes
the request to a decode runner, which continues it with the prompt's KV instead of computing it.

The request travels over Kafka, to the decode runner's work topic, as the `TokenizedRequest` it
was with a `KvHandoff`; its first token is in the progress changelog (written, and acknowledged by
the broker, before the handoff is sent), so the decode runner takes it up exactly as it takes up a
request resumed after a crash: it sends the recorded token message (the one copy a client reads:
the prefill runner holds it back) and continues after it with the recorded seed. The KV bytes do
not go through Kafka: the prefill runner writes them to a file in a directory both runners read
(`--kv-transfer-dir`, by default in /dev/shm, memory on one host), which the decode runner
removes once it has adopted the blocks. A file that cannot be read only costs the decode runner
computing the prompt again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from sluice.actors.kv_router import Choice, KvRouter
from sluice.actors.messages import KvHandoff, TokenizedRequest
from sluice.engine.kv_transfer import KvBlocks

log = logging.getLogger(__name__)

MAX_FILE_AGE_S = 600.0  # a handed-off KV file nobody read by then is removed by its writer


def default_transfer_dir() -> str:
    """Memory-backed where the OS has it (Linux's /dev/shm), else the temporary directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return str(base / "sluice-kv")


class KvFiles:
    """KV blocks as files: a JSON header line (hashes, block size, each tensor's dtype and
    shape), then the tensors' bytes. Written under a temporary name and renamed, so a reader
    never sees half a file."""

    def __init__(self, directory: str, owner: str):
        self.directory = Path(directory)
        self.owner = owner  # file names start with it: each runner sweeps only its own
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, kv: KvBlocks) -> str:
        name = f"{self.owner}-{uuid.uuid4().hex}.kv"
        header = {
            "hashes": [h.hex() for h in kv.hashes],
            "block_size": kv.block_size,
            "tensors": [
                {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                for t in kv.tensors
            ],
        }
        partial = self.directory / (name + ".part")
        with open(partial, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            for tensor in kv.tensors:
                f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        partial.rename(self.directory / name)
        return name

    def take(self, name: str) -> KvBlocks | None:
        """Read the file and remove it; None when it is not there (another host, or read by a
        runner that died since) or cannot be read."""
        path = self.directory / Path(name).name  # a name, never a path elsewhere
        try:
            with open(path, "rb") as f:
                header = json.loads(f.readline())
                tensors = []
                for spec in header["tensors"]:
                    dtype = getattr(torch, spec["dtype"])
                    shape = tuple(spec["shape"])
                    count = 1
                    for size in shape:
                        count *= size
                    nbytes = count * torch.empty(0, dtype=dtype).element_size()
                    raw = bytearray(f.read(nbytes))
                    if len(raw) != nbytes:
                        raise ValueError(f"{path.name} ends early")
                    tensors.append(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape))
            hashes = [bytes.fromhex(h) for h in header["hashes"]]
            return KvBlocks(hashes, int(header["block_size"]), tensors)
        except FileNotFoundError:
            log.warning(
                "KV file %s is not in %s: computing the prompt instead (prefill and decode "
                "runners must share --kv-transfer-dir, on one host)",
                name,
                self.directory,
            )
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("KV file %s cannot be read (%s): computing the prompt instead", name, exc)
            return None
        finally:
            path.unlink(missing_ok=True)

    def sweep(self, older_than_s: float = MAX_FILE_AGE_S) -> int:
        """Remove this runner's files that nobody took (their decode runner died, or the request
        was moved to another host)."""
        removed = 0
        cutoff = time.time() - older_than_s
        for path in self.directory.glob(f"{self.owner}-*"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed


class PrefillHandoff:
    """A prefill runner's side: whether a decode runner is there, and passing a request on to the
    one the router chooses (by load and free KV blocks)."""

    def __init__(
        self,
        router: KvRouter,
        files: KvFiles,
        send: Callable[[str, str, bytes], Awaitable[asyncio.Future]],
        *,
        runner_id: str,
    ):
        self.router = router
        self.files = files
        self._send = send  # (topic, key, value) -> the delivery
        self.runner_id = runner_id

    def available(self) -> bool:
        return bool(self.router.live(kinds=("decode",)))

    def target(self, work: TokenizedRequest, key: str, prefer: str | None = None) -> Choice | None:
        """The decode runner to pass `work` to (`prefer`, when it is alive); None when none is."""
        return self.router.choose_decode(work, key, prefer=prefer)

    async def send(
        self, work: TokenizedRequest, key: str, choice: Choice, kv: KvBlocks | None
    ) -> None:
        """Pass the request on, with its KV in a file; returns once the broker has it."""
        handoff = KvHandoff(from_runner=self.runner_id)
        if kv is not None:
            handoff.kv_file = await asyncio.to_thread(self.files.write, kv)
            handoff.kv_tokens = kv.num_tokens
        passed = work.model_copy(update={"handoff": handoff, "taken_over_from": None})
        value = passed.model_dump_json(exclude_none=True).encode()
        await (await self._send(choice.work_topic, key, value))
