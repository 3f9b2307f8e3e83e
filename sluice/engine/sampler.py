"""Choose the next token of every sequence in a batch from its logits.

Per row, in this order (as vLLM v1):
  1. penalties: repetition (over prompt + output, HF/CTRL style: a positive logit is divided by the
     penalty, a negative one multiplied), then frequency and presence (over the output only, OpenAI
     style: minus frequency x count, minus presence once);
  2. temperature; a row with temperature 0 takes the argmax here and skips the rest;
  3. min-p, top-k, then top-p over what is left (renormalized);
  4. one draw from what is left, by inverse CDF with one uniform number per row.

Logprobs are the log-softmax of the logits after step 2 (penalties and temperature applied, no
truncation; a greedy row counts as temperature 1), so the chosen token and every alternative get a
finite value. This is vLLM's "processed" distribution before truncation.

Each sampled row comes with its own random word (`draws.draw_word` of its seed, completion and
position), so a row's token never depends on the rows beside it, on earlier draws or on the
process. Everything else runs on the whole batch at once. Rows with top-k or
top-p work on a few candidates from torch.topk instead of sorting the vocabulary; penalties touch
only the tokens a sequence contains.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from sluice.engine.draws import uniform
from sluice.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sluice.engine.kernel_ops import KernelOps

# Top-p without top-k first looks at this many most likely tokens; rows whose nucleus is wider
# (a flat distribution) are redone over the whole vocabulary.
_TOP_P_CANDIDATES = 512


@dataclass
class TokenLogprobs:
    token_id: int  # the chosen token
    logprob: float  # its log-probability
    rank: int  # 1 = it was the most likely token
    top: list[
        tuple[int, float]
    ]  # the `logprobs` most likely (token id, logprob), most likely first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class Sampler:
    def __init__(self, ops: KernelOps | None = None):
        """ops: the kernel family whose `draw` picks the sampled rows' tokens (min-p, top-k, top-p,
        one draw; default `draw_torch`); penalties, temperature, greedy rows and logprobs stay
        here."""
        self.ops = ops

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Sequence,
        params: Sequence[SamplingParams],
        words: Sequence[int | None],
        *,
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """logits: [N, V], rows in the order of `seqs`; a seq needs `token_ids` (prompt + output)
        and `num_prompt_tokens`. words: each row's 64-bit random word (`draws.draw_word`); None
        for greedy rows, which draw nothing. allowed: (rows, float32 [len(rows), V]), added to
        those rows after penalties and temperature: -inf on the tokens their response format
        excludes, 0 elsewhere (`structured.py`). `logits` is not modified."""
        n = logits.shape[0]
        if not (len(seqs) == len(params) == len(words) == n):
            raise ValueError(
                f"{n} logit rows but {len(seqs)} seqs, {len(params)} params, {len(words)} words"
            )
        if n == 0:
            return SamplerOutput([], [])
        device = logits.device
        x = logits.float()
        if any(
            p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params
        ):
            x = x.clone()
            apply_penalties(x, seqs, params)
        if any(p.temperature not in (0, 1) for p in params):
            x = x / torch.tensor([p.temperature or 1.0 for p in params], device=device).unsqueeze(1)
        if allowed is not None:
            guided, bias = allowed
            bias = bias.to(device)
            if len(guided) == n:
                x = x + bias
            else:
                if x is logits:
                    x = x.clone()
                x[_index(guided, device)] += bias

        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        if len(greedy) == n:
            tokens = _row_argmax(x)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=device)
            if greedy:
                rows = _index(greedy, device)
                tokens[rows] = _row_argmax(x[rows])
            drawn = [i for i, p in enumerate(params) if p.temperature != 0]
            rows = _index(drawn, device)
            sub = x if len(drawn) == n else x[rows]
            draw = self.ops.draw if self.ops is not None else draw_torch
            row_words = [w for w in (words[i] for i in drawn) if w is not None]
            if len(row_words) != len(drawn):
                raise ValueError("a sampled row needs its random word")
            tokens[rows] = draw(sub, [params[i] for i in drawn], row_words)

        logprobs: list[TokenLogprobs | None] = [None] * n
        if any(p.logprobs is not None for p in params):
            _fill_logprobs(logprobs, x, tokens, params)
        return SamplerOutput(tokens.tolist(), logprobs)


def _row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum (a NaN counts as the maximum), int64 [N]. On the CPU
    numpy's vectorized argmax: ~4 us for one row of 49,152 against ~43 for torch's max().indices
    (itself 2.5x faster than torch's argmax over 64 such rows)."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return x.max(dim=-1).indices


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, seqs: Sequence, params: Sequence[SamplingParams]) -> None:
    """Penalize, in place, the tokens each sequence already holds. Cost: the tokens, not the vocab.

    A token repeated in a sequence appears several times in the index; where a penalty applies once
    per distinct token, every copy writes the same value, computed from the logits read before."""
    device = logits.device

    def pairs(rows: list[int], lists: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token id) for every token of every list, rows given as indices into `logits`."""
        ids = torch.tensor(
            list(itertools.chain.from_iterable(lists)), dtype=torch.long, device=device
        )
        lens = torch.tensor([len(t) for t in lists], device=device)
        return torch.repeat_interleave(_index(rows, device), lens), ids

    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if rep:
        r, t = pairs(rep, [seqs[i].token_ids for i in rep])
        if len(r):
            penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[r]
            v = logits[r, t]
            logits[r, t] = torch.where(v > 0, v / penalty, v * penalty)

    pf = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if pf:
        r, t = pairs(pf, [seqs[i].token_ids[seqs[i].num_prompt_tokens :] for i in pf])
        if len(r):
            freq = torch.tensor([p.frequency_penalty for p in params], device=device)
            pres = torch.tensor([p.presence_penalty for p in params], device=device)
            logits.index_put_((r, t), -freq[r], accumulate=True)  # once per occurrence
            logits[r, t] = logits[r, t] - pres[r]  # once per distinct token


def kept_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[N, V] bool: the tokens each row may draw after min-p, top-k and top-p (for tests/debugging).
    `logits` are taken as already penalized and divided by the temperature."""
    kept = torch.zeros_like(logits, dtype=torch.bool)
    narrow = [i for i, p in enumerate(params) if _narrows(p, logits.shape[1])]
    wide = [i for i, p in enumerate(params) if not _narrows(p, logits.shape[1])]
    if narrow:
        rows = _index(narrow, logits.device)
        vals, idx = _candidates(logits[rows], [params[i] for i in narrow])
        hits = torch.zeros(len(narrow), logits.shape[1], device=logits.device)
        kept[rows] = (
            hits.scatter_add_(1, idx, torch.isfinite(vals).float()) > 0
        )  # idx may repeat padding
    if wide:
        rows = _index(wide, logits.device)
        kept[rows] = torch.isfinite(_min_p(logits[rows], [params[i] for i in wide]))
    return kept


def _narrows(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1


def draw_torch(
    logits: torch.Tensor, params: Sequence[SamplingParams], words: Sequence[int]
) -> torch.Tensor:
    """One token per row from the truncated softmax of `logits` (not modified), by inverse CDF at
    the uniform number of the row's random word."""
    device = logits.device
    u = torch.tensor([uniform(w) for w in words], dtype=torch.float32, device=device)
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    narrow = [i for i, p in enumerate(params) if _narrows(p, logits.shape[1])]
    wide = [i for i, p in enumerate(params) if not _narrows(p, logits.shape[1])]
    if narrow:  # sample among the candidates only
        rows = _index(narrow, device)
        vals, idx = _candidates(
            logits[rows] if len(narrow) < len(params) else logits, [params[i] for i in narrow]
        )
        tokens[rows] = idx.gather(1, _inverse_cdf(vals, u[rows]).unsqueeze(1)).squeeze(1)
    if wide:
        rows = _index(wide, device)
        sub = logits[rows] if len(wide) < len(params) else logits
        tokens[rows] = _inverse_cdf(_min_p(sub, [params[i] for i in wide]), u[rows])
    return tokens


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column drawn per row from softmax(logits) (-inf = never), given one uniform per row."""
    probs = torch.softmax(logits, dim=-1)
    cdf = probs.cumsum(dim=-1)
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
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows with top-k and/or top-p: (logits, token ids) of the best candidates, best first,
    with -inf where min-p, top-k or top-p drops a candidate."""
    vocab = logits.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    width = min(vocab, max(max(ks), 0 if all(ks) else _TOP_P_CANDIDATES))
    vals, idx, short = _top_k_top_p(logits, params, ks, width)
    if short:  # nucleus wider than the candidates: redo those rows over the whole vocabulary
        rows = _index(short, logits.device)
        full_vals, full_idx, _ = _top_k_top_p(
            logits[rows], [params[i] for i in short], [ks[i] for i in short], vocab
        )
        pad = vocab - width
        vals = torch.nn.functional.pad(vals, (0, pad), value=-math.inf)
        idx = torch.nn.functional.pad(idx, (0, pad), value=0)
        vals[rows], idx[rows] = full_vals, full_idx
    return vals, idx


def _top_k_top_p(
    logits: torch.Tensor, params: Sequence[SamplingParams], ks: list[int], width: int
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
        norm = vals.logsumexp(dim=-1)
        no_k = [i for i, k in enumerate(ks) if not k and top_p[i] < 1]
        if no_k and width < logits.shape[1]:
            rows = _index(no_k, device)
            norm[rows] = _min_p(logits[rows], [params[i] for i in no_k]).logsumexp(dim=-1)
        probs = (vals - norm.unsqueeze(1)).exp()
        before = probs.cumsum(dim=-1) - probs  # mass of the better candidates
        # top_p == 1 must keep everything, whatever rounding does to the running sum.
        limit = torch.tensor([p if p < 1 else math.inf for p in top_p], device=device).unsqueeze(1)
        vals = vals.masked_fill(before >= limit, -math.inf)
        if width < logits.shape[1]:
            short = ((~has_k) & (probs.sum(dim=-1) < limit.squeeze(1))).nonzero().flatten().tolist()
    return vals, idx, short


def _fill_logprobs(
    out: list[TokenLogprobs | None],
    logits: torch.Tensor,
    tokens: torch.Tensor,
    params: Sequence[SamplingParams],
) -> None:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    index = _index(rows, logits.device)
    lp = torch.log_softmax(logits[index], dim=-1)
    chosen_ids = tokens[index]
    chosen = lp.gather(1, chosen_ids.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=-1, dtype=torch.int32) + 1
    k = max(params[i].logprobs or 0 for i in rows)
    if k:
        top = lp.topk(k, dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    else:
        top_v = top_i = [[] for _ in rows]
    for j, (i, tok, c, r) in enumerate(
        zip(rows, chosen_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist())
    ):
        kk = params[i].logprobs
        out[i] = TokenLogprobs(tok, c, r, list(zip(top_i[j][:kk], top_v[j][:kk])))
