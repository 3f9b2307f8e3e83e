"""C kernels for the engine's hot path on the CPU, compiled on this machine at first use (with
`page_reserve.c`, the native thread that reserves a CPU KV cache's pages in the background).

The sources (`*.c` beside this file) are built once with the system C compiler (`$CC`, else
`cc`) for this CPU (`-march=native`) with OpenMP (`$SLUICE_NATIVE_CFLAGS` adds flags), and
cached under `$SLUICE_CACHE_DIR` (default `~/.cache/sluice`), keyed by the sources, flags,
compiler and CPU. They are loaded with ctypes after torch, so their OpenMP threads are torch's own
(one libgomp in the process).

Without a compiler, or if the build fails, `library()` is None, `unavailable_reason()` says why,
and the engine runs its torch path instead (`EngineConfig.kernels="auto"`); forcing
`kernels="native"` then fails with that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch  # loaded first: the library then shares torch's OpenMP runtime

log = logging.getLogger(__name__)

SOURCES = (
    "paged_decode.c",
    "paged_prefill.c",
    "layer_ops.c",
    "kv_write.c",
    "fixed_order_linear.c",
    "block_int8_linear.c",
    "decoder_layers.c",
    "page_reserve.c",
    "gguf_to_blocks.c",
    "row_softmax.c",
)
HEADERS = ("simd.h",)
# -fno-trapping-math lets floorf (in the vectorized exp) vectorize; nothing here relies on FP traps.
# -ffp-contract=off: a multiply and an add round apart on every CPU, as one without FMA does (the
# compiler would otherwise fuse them where the CPU has FMA, and the bits would depend on the build);
# a kernel that wants a fused multiply-add writes one on every path (`fmaf`, or an intrinsic with
# its portable twin), so deterministic mode's bits are the same at every instruction-set level.
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
)
DISABLE_ENV = "SLUICE_NATIVE_KERNELS"  # "0": never build or load them
EXTRA_FLAGS_ENV = (
    "SLUICE_NATIVE_CFLAGS"  # more compiler flags, e.g. "-DSLUICE_NO_BF16_DOT" (simd.h)
)

_lock = threading.Lock()
_state: dict[str, object] = {}


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; None where they cannot be (see
    unavailable_reason)."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"], _state["reason"] = _load(), None
            except _Unavailable as e:
                _state["lib"], _state["reason"] = None, str(e)
                log.info("native CPU kernels unavailable, using the torch path: %s", e)
        return _state["lib"]  # type: ignore[return-value]


def require_library() -> ctypes.CDLL:
    """The compiled kernels, or RuntimeError naming why they are unavailable."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"native CPU kernels are unavailable: {unavailable_reason()}")
    return lib


def matmul_operands(
    x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int
) -> torch.Tensor | None:
    """Check x [M, K] and bias [N] for a C matmul kernel (a CPU matrix with contiguous rows, a
    bias of x's type); returns the bias, contiguous."""
    if x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu" or x.shape[1] != k:
        raise ValueError(
            f"x: a CPU matrix of {k} columns, contiguous rows, expected; got "
            f"{tuple(x.shape)} strides {x.stride()} on {x.device}"
        )
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,)):
        raise ValueError(f"bias: a {x.dtype} vector of {n} expected")
    return None if bias is None else bias.contiguous()


def unavailable_reason() -> str | None:
    library()
    return _state["reason"]  # type: ignore[return-value]


def build_description() -> str | None:
    """The compiler and flags the loaded kernels were built with (they decide the numerics), or
    None where the kernels are unavailable."""
    library()
    return _state.get("build")  # type: ignore[return-value]


def uses_bf16_dot() -> bool:
    """Whether the loaded kernels multiply bfloat16 with the AVX512-BF16 instructions (`simd.h`):
    they add products in pairs and round to bfloat16 their own way, so bfloat16 has bits of its
    own on such a build (-DSLUICE_NO_BF16_DOT builds the other CPUs' arithmetic)."""
    lib = library()
    return lib is not None and bool(lib.sluice_bf16_dot())


class _Unavailable(Exception):
    pass


def cache_root() -> Path:
    """Where the engine keeps what it builds or measures once per machine: `$SLUICE_CACHE_DIR`,
    else `$XDG_CACHE_HOME/sluice` or `~/.cache/sluice`."""
    root = os.environ.get("SLUICE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sluice"
    )
    return Path(root)


def _cache_dir() -> Path:
    return cache_root() / "cpu_kernels"


def cpu_signature() -> str:
    """The CPU model and feature flags: a library built with -march=native runs only where they
    match."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (`flags` in /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        return set()


def _load() -> ctypes.CDLL:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        raise _Unavailable(f"disabled by {DISABLE_ENV}=0")
    if platform.system() != "Linux":
        raise _Unavailable(f"built and tested on Linux only, not {platform.system()}")
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise _Unavailable(f"no C compiler ({cc!r} not on PATH; set CC)")
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"{cc} --version failed: {e}") from e
    here = Path(__file__).parent
    sources = [here / s for s in SOURCES]
    flags = [*FLAGS, *os.environ.get(EXTRA_FLAGS_ENV, "").split()]
    key = hashlib.sha256()
    inputs = sources + [here / h for h in HEADERS]
    for part in [
        *(f.read_bytes() for f in inputs),
        " ".join(flags).encode(),
        version.encode(),
        cpu_signature().encode(),
    ]:
        key.update(part)
    target = _cache_dir() / f"sluice_cpu_kernels-{key.hexdigest()[:16]}.so"
    if not target.exists():
        _build(cc, flags, sources, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise _Unavailable(f"could not load {target}: {e}") from e
    _declare(lib)
    compiler = version.strip().splitlines()[0] if version.strip() else cc
    _state["build"] = f"{compiler}; {' '.join(flags)}"
    return lib


def _build(cc: str, flags: list[str], sources: list[Path], target: Path) -> None:
    """Each source compiled on its own, as many at once as this process has CPUs (largest
    first: the build takes about as long as the slowest source), then linked into `target`."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # build beside the target, then rename: processes starting together never load a
        # half-written file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        objects = tempfile.mkdtemp(dir=target.parent)
    except OSError as e:
        raise _Unavailable(
            f"cannot write to the kernel cache {target.parent} (set SLUICE_CACHE_DIR): {e}"
        ) from e
    compile_flags = [f for f in flags if f != "-shared"]
    compiles = [
        [cc, *compile_flags, "-c", str(source), "-o", os.path.join(objects, source.stem + ".o")]
        for source in sorted(sources, key=lambda f: f.stat().st_size, reverse=True)
    ]
    link = [cc, *flags, "-o", tmp, *(c[-1] for c in compiles), "-lm"]
    log.info(
        "building native CPU kernels: %s -c each of %s; %s",
        cc,
        " ".join(f.name for f in sources),
        " ".join(link),
    )
    try:
        with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
            for done in pool.map(_run, compiles):
                if done.returncode != 0:
                    raise _Unavailable(
                        f"{' '.join(done.args)} failed: {done.stderr.strip()[-2000:]}"
                    )
        done = _run(link)
        if done.returncode != 0:
            raise _Unavailable(f"{' '.join(link)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"building {target.name} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        shutil.rmtree(objects, ignore_errors=True)


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "sluice_paged_decode": (
            i32,
            [
                ptr,
                i64,
                ptr,
                i64,
                ptr,
                i32,
                ptr,
                ptr,
                ptr,
                ptr,
                ptr,
                i64,
                ptr,
                i32,
                i32,
                i32,
                i32,
                f32,
                i32,
                i32,
                i32,
                i32,
                i32,
            ],
        ),
        "sluice_paged_prefill": (
            i32,
            [
                ptr,
                i64,
                ptr,
                i64,
                ptr,
                ptr,
                ptr,
                i32,
                ptr,
                ptr,
                ptr,
                ptr,
                ptr,
                i64,
                i32,
                i32,
                i32,
                i32,
                f32,
                i32,
                i32,
                i32,
                i32,
            ],
        ),
        "sluice_write_kv_int8": (i32, [ptr, i64, i64, i32, i32, i32, ptr, ptr, ptr, i32, i32, i32]),
        "sluice_write_kv_copy": (None, [ptr, i64, i64, i32, i32, i32, ptr, ptr, i32, i32, i32]),
        "sluice_add_rmsnorm": (
            None,
            [ptr, i64, ptr, i64, ptr, i64, ptr, f32, ptr, i64, i32, i32, i32, i32],
        ),
        "sluice_silu_and_mul": (None, [ptr, i64, ptr, i64, i32, i32, i32, i32]),
        "sluice_rotary": (None, [ptr, i64, i32, ptr, i64, i32, i32, ptr, ptr, i32, i32, i32]),
        "sluice_fixed_order_linear": (i32, [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32]),
        "sluice_fixed_order_packed_bytes": (i64, [i64, i64, i32]),
        "sluice_fixed_order_pack": (None, [ptr, i64, i64, i32, ptr]),
        "sluice_block_int8_linear": (
            i32,
            [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32, i32],
        ),
        "sluice_block_int4_packed_bytes": (i64, [i64, i64]),
        "sluice_block_int4_pack": (None, [ptr, ptr, ptr, i64, i64, ptr]),
        "sluice_block_int8_packed_bytes": (i64, [i64, i64]),
        "sluice_block_int8_pack": (None, [ptr, ptr, i64, i64, ptr]),
        "sluice_block_int8_dot_path": (i32, []),
        "sluice_block_int8_rows": (i32, [ptr, i64, i64, i32, ptr, i64, ptr, i32]),
        "sluice_block_q6_packed_bytes": (i64, [i64, i64]),
        "sluice_block_q6_pack": (None, [ptr, ptr, ptr, i64, i64, ptr]),
        "sluice_block_widen": (None, [ptr, i64, i64, i32, ptr, i32, i32]),
        "sluice_gguf_row_bytes": (i64, [i32, i64]),
        "sluice_gguf_to_int8_blocks": (i32, [ptr, i32, i64, i64, ptr, ptr, i32]),
        "sluice_gguf_to_dm_blocks": (i32, [ptr, i32, i64, i64, ptr, ptr, ptr, i32]),
        "sluice_gguf_to_q6_blocks": (i32, [ptr, i64, i64, ptr, ptr, ptr, i32]),
        "sluice_block_q5_packed_bytes": (i64, [i64, i64]),
        "sluice_block_q5_pack": (None, [ptr, ptr, ptr, i64, i64, ptr]),
        "sluice_gguf_rows": (i32, [ptr, i32, i64, i64, ptr, i64, ptr]),
        "sluice_bf16_dot": (i32, []),
        "sluice_row_logsumexp": (None, [ptr, i64, i64, i64, ptr, i32]),
        "sluice_row_exp_shifted": (None, [ptr, i64, ptr, i64, i64, ptr, i32]),
        "sluice_row_cumsum": (None, [ptr, i64, i64, i64, ptr]),
        "sluice_reserve_start": (ptr, [ptr, ptr, i64, i64]),
        "sluice_reserve_state": (i32, [ptr]),
        "sluice_reserve_seconds": (ctypes.c_double, [ptr]),
        "sluice_reserve_release": (None, [ptr]),
        # the layer table and the step as decoder_layers.py's structures
        "sluice_decoder_layers": (i32, [ptr, i32, ptr, ptr, ptr, ptr, ptr]),
        "sluice_decode_forward": (
            i32,
            [ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
