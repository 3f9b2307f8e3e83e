"""Prefill/decode separation: a prefill runner computes a prompt and its first token, then passes
the request to a decode runner, which continues it with the prompt's KV instead of computing it.

The request travels over Kafka, to the decode runner's work topic, as the `TokenizedRequest` it
was with a `KvHandoff`; its first token is in the progress changelog (written, and acknowledged by
the broker, before the handoff is sent), so the decode runner takes it up exactly as it takes up a
request resumed after a crash: it sends the recorded token message (the one copy a client reads:
the prefill runner holds it back) and continues after it with the recorded seed. The KV bytes do
not go through Kafka: the prefill runner writes them to a file in a directory both runners read
(`--kv-transfer-dir`, by default in /dev/shm, memory on one host), which the decode runner
removes once it has adopted the blocks. On another host, the decode runner asks the prefill
runner's file server (`--kv-transfer-address`, `KvFileServer`) for the file over TCP instead. A
file that cannot be had only costs the decode runner computing the prompt again.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
import socketserver
import tempfile
import threading
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
FETCH_TIMEOUT_S = 30.0  # a KV file server that does not answer by then: compute the prompt


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

    def take(self, name: str, source: str | None = None) -> KvBlocks | None:
        """Read the file and remove it; from the file server at `source` ("host:port") when it
        is not in this runner's directory. None when it is nowhere (read by a runner that died
        since) or cannot be read."""
        path = self.path(name)
        try:
            if path.exists() or source is None:
                with open(path, "rb") as f:
                    return self._parse(f, name)
            raw = fetch(source, name)
            if raw is None:
                log.warning("KV file %s is not at %s: computing the prompt instead", name, source)
                return None
            return self._parse(io.BytesIO(raw), name)
        except FileNotFoundError:
            log.warning(
                "KV file %s is not in %s: computing the prompt instead (prefill and decode "
                "runners share --kv-transfer-dir on one host, or the prefill runner serves its "
                "files with --kv-transfer-address)",
                name,
                self.directory,
            )
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("KV file %s cannot be read (%s): computing the prompt instead", name, exc)
            return None
        finally:
            path.unlink(missing_ok=True)

    def path(self, name: str) -> Path:
        return self.directory / Path(name).name  # a name, never a path elsewhere

    @staticmethod
    def _parse(f, name: str) -> KvBlocks:
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
                raise ValueError(f"{name} ends early")
            tensors.append(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape))
        hashes = [bytes.fromhex(h) for h in header["hashes"]]
        return KvBlocks(hashes, int(header["block_size"]), tensors)

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


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class KvFileServer:
    """A prefill runner's KV files for decode runners on other hosts, over TCP. A client sends a
    file's name and a newline; the answer is the file's size (8 bytes, big-endian) and its
    bytes, or a size of 0 when there is no such file. A file asked for is removed: it is taken
    once. The names are random (122 bits) and travel only in handoff messages, so only a reader
    of the runners' work topics can ask for a file; keep the port inside the deployment's
    network as the broker is."""

    def __init__(self, files: KvFiles, address: str):
        self.files = files
        self.host, self.port = _split(address)
        self._server: socketserver.ThreadingTCPServer | None = None

    def start(self) -> str:
        """Serve in a thread of its own; the address decode runners reach it at ("host:port":
        this host's name when it listens on every interface)."""
        files = self.files

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                name = self.rfile.readline(200).decode(errors="replace").strip()
                path = files.path(name)
                try:
                    with open(path, "rb") as f:
                        path.unlink()  # taken: the open file is still read in full
                        size = os.fstat(f.fileno()).st_size
                        self.wfile.write(size.to_bytes(8, "big"))
                        self.wfile.flush()
                        self.connection.sendfile(f)
                except FileNotFoundError:
                    self.wfile.write(bytes(8))
                except OSError as exc:  # the decode runner computes the prompt instead
                    log.warning("sending KV file %s failed: %s", name, exc)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(
            target=self._server.serve_forever, name="kv-file-server", daemon=True
        ).start()
        host = socket.gethostname() if self.host in ("", "0.0.0.0", "::") else self.host
        return f"{host}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def fetch(address: str, name: str, timeout: float = FETCH_TIMEOUT_S) -> bytes | None:
    """A KV file from the `KvFileServer` at `address`; None when it has no such file."""
    with socket.create_connection(_split(address), timeout=timeout) as sock:
        sock.sendall(name.encode() + b"\n")
        with sock.makefile("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"{address} closed the connection")
            size = int.from_bytes(head, "big")
            if size == 0:
                return None
            raw = f.read(size)
    if len(raw) != size:
        raise ValueError(f"{name} from {address} ends early")
    return raw


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
        source: str | None = None,
    ):
        self.router = router
        self.files = files
        self._send = send  # (topic, key, value) -> the delivery
        self.runner_id = runner_id
        self.source = source  # where this runner's KvFileServer listens, if it has one

    def available(self) -> bool:
        return bool(self.router.live(kinds=("decode",)))

    def target(self, work: TokenizedRequest, key: str, prefer: str | None = None) -> Choice | None:
        """The decode runner to pass `work` to (`prefer`, when it is alive); None when none is."""
        return self.router.choose_decode(work, key, prefer=prefer)

    async def send(
        self, work: TokenizedRequest, key: str, choice: Choice, kv: KvBlocks | None
    ) -> None:
        """Pass the request on, with its KV in a file; returns once the broker has it."""
        handoff = KvHandoff(from_runner=self.runner_id, kv_source=self.source)
        if kv is not None:
            handoff.kv_file = await asyncio.to_thread(self.files.write, kv)
            handoff.kv_tokens = kv.num_tokens
        passed = work.model_copy(update={"handoff": handoff, "taken_over_from": None})
        value = passed.model_dump_json(exclude_none=True).encode()
        await (await self._send(choice.work_topic, key, value))
