"""The torch family's draw (`KernelOps.draw`, the sampler's default): min-p, top-k, then top-p
over what is left (renormalized), then one draw by inverse CDF at the uniform number of the row's
random word. Rows with top-k or top-p work on a few candidates from torch.topk instead of sorting
the vocabulary."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sluice.engine.draws import uniform
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.softmax_math import TORCH_SOFTMAX, SoftmaxMath

# Top-p without top-k first looks at this many most likely tokens; rows whose nucleus is wider
# (a flat distribution) are redone over the whole vocabulary.
_TOP_P_CANDIDATES = 512


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row numbers as an index tensor."""
    return torch.tensor(rows, dtype=torch.long, device=device)


def kept_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[N, V] bool: the tokens each row may draw after min-p, top-k and top-p (for tests/debugging).
    `logits` are taken as already penalized and divided by the temperature."""
    kept = torch.zeros_like(logits, dtype=torch.bool)
    narrow = [i for i, p in enumerate(params) if _narrows(p, logits.shape[1])]
    wide = [i for i, p in enumerate(params) if not _narrows(p, logits.shape[1])]
    if narrow:
        rows = row_index(narrow, logits.device)
        vals, idx = _candidates(logits[rows], [params[i] for i in narrow])
        hits = torch.zeros(len(narrow), logits.shape[1], device=logits.device)
        kept[rows] = (
            hits.scatter_add_(1, idx, torch.isfinite(vals).float()) > 0
        )  # idx may repeat padding
    if wide:
        rows = row_index(wide, logits.device)
        kept[rows] = torch.isfinite(_min_p(logits[rows], [params[i] for i in wide]))
    return kept


def _narrows(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1


def draw_torch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    words: Sequence[int],
    softmax: SoftmaxMath = TORCH_SOFTMAX,
) -> torch.Tensor:
    """One token per row from the truncated softmax of `logits` (not modified), by inverse CDF at
    the uniform number of the row's random word; `softmax` does the softmax arithmetic."""
    device = logits.device
    u = torch.tensor([uniform(w) for w in words], dtype=torch.float32, device=device)
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    narrow = [i for i, p in enumerate(params) if _narrows(p, logits.shape[1])]
    wide = [i for i, p in enumerate(params) if not _narrows(p, logits.shape[1])]
    if narrow:  # sample among the candidates only
        rows = row_index(narrow, device)
        vals, idx = _candidates(
            logits[rows] if len(narrow) < len(params) else logits,
            [params[i] for i in narrow],
            softmax,
        )
        tokens[rows] = idx.gather(1, _inverse_cdf(vals, u[rows], softmax).unsqueeze(1)).squeeze(1)
    if wide:
        rows = row_index(wide, device)
        sub = logits[rows] if len(wide) < len(params) else logits
        tokens[rows] = _inverse_cdf(_min_p(sub, [params[i] for i in wide]), u[rows], softmax)
    return tokens


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor, softmax: SoftmaxMath) -> torch.Tensor:
    """Column drawn per row from softmax(logits) (-inf = never), given one uniform per row."""
    probs = softmax.softmax(logits)
    cdf = softmax.cumsum(probs)
    total = cdf[:, -1:]
    # u * total < total, so the column found has cdf[j-1] <= target < cdf[j], i.e. probs[j] > 0.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    col = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[1] - 1)
    bad = probs.gather(1, col) == 0  # only if rounding defeated the argument above
    if bad.any():
        col = torch.where(bad, probs.argmax(dim=-1, keepdim=True), col)
    return col.squeeze(1)


def _min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Logits with tokens below min_p x the best one's probability set to -inf (a new tensor)."""
    if not any(p.min_p > 0 for p in params):
        return logits
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed.
    log_min_p = torch.tensor(
        [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=logits.device
    )
    floor = logits.max(dim=-1, keepdim=True).values + log_min_p.unsqueeze(1)
    return logits.masked_fill(logits < floor, -math.inf)


def _candidates(
    logits: torch.Tensor, params: Sequence[SamplingParams], softmax: SoftmaxMath = TORCH_SOFTMAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows with top-k and/or top-p: (logits, token ids) of the best candidates, best first,
    with -inf where min-p, top-k or top-p drops a candidate."""
    vocab = logits.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    width = min(vocab, max(max(ks), 0 if all(ks) else _TOP_P_CANDIDATES))
    vals, idx, short = _top_k_top_p(logits, params, ks, width, softmax)
    if short:  # nucleus wider than the candidates: redo those rows over the whole vocabulary
        rows = row_index(short, logits.device)
        full_vals, full_idx, _ = _top_k_top_p(
            logits[rows], [params[i] for i in short], [ks[i] for i in short], vocab, softmax
        )
        pad = vocab - width
        vals = torch.nn.functional.pad(vals, (0, pad), value=-math.inf)
        idx = torch.nn.functional.pad(idx, (0, pad), value=0)
        vals[rows], idx[rows] = full_vals, full_idx
    return vals, idx


def _top_k_top_p(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    ks: list[int],
    width: int,
    softmax: SoftmaxMath,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Min-p, top-k (k=0: none), then top-p, over each row's `width` best tokens. Also returns the
    rows without top-k whose top-p set might reach past those."""
    device = logits.device
    vals, idx = logits.topk(width, dim=-1, sorted=True)
    pos = torch.arange(width, device=device)
    has_k = torch.tensor([k > 0 for k in ks], device=device)
    k_eff = torch.tensor([k or width for k in ks], device=device)
    vals = vals.masked_fill(pos >= k_eff.unsqueeze(1), -math.inf)
    min_p = [p.min_p for p in params]
    if any(min_p):
        log_min_p = torch.tensor(
            [math.log(m) if m > 0 else -math.inf for m in min_p], device=device
        )
        vals = vals.masked_fill(vals < (vals[:, :1] + log_min_p.unsqueeze(1)), -math.inf)

    short: list[int] = []
    top_p = [p.top_p for p in params]
    if any(p < 1 for p in top_p):
        # Mass is measured over what min-p and top-k left: the candidates if top-k cut the row,
        # else the whole row (its best `width` tokens may not hold all of it).
        norm = softmax.logsumexp(vals)
        no_k = [i for i, k in enumerate(ks) if not k and top_p[i] < 1]
        if no_k and width < logits.shape[1]:
            rows = row_index(no_k, device)
            norm[rows] = softmax.logsumexp(_min_p(logits[rows], [params[i] for i in no_k]))
        probs = softmax.exp_shifted(vals, norm)
        mass = softmax.cumsum(probs)
        before = mass - probs  # mass of the better candidates
        # top_p == 1 must keep everything, whatever rounding does to the running sum.
        limit = torch.tensor([p if p < 1 else math.inf for p in top_p], device=device).unsqueeze(1)
        vals = vals.masked_fill(before >= limit, -math.inf)
        if width < logits.shape[1]:
            short = ((~has_k) & (mass[:, -1] < limit.squeeze(1))).nonzero().flatten().tolist()
    return vals, idx, short
