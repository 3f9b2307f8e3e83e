"""Int8 weight-only linear layers: per-output-channel quantization and the matmul that reads it.

`quantize_int8(weight) -> (qweight, scale)`: weight [N, K] float -> qweight int8 [N, K] and scale
float32 [N], symmetric per output channel: scale = absmax(row) / 127 (at least SCALE_FLOOR, so an
all-zero row gets a positive scale and zero codes), q = round(w / scale) in [-127, 127]. The weight
the layer then computes with is qweight * scale[:, None], within scale / 2 of the original.

`int8_linear_*(x, qweight, scale, bias=None) -> Tensor`: x [..., K] (float32, bfloat16, float16)
-> [..., N] in x's dtype = x @ (qweight * scale[:, None]).T + bias, accumulated in float32. Half
the weight bytes of bfloat16 (a quarter of float32) stream from memory on every step; decode is
bound by exactly that.

- `int8_linear_torch` is the reference and the CPU path: one matmul on the int8 codes converted
  to x's dtype, with the scale applied to the output (M x N work instead of N x K); for small
  bfloat16 batches on the CPU, torch's fused int8-weight GEMM (`aten._weight_int8pack_mm`, what
  torch.compile lowers weight-only int8 to), which reads the codes without converting them.
- `int8_linear_triton` is one GEMM kernel: int8 weight tiles are converted to the activation dtype
  in registers, tl.dot accumulates in float32, and the epilogue applies scale and bias and rounds
  once to x's dtype. Small batches (decode) that give too few output tiles to fill the GPU split K
  over several programs and add the float32 partial sums in a second, deterministic kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from sluice.engine.kernels import interpreting
from sluice.engine.kernels._triton import tl, triton

QMAX = 127
SCALE_FLOOR = 1e-10  # only all-zero (or denormal-sized) rows hit it; their codes are then all zero

# CPU dispatch of `int8_linear_torch`, measured on SmolLM2's shapes with 2 threads (AVX-512 BF16):
# for bfloat16 rows torch's fused int8-weight op is 2-5x faster than convert-and-matmul up to ~16
# rows, but its cost grows linearly with rows (4-20x slower than a BLAS matmul at 512). Its float16
# and float32 kernels are scalar loops, ~3x slower than convert-and-matmul even at one row.
_PACK_MAX_ROWS = {torch.bfloat16: 16, torch.float16: 0, torch.float32: 0}
_FP16_MIN_NORMAL = 2.0**-14  # the fused op takes the scale in x's dtype: keep float16 scales normal
_CHUNK_ELEMS = 1 << 20  # weights above this many elements are converted in slices of rows


# Rows quantized at a time (each row's codes depend on that row alone).
ROWS_AT_A_TIME = 8192


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 codes and float32 scales of a [N, K] float weight."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a 2-D float tensor [N, K], got {tuple(weight.shape)} {weight.dtype}"
        )
    if weight.shape[0] > ROWS_AT_A_TIME:  # a vocabulary matrix: its temporaries a slice at a time
        parts = [quantize_int8(rows) for rows in weight.split(ROWS_AT_A_TIME)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    w = weight.to(torch.float32)
    if w.shape[1] == 0:
        scale = torch.full((w.shape[0],), SCALE_FLOOR, dtype=torch.float32, device=w.device)
    else:
        scale = (w.abs().amax(dim=1) / QMAX).clamp_min_(SCALE_FLOOR)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The one place outputs and workspaces are allocated (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be int8 [N, K], got {tuple(qweight.shape)} {qweight.dtype}")
    n, k = qweight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}], got {tuple(x.shape)}")
    if scale.shape != (n,):
        raise ValueError(f"scale must be [{n}], got {tuple(scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def _pack_mm_ok(x2: torch.Tensor, scale: torch.Tensor) -> bool:
    if x2.device.type != "cpu" or x2.shape[0] > _PACK_MAX_ROWS[x2.dtype] or x2.shape[0] == 0:
        return False
    if x2.dtype == torch.float16 and scale.numel() and scale.min().item() < _FP16_MIN_NORMAL:
        return False
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def _epilogue(
    out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """out * scale + bias in float32, rounded once to `dtype`."""
    if out.dtype != torch.float32:
        out = out.float()  # torch's CPU addcmul and mixed-dtype mul on bfloat16 are scalar loops
    out = out.mul_(scale) if bias is None else torch.addcmul(bias.float(), out, scale, out=out)
    return out.to(dtype)


def _mm_on_codes(
    x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x2 @ codes.T with the codes converted to x's dtype, then the per-channel scale on the output.

    Integers up to 127 are exact in every float dtype, so the matmul sees the exact codes, and the
    scale costs M x N multiplies instead of N x K. On the CPU, weights above _CHUNK_ELEMS are
    converted a slice of rows at a time into one reused buffer: a vocab-sized head would otherwise
    allocate (and page-fault) a fresh N x K float temporary on every call.
    """
    dtype = x2.dtype
    if dtype == torch.float16:
        # x @ codes is up to 127 / absmax(row) times the real output: past float16's 65504 for
        # ordinary activations. bfloat16 has float32's range; float16 is computed in float32.
        x2 = x2.float()
    m, k = x2.shape
    n = qweight.shape[0]
    rows = n if n * k <= _CHUNK_ELEMS or x2.device.type != "cpu" else max(1, _CHUNK_ELEMS // k)
    if rows >= n:
        out = torch.mm(x2, qweight.to(x2.dtype).t())
    else:
        out = _empty((m, n), x2.dtype, x2.device)
        buf = torch.empty((rows, k), dtype=x2.dtype, device=x2.device)
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            w = buf[: n1 - n0].copy_(qweight[n0:n1])
            torch.mm(x2, w.t(), out=out[:, n0:n1])
    return _epilogue(out, scale, bias, dtype)


def int8_linear_torch(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference and CPU path: x @ (qweight * scale).T + bias in x's dtype."""
    _check(x, qweight, scale, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(math.prod(lead), k)
    if _pack_mm_ok(x2, scale):
        # The op takes the scale in x's dtype: for bfloat16 a 2^-9 relative rounding per channel.
        out = torch.ops.aten._weight_int8pack_mm(
            x2.contiguous(), qweight.contiguous(), scale.to(x.dtype).contiguous()
        )
        if bias is not None:
            out = out.add_(bias)
    else:
        out = _mm_on_codes(x2, qweight, scale, bias)
    return out.reshape(*lead, qweight.shape[0])


# ------------------------------------------------------------------------------------------------
# Triton


@dataclass(frozen=True)
class GemmConfig:
    """One launch's tiling: BLOCK_M x BLOCK_N outputs per program, K in BLOCK_K steps, split_k
    ways."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a nominal count, so that small shapes exercise split-K as on a GPU


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemmConfig:
    """Tiles for a [m, k] x [k, n] int8-weight GEMM: decode (m <= 16), mid-size and prefill
    batches."""
    wide = dtype == torch.float32  # twice the shared memory per x tile: shorter K steps
    if m <= 16:
        cfg = GemmConfig(16, 64, 64 if wide else 128, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = GemmConfig(64, 64, 32 if wide else 64, num_warps=4, num_stages=4)
    else:
        cfg = GemmConfig(128, 128, 32 if wide else 64, num_warps=8, num_stages=3)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    sms = _num_sms(device)
    k_blocks = triton.cdiv(k, cfg.block_k)
    if m <= 64 and tiles < sms and k_blocks > 1:
        # Too few output tiles to keep every SM streaming weights: give each a slice of K too.
        want = min(triton.cdiv(sms, tiles), k_blocks, 16)
        per = triton.cdiv(k_blocks, want)
        split = triton.cdiv(k_blocks, per)  # no empty slices
        cfg = GemmConfig(
            cfg.block_m,
            cfg.block_n,
            cfg.block_k,
            split_k=split,
            group_m=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return cfg


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _int8_gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    K_PER_SPLIT,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[M, N] = x[M, K] @ (w[N, K] int8).T * scale[N] + bias[N], or float32 partials per K
    slice."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped order: GROUP_M row tiles sweep the N tiles together, so weight tiles are reused from
    # L2.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64 row offsets: M x N outputs (a prefill through a vocab-sized head) can pass 2^31 elements
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < k_hi
        a = tl.load(
            x_rows + ks[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        # weight tile as [BLOCK_K, BLOCK_N] (K is the contiguous dim of w): int8 -> activation dtype
        b = tl.load(
            w_cols + ks[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0
        )
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=PRECISION)

    if SPLIT_K == 1:
        s = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        res = acc * s[None, :]
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out, res.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    else:
        ws = ws_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out = sum over the SPLIT_K float32 partials [SPLIT_K, M, N], then scale, bias and
    rounding."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    mask_n = offs_n < N
    part = ws_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):  # fixed order: the same inputs give the same bits
        acc += tl.load(part + s * M * N, mask=mask, other=0.0)
    res = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        res += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_dtype_and_precision(dtype: torch.dtype):
    if interpreting() and dtype == torch.bfloat16:
        # The interpreter holds bfloat16 as raw uint16 bits and its tl.dot multiplies those; a bf16
        # x int8 product is exact in float32, so a float32 dot computes the same sums.
        return tl.float32, "ieee"
    if dtype == torch.float32:
        # float32 follows torch's own switch for matmuls (off by default): TF32 only when allowed.
        return tl.float32, "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return _TL_DTYPES[dtype], None  # Triton's default: precision only concerns float32 inputs


def _int8_matmul(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: GemmConfig,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the GEMM (and the split-K reduction) into `out` [M, N]; x2 [M, K] may be strided."""
    m, k = x2.shape
    n = qweight.shape[0]
    if m == 0 or n == 0:
        return out
    dot_dtype, precision = _dot_dtype_and_precision(x2.dtype)
    k_blocks = max(triton.cdiv(k, cfg.block_k), 1)
    k_per_split = triton.cdiv(k_blocks, cfg.split_k) * cfg.block_k
    if cfg.split_k > 1 and workspace is None:
        workspace = _empty((cfg.split_k, m, n), torch.float32, x2.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else scale  # any valid pointer; never read without HAS_BIAS
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _int8_gemm_kernel[grid](
        x2,
        qweight,
        scale,
        bias_arg,
        out,
        workspace if workspace is not None else out,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        out.stride(0),
        out.stride(1),
        k_per_split,
        HAS_BIAS=has_bias,
        SPLIT_K=cfg.split_k,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        bm, bn = 16, 128
        _split_k_reduce_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            workspace,
            scale,
            bias_arg,
            out,
            m,
            n,
            out.stride(0),
            out.stride(1),
            HAS_BIAS=has_bias,
            SPLIT_K=cfg.split_k,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=4,
        )
    return out


def int8_linear_triton(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton GEMM: x @ (qweight * scale).T + bias in x's dtype, float32 accumulation."""
    _check(x, qweight, scale, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(math.prod(lead), k)
    n = qweight.shape[0]
    scale = scale.to(torch.float32).contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = _empty((x2.shape[0], n), x.dtype, x.device)
    if out.numel():
        _int8_matmul(
            x2, qweight, scale, bias, out, pick_config(x2.shape[0], n, k, x.dtype, x.device)
        )
    return out.reshape(*lead, n)
