"""Draw one token per row from a temperature-scaled, min-p / top-k / top-p truncated softmax.

The rules and their order follow `sluice.engine.sampler` (penalties and logprobs stay there):
temperature, then min-p, top-k, then top-p over what is left. Everything is defined on the
*scaled gap* of each token, w_i = (max_j l_j - l_i) / T (float32, so w >= 0 and the best token has
w = 0); a token's unnormalized probability is exp(-w_i), and every filter keeps the tokens with
w_i <= some threshold:

- min-p keeps w <= -log(min_p) (p_i >= min_p * p_max);
- top-k keeps w <= the k-th smallest gap among those;
- top-p keeps w <= the smallest gap W at which the mass of {w <= W} reaches top_p times the mass
  of what min-p and top-k kept (the smallest prefix of the sorted probabilities reaching top_p).

Ties at a threshold: every token whose gap equals the threshold is kept, so top-k may keep more
than k tokens when the k-th largest logit is tied (sampler.py breaks such ties by torch.topk's
order instead); with untied logits the sets are the same.

Arguments (one value per row): temperature <= 0 means greedy (argmax, lowest index on ties);
top_k <= 0 or >= V is off; top_p >= 1 is off (<= 0 keeps only the best token and its ties);
min_p <= 0 is off (>= 1 keeps only the best token and its ties). Logits of -inf (masked tokens),
and finite logits whose gap overflows to inf at a tiny temperature, are never drawn; a row with no
finite logit returns token 0, like argmax. Logits must not be NaN or +inf.

Seeds: a row's draw is a function of its logits, its parameters and its seed only, never of its
batch mates or its position in the batch (the caller mixes request seed and step into the seed).

`sample_torch` draws by inverse CDF with one uniform from `torch.Generator(seed)` per row;
`sample_triton` draws by an exponential race (Gumbel-max) with Philox numbers keyed by the seed.
Both draw exactly from `kept_probs_torch`'s distribution but are not token-for-token identical.
"""

from __future__ import annotations

import torch

from sluice.engine.kernels._triton import tl, triton

# Chunk sizes of the Triton kernel (module constants so tests can force many small chunks).
_BLOCK_MAX = 1024  # elements per chunk in the streaming passes (max, draw)
_PIVOT_BLOCK_MAX = 256  # elements per chunk in the threshold searches ([chunk, _NUM_PIVOTS] tiles)
_NUM_PIVOTS = 16  # thresholds tried per search pass: each pass shrinks the range 16-fold
_VALUE_PASSES = 4  # search passes with pivots spaced by gap value before spacing them by key

_INF = float("inf")


# ---------------------------------------------------------------------------------------------
# torch reference (and CPU fallback)
# ---------------------------------------------------------------------------------------------


def kept_probs_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """[N, V] float32: each row's sampling distribution after temperature, min-p, top-k and top-p
    (renormalized, zeros outside the kept set); greedy rows are one-hot at the argmax."""
    x = logits.float()
    if x.shape[0] == 0:
        return x.clone()
    gap, kept, greedy = kept_set_torch(x, temperature, top_k, top_p, min_p)
    weights = torch.where(kept, torch.exp(-gap), torch.zeros_like(gap))
    probs = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def kept_set_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gap [N, V] float32, kept [N, V] bool, greedy [N, 1] bool): each token's scaled gap
    w = (max logit - logit) / T and whether the filters keep it (never on greedy rows, whose one
    token is the argmax). A kept token may still have probability exp(-w) = 0 in float32."""
    x = logits.float()
    v = x.shape[1]
    best = x.max(dim=-1, keepdim=True).values
    t = temperature.float().unsqueeze(1)
    greedy = ~(t > 0) | (best == -_INF)  # NaN temperature too, like the kernel
    gap = (best - x) / torch.where(greedy, torch.ones_like(t), t)
    kept = (gap < _INF) & ~greedy  # NaN (no finite logit) and inf gaps are never kept

    mp = min_p.float()
    cut = torch.where(mp > 0, -torch.log(mp), torch.full_like(mp, _INF)).clamp(min=0)
    kept &= gap <= cut.unsqueeze(1)

    k = top_k.long()
    count = kept.sum(dim=-1)
    k_on = (k > 0) & (k < count)
    if k_on.any():
        sorted_gap = torch.where(kept, gap, _INF).sort(dim=-1).values
        kth = sorted_gap.gather(1, (k.clamp(1, v) - 1).unsqueeze(1))
        kept &= ~k_on.unsqueeze(1) | (gap <= kth)

    tp = top_p.float()
    p_on = tp < 1
    if p_on.any():
        sorted_gap = torch.where(kept, gap, _INF).sort(dim=-1).values
        mass = torch.exp(-sorted_gap).cumsum(dim=-1)  # exp(-inf) = 0: dropped tokens add nothing
        target = tp.unsqueeze(1) * mass[:, -1:]
        first = (
            (mass < target).sum(dim=-1, keepdim=True).clamp(max=v - 1)
        )  # first prefix reaching it
        kept &= ~p_on.unsqueeze(1) | (gap <= sorted_gap.gather(1, first))
    return gap, kept, greedy


def sample_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """[N] int64: one token per row drawn from `kept_probs_torch` by inverse CDF, with one uniform
    per row from a `torch.Generator` seeded with (a mix of) the row's seed."""
    probs = kept_probs_torch(logits, temperature, top_k, top_p, min_p)
    n, v = probs.shape
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    u = torch.empty(n, device=probs.device)
    for i, seed in enumerate(
        seeds.tolist()
    ):  # one generator per row: the draw depends on its seed only
        gen = torch.Generator(device=probs.device).manual_seed(_mix_seed(int(seed)))
        u[i] = torch.rand(1, generator=gen, device=probs.device)[0]
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u * total < total, so the column found has cdf[j-1] <= target < cdf[j], i.e. probs[j] > 0.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    col = torch.searchsorted(cdf, target, right=True).clamp_(max=v - 1)
    bad = probs.gather(1, col) == 0  # only if rounding defeated the argument above
    col = torch.where(bad, probs.argmax(dim=-1, keepdim=True), col)
    return col.squeeze(1)


def _mix_seed(seed: int) -> int:
    """All 64 bits of a seed, mixed (SplitMix64's finalizer): torch's CPU generator keeps only the
    low 32 bits of its seed, so seeds differing only above them would otherwise draw alike."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------
#
# One program per row, several passes over the row in chunks, no sort:
#   1. max logit M, its first index (greedy) and the smallest finite logit;
#   2. the kept set's threshold as an int32 key: the bit pattern of a gap w >= 0, which orders
#      like w itself. Each search pass counts the tokens (and their mass exp(-w)) at or below
#      16 pivots spread over the candidate key range and keeps the sub-range where the condition
#      (count >= k, or mass >= top_p x total) first holds, snapped to the keys present; it stops
#      when that range holds a single key or a single token, so the threshold is exact: tokens at
#      or below it are kept, ties included.
#      Top-k searches first, then top-p within what top-k kept;
#   3. the draw: argmax over kept tokens of -w - log(E), E = -log(U) exponential with U from
#      Philox(seed, token index) -- an exponential race, no normalization or cumulative sum.
# Gaps are recomputed from the logits in every pass with the same IEEE operations, so all passes
# see the very same w (and keys) per token.


@triton.jit
def _row_max(row_ptr, V, BLOCK: tl.constexpr):
    """(max logit, first index of it, smallest finite logit) of one row."""
    offs = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_arg = offs
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        better = x > lane_max  # strict: a lane keeps the first index of its maximum
        lane_max = tl.where(better, x, lane_max)
        lane_arg = tl.where(better, idx, lane_arg)
        lane_min = tl.minimum(lane_min, tl.where(x > float("-inf"), x, float("inf")))
    best = tl.max(lane_max, axis=0)
    arg = tl.min(tl.where(lane_max == best, lane_arg, 2147483647), axis=0)
    return best, arg, tl.min(lane_min, axis=0)


@triton.jit
def _threshold(
    row_ptr,
    V,
    best,
    temp,
    hi,
    k,
    p,
    BY_MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    NPIV: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
):
    """A key K <= hi whose kept set {key <= K} is that of the smallest key where the tokens at or
    below it number >= k (BY_MASS false) or hold >= p x the mass of those at or below hi (BY_MASS
    true, and at least one token); if even hi falls short of k (top-k keeps everything), a key
    keeping the same set as hi.

    Invariant: the condition fails at lo (-1 at first: no token) and holds at hi. A pass counts
    the tokens, and their mass exp(-w), at or below NPIV pivots in (lo, hi], the last being hi,
    keeps the sub-range ending at the first pivot where the condition holds, and snaps its ends to
    the keys present. The first passes space the pivots evenly in gap value (fast on real logits),
    later ones evenly in key (at most ~8 passes for 31 bits); every pass strictly shrinks (lo, hi]
    and the search ends when it holds a single key or a single token."""
    jj = tl.arange(0, NPIV)
    offs = tl.arange(0, BLOCK)
    frac = (jj + 1).to(tl.float32) / NPIV
    last = jj == NPIV - 1
    lo = hi * 0 - 1
    cnt_lo = k * 0
    cnt_hi = k * 0 + 2147483647
    target = p * 0.0 - 1.0
    passes = k * 0
    go = hi >= 0
    while go:
        if (passes < VALUE_PASSES) & (hi - lo >= NPIV):
            # evenly spaced gap values, clamped so that the first pivot is above lo and all but
            # the last below hi (each pass then shrinks the range)
            lo_val = tl.where(lo >= 0, lo, 0).to(tl.float32, bitcast=True)
            hi_val = hi.to(tl.float32, bitcast=True)
            piv = (lo_val + (hi_val - lo_val) * frac).to(tl.int32, bitcast=True)
            piv = tl.where(last, hi, tl.minimum(tl.maximum(piv, lo + 1 + jj), hi - (NPIV - 1) + jj))
        else:
            piv = lo + (((hi - lo).to(tl.int64) * (jj + 1)) // NPIV).to(
                tl.int32
            )  # evenly spaced keys

        # Counts and masses per (lane, pivot), summed over the lanes once after the row; and the
        # smallest and largest key present in (lo, hi].
        cnt2 = tl.zeros([BLOCK, NPIV], tl.int32)
        mass2 = tl.zeros([BLOCK, NPIV], tl.float32)
        kmin = tl.full([BLOCK], 2147483647, tl.int32)
        kmax = tl.full([BLOCK], -1, tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            w = tl.div_rn(best - x, temp)  # -inf logits and padding: w = inf, key above every pivot
            key = w.to(tl.int32, bitcast=True)
            below = key[:, None] <= piv[None, :]
            cnt2 += below.to(tl.int32)
            mass2 += tl.where(below, tl.exp(-w)[:, None], 0.0)
            inside = (key > lo) & (key <= hi)
            kmin = tl.minimum(kmin, tl.where(inside, key, 2147483647))
            kmax = tl.maximum(kmax, tl.where(inside, key, -1))
        cnt = tl.sum(cnt2, axis=0)
        mass = tl.sum(mass2, axis=0)

        if BY_MASS:
            if target < 0:  # the first pass: the total is the mass at hi, the last pivot
                target = p * tl.sum(tl.where(last, mass, 0.0), axis=0)
            ok = (mass >= target) & (cnt > 0)  # at least one token, also when top_p is 0
        else:
            ok = cnt >= k
        # The condition is monotone in the pivot: the first pivot where it holds is the new hi,
        # the one before it the new lo (none holding, top-k above the count, leaves lo = hi).
        # Key and count travel packed in one int64 (key high), so one reduction finds both.
        packed = (piv.to(tl.int64) << 32) | cnt.to(tl.int64)
        hi_pk = tl.min(tl.where(ok, packed, (hi.to(tl.int64) << 32) | cnt_hi.to(tl.int64)), axis=0)
        lo_pk = tl.max(tl.where(ok, (lo.to(tl.int64) << 32) | cnt_lo.to(tl.int64), packed), axis=0)
        cnt_hi = (hi_pk & 0x7FFFFFFF).to(tl.int32)
        cnt_lo = (lo_pk & 0x7FFFFFFF).to(tl.int32)
        # No token has a key in (lo, kmin) or (kmax, hi]: snapping to them keeps both sets (and
        # ends the search at once when the range holds a single, tied, key).
        hi = tl.minimum((hi_pk >> 32).to(tl.int32), tl.max(kmax, axis=0))
        lo = tl.maximum((lo_pk >> 32).to(tl.int32), tl.min(kmin, axis=0) - 1)
        passes += 1
        # Exact once (lo, hi] holds one key or one token; for top-k also once exactly k are kept.
        go = (hi - lo > 1) & (cnt_hi - cnt_lo > 1)
        if not BY_MASS:
            go = go & (cnt_hi != k)
    return hi


@triton.jit
def _race(row_ptr, V, best, temp, hi, seed, BLOCK: tl.constexpr):
    """Index of the kept token (key <= hi) with the largest -w - log(E), E ~ Exp(1) from
    Philox(seed, index); -1 if no kept token got a finite score."""
    offs = tl.arange(0, BLOCK)
    lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_arg = tl.full([BLOCK], -1, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        w = tl.div_rn(best - x, temp)
        key = w.to(tl.int32, bitcast=True)
        u = tl.rand(seed, idx)  # [0, 1): u = 0 gives E = inf, a score of -inf
        score = tl.where(key <= hi, -w - tl.log(-tl.log(u)), float("-inf"))
        better = score > lane_best
        lane_best = tl.where(better, score, lane_best)
        lane_arg = tl.where(better, idx, lane_arg)
    top = tl.max(lane_best, axis=0)
    arg = tl.min(tl.where((lane_best == top) & (lane_arg >= 0), lane_arg, 2147483647), axis=0)
    return tl.where(top > float("-inf"), arg, -1)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    out_ptr,
    gap_ptr,
    V,
    BLOCK: tl.constexpr,
    PBLOCK: tl.constexpr,
    NPIV: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    STORE_GAP: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temp = tl.load(temp_ptr + row)
    best, arg, least = _row_max(row_ptr, V, BLOCK)
    token = arg
    hi = arg * 0 - 1  # the largest kept gap's key; -1 (a NaN as float) on greedy rows
    if (temp > 0) & (best > float("-inf")):
        k = tl.load(top_k_ptr + row)
        p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        seed = tl.load(seed_ptr + row)
        # Min-p as a gap: w <= -log(min_p); capped at the largest finite gap of the row, so the
        # initial key range [0, hi] holds exactly the finite tokens min-p keeps.
        cut = tl.where(min_p > 0, -tl.log(tl.where(min_p > 0, min_p, 1.0)), float("inf"))
        widest = tl.div_rn(best - least, temp)  # the same operation as each token's gap
        hi = tl.minimum(tl.minimum(cut, widest), 3.4028234663852886e38).to(tl.int32, bitcast=True)
        hi = tl.maximum(hi, 0)  # a negative cut (or -0.0) keeps only w == 0
        if (k > 0) & (k < V):
            hi = _threshold(row_ptr, V, best, temp, hi, k, p, False, PBLOCK, NPIV, VALUE_PASSES)
        if p < 1:
            hi = _threshold(row_ptr, V, best, temp, hi, k, p, True, PBLOCK, NPIV, VALUE_PASSES)
        drawn = _race(row_ptr, V, best, temp, hi, seed, BLOCK)
        token = tl.where(drawn >= 0, drawn, arg)  # the best token is always kept
    tl.store(out_ptr + row, token.to(tl.int64))
    if STORE_GAP:
        tl.store(gap_ptr + row, hi.to(tl.float32, bitcast=True))


def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """[N] int64: one token per row, drawn by the Triton kernel (same semantics as sample_torch)."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    _sample_into(out, logits, temperature, top_k, top_p, min_p, seeds)
    return out


def _sample_into(
    out: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    max_gap: torch.Tensor | None = None,
) -> None:
    """Launch the kernel writing every row's token into `out` ([N] int64) and, if given, into
    `max_gap` ([N] float32, for tests) the threshold it found: the row kept exactly the finite
    gaps <= it (NaN on greedy rows)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, v = logits.shape
    if out.shape != (n,) or out.dtype != torch.long or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{n}] int64 tensor")
    if n == 0:
        return
    if v == 0 or v >= 2**31 - 1:
        raise ValueError(f"vocabulary size {v} out of range")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        logits = logits.float()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device

    def per_row(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.shape != (n,):
            raise ValueError(f"expected a [{n}] tensor, got shape {tuple(t.shape)}")
        return t.to(device=device, dtype=dtype).contiguous()

    block = min(triton.next_power_of_2(v), _BLOCK_MAX)
    pblock = min(block, _PIVOT_BLOCK_MAX)
    _sample_kernel[(n,)](
        logits,
        logits.stride(0),
        per_row(temperature, torch.float32),
        per_row(top_k.clamp(-1, v), torch.int32),
        per_row(top_p, torch.float32),
        per_row(min_p, torch.float32),
        per_row(seeds, torch.int64),
        out,
        out if max_gap is None else max_gap,
        v,
        BLOCK=block,
        PBLOCK=pblock,
        NPIV=_NUM_PIVOTS,
        VALUE_PASSES=_VALUE_PASSES,
        STORE_GAP=max_gap is not None,
        num_warps=8 if block >= 1024 else 4,
    )
