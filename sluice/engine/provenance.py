"""What produced an output, as every final event reports it: the weights, tokenizer and chat
template by content hash, the software, and every setting and piece of hardware that decides the
numerics. Two runs with equal provenance (and the same request and seed) are expected to give the
same tokens in deterministic mode; `sluice replay` names the fields that differ when they do not.

Computed once per engine (`engine_provenance`). Hashing the weight files costs a read of them at
~1.5 GB/s (a tenth of a second for the default model, ten seconds for 16 GB of bfloat16), so the
digest is kept per machine, by each file's path, size and modification time
(`weights_sha256.json` in `cpu_kernels.cache_root()`), and a start with the same files reads none
of them again."""

from __future__ import annotations

import functools
import hashlib
import platform
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import EngineConfig
    from .kernel_ops.base import KernelOps
    from .tokenizer import Tokenizer

# The CPU features that choose code paths, and so rounding, in torch and in our kernels.
NUMERIC_CPU_FLAGS = (
    "fma",
    "f16c",
    "avx",
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


# The version of deterministic mode's arithmetic: the same request and seed give the same bits
# under one numerics version on every CPU and build the kernels serve. A change that moves a bit
# of the recorded outputs (tests/engine/data/golden_numerics.json) raises it and records them again
# (docs/REPRODUCIBILITY.md, "The numerics version").
NUMERICS_VERSION = 1


@dataclass(frozen=True)
class Provenance:
    model: str  # the model as the engine was given it (a path or the default model's file)
    weights_sha256: str  # of the weight files read (a GGUF file, or an HF directory's safetensors)
    tokenizer_sha256: str | None  # of the tokenizer's full definition (vocabulary, merges, ...)
    chat_template_sha256: str | None
    sluice_version: str
    git_commit: str | None  # when sluice runs from a checkout ("-dirty" with local changes)
    torch_version: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    kernels: str  # the kernel family (`KernelOps.name`)
    native_build: str | None  # compiler and flags of the native CPU kernels, where they run
    # "NxK" of a quantized projection -> rows from which a step widens it to bfloat16
    # (`widen_probe`); None where no step widens
    widened_from_rows: dict[str, int] | None
    deterministic: bool
    numerics: int  # NUMERICS_VERSION of the sluice that ran it
    device: str
    device_name: str  # the CPU model, or the GPU's name and compute capability
    cpu_features: tuple[str, ...]  # those of NUMERIC_CPU_FLAGS the CPU has
    # how tool calls are written and read (`ToolFormat.name`): it shapes a tool request's prompt
    # and grammar (the pipeline's --tool-call-parser replaces the template's choice)
    tool_format: str | None = None
    # how a reasoning model's thinking is told from its answer (`ReasoningFormat.name`, the
    # pipeline's --reasoning-parser): it decides an answer's text, which a harness run goes on from
    reasoning_format: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_features"] = list(self.cpu_features)
        return d

    def differences(self, other: dict) -> dict[str, tuple[object, object]]:
        """Fields whose values differ from `other` (a provenance as a dict, e.g. from a final
        event): name -> (other's, this one's)."""
        mine = self.to_dict()
        return {
            f.name: (other.get(f.name), mine[f.name])
            for f in fields(self)
            if other.get(f.name) != mine[f.name]
        }


def engine_provenance(
    model_id: str,
    config: EngineConfig,
    ops: KernelOps,
    tokenizer: Tokenizer | None,
    weights_sha256: str,
) -> Provenance:
    """The record of an engine built from `model_id` with `config` (dtype and quantization
    resolved), running on `ops`."""
    device = torch.device(config.device)
    native = ops.runs_native_code
    return Provenance(
        model=model_id,
        weights_sha256=weights_sha256,
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        chat_template_sha256=_sha256_text(tokenizer.chat_template)
        if tokenizer is not None
        else None,
        sluice_version=_sluice_version(),
        git_commit=_git_commit(),
        torch_version=torch.__version__,
        dtype=config.dtype,
        quantization=config.quantization,
        kv_cache_dtype=str(config.kv_torch_dtype).removeprefix("torch."),
        kernels=ops.name,
        native_build=_native_build() if native else None,
        widened_from_rows=_widened_from_rows(ops),
        deterministic=config.deterministic,
        numerics=NUMERICS_VERSION,
        device=str(device),
        device_name=_device_name(device),
        cpu_features=cpu_features(),
        tool_format=tokenizer.tool_format.name if tokenizer is not None else None,
        reasoning_format=tokenizer.reasoning_format.name
        if tokenizer is not None and tokenizer.reasoning_format is not None
        else None,
    )


def _widened_from_rows(ops: KernelOps) -> dict[str, int] | None:
    rows = ops.widen_rows
    return {f"{n}x{k}": m for (n, k), m in sorted(rows.items())} if rows else None


def weights_sha256(
    source: str, tensors: Mapping[str, torch.Tensor], cache_dir: Path | None = None
) -> str:
    """sha256 of the files the weights were read from: a file itself; for a directory, each
    *.safetensors file's name and bytes in name order (kept per machine: the module's
    docstring). Weights that came from no file (built in memory) are hashed as their tensors, by
    name."""
    path = Path(source)
    files = (
        [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    )
    if not files:
        digest = hashlib.sha256()
        for name in sorted(tensors):
            t = tensors[name].detach().cpu().contiguous()
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\0".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    from .cpu_kernels import cache_root
    from .dtype_probe import read_cache, write_cache

    key = "|".join(_file_identity(f) for f in files)
    cache = (cache_dir or cache_root()) / "weights_sha256.json"
    known = read_cache(cache).get(key)
    if known is not None:
        return known["sha256"]
    digest = hashlib.sha256()
    named = path.is_dir()  # a directory's files are named in the digest too
    for f in files:
        if named:
            digest.update(f.name.encode() + b"\0")
        _hash_file(digest, f)
    sha256 = digest.hexdigest()
    write_cache(cache, key, {"sha256": sha256})
    return sha256


def _file_identity(path: Path) -> str:
    """A file as the digest cache knows it: rewritten, it has another size or time."""
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def tokenizer_sha256(tokenizer: Tokenizer | None) -> str | None:
    if tokenizer is None:
        return None
    return _sha256_text(tokenizer.backend.to_str())


def cpu_features() -> tuple[str, ...]:
    from .cpu_kernels import cpu_flags

    flags = cpu_flags()
    return tuple(f for f in NUMERIC_CPU_FLAGS if f in flags)


def _hash_file(digest, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)


def _sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def _cpuinfo(key: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _sluice_version() -> str:
    from sluice import __version__

    return __version__


@functools.cache
def _git_commit() -> str | None:
    """HEAD of the checkout sluice runs from, if it runs from one."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _native_build() -> str | None:
    from .cpu_kernels import build_description

    return build_description()
