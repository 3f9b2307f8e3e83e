"""Rotary position embedding (HF "rotate half" convention) with the HF scaling variants.

The inverse frequencies follow transformers' `modeling_rope_utils` formulas step by step, so
positions rotate bit-for-bit as they do there. cos/sin are computed per step for the positions in
the batch (a [T, D/2] outer product: cheaper than a table for long contexts) and shared by all
layers.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig
from .errors import ModelError


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low_ff, high_ff = s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the middle band blended
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s.get("factor")
    orig = s.get("original_max_position_embeddings") or max_pos
    if factor is None:
        factor = max_pos / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        else:
            attn_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)


def inv_freq_and_scale(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the factor applied to cos/sin."""
    dim, theta, s = config.head_dim, config.rope_theta, config.rope_scaling
    if s is None:
        return _base_inv_freq(theta, dim), 1.0
    kind = s.get("rope_type", "default")
    if kind == "default":
        return _base_inv_freq(theta, dim), 1.0
    if kind == "linear":
        return _base_inv_freq(theta, dim) / s["factor"], 1.0
    if kind == "llama3":
        return _llama3(_base_inv_freq(theta, dim), s), 1.0
    if kind == "yarn":
        return _yarn(theta, dim, s, config.max_position_embeddings)
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: theta_i / factor_i
        factors = torch.tensor(s["factors"], dtype=torch.float32)
        return _base_inv_freq(theta, dim) / factors, 1.0
    raise ModelError(f"unsupported rope type {kind!r}", field="rope_scaling")


# Positions computed together in `RotaryEmbedding.table`: small enough that torch never splits
# the work
TABLE_CHUNK = 128


class RotaryEmbedding(torch.nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        inv_freq, self.scale = inv_freq_and_scale(config)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= length, D/2] float32, filled a chunk of `TABLE_CHUNK` positions at a
        time and kept: a position gets the same bits in a step of any size (torch computes a
        tensor's last elements with scalar code and the rest with vector code), and a step reads
        rows instead of computing them."""
        have = 0 if self._table is None else self._table[0].shape[0]
        if self._table is not None and have >= length:
            return self._table
        cos = [self._table[0]] if self._table is not None else []
        sin = [self._table[1]] if self._table is not None else []
        for start in range(have, length, TABLE_CHUNK):
            c, s = self.cos_sin(
                torch.arange(start, start + TABLE_CHUNK, device=self.inv_freq.device),
                torch.float32,
            )
            cos.append(c.squeeze(1))
            sin.append(s.squeeze(1))
        self._table = torch.cat(cos), torch.cat(sin)
        return self._table

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D/2] in `dtype` (computed in float32 like HF, then cast)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def full_width(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, D/2] cos, sin -> [T, 1, D] (cos, cos) and (-sin, sin): the layout in which
    `apply_rotary` needs four operations instead of seven (build once per step, use in every
    layer)."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]: rotate the pairs (i, i + D/2), i.e. x*cos + rotate_half(x)*sin.

    cos, sin: [T, 1, D/2] from `cos_sin`, or [T, 1, D] from `full_width`. Both give HF's
    (x1*cos - x2*sin, x2*cos + x1*sin) bit for bit: adding a negated product is exactly
    subtracting it."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if cos.shape[-1] == x.shape[-1]:
        return (x * cos).add_(torch.cat((x2, x1), dim=-1).mul_(sin))
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
