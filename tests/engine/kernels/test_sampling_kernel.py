"""Sampling kernel: Triton (interpreted on the CPU) and torch draws against the reference
distribution.

The Triton interpreter runs every program instance in Python (10-30 ms a row here), so the kernel
gets a few hundred draws where the torch sampler gets thousands, and vocabularies stay small. To
make up for it, every kernel launch of these tests also reads back the threshold the kernel found
and checks that the set it keeps is exactly the reference's kept set.
"""

from __future__ import annotations

import math

import pytest
import torch

from sluice.engine.kernels import sampling
from sluice.engine.kernels.sampling import kept_probs_torch, sample_torch, sample_triton

SAMPLERS = {"triton": sample_triton, "torch": sample_torch}
INF = math.inf


def rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Per-row parameter tensors, every row alike."""
    return (
        torch.full((n,), float(temperature)),
        torch.full((n,), int(top_k), dtype=torch.int32),
        torch.full((n,), float(top_p)),
        torch.full((n,), float(min_p)),
    )


def stack_params(configs):
    """Per-row parameter tensors from a list of (temperature, top_k, top_p, min_p)."""
    t, k, p, m = zip(*configs)
    return (
        torch.tensor(t, dtype=torch.float32),
        torch.tensor(k, dtype=torch.int32),
        torch.tensor(p, dtype=torch.float32),
        torch.tensor(m, dtype=torch.float32),
    )


def draw(name, logits, params, seeds):
    """Tokens from one launch of the named sampler; for the kernel, also check that it wrote every
    row and that its kept set is exactly the reference's (greedy rows: no threshold, NaN)."""
    if name == "torch":
        return sample_torch(logits, *params, seeds)
    n = logits.shape[0]
    out = torch.full((n,), -5, dtype=torch.long)
    max_gap = torch.full((n,), -7.0)
    sampling._sample_into(out, logits, *params, seeds, max_gap=max_gap)
    assert ((out >= 0) & (out < logits.shape[1])).all()
    gap, kept_ref, greedy = sampling.kept_set_torch(logits, *params)
    greedy = greedy.squeeze(1)
    assert torch.isnan(max_gap[greedy]).all() and (max_gap[~greedy] >= 0).all()
    kept = (gap <= max_gap.unsqueeze(1)) & (gap < INF)  # what the kernel kept; NaN: nothing
    wrong = (kept != kept_ref).any(dim=1).nonzero().flatten().tolist()
    assert not wrong, (
        f"rows {wrong[:5]}: kernel kept {kept[wrong[0]].nonzero().flatten().tolist()}, "
        f"reference {kept_ref[wrong[0]].nonzero().flatten().tolist()}"
    )
    return out


def random_seeds(n, seed=0):
    """Distinct seeds over the whole int64 range, negative ones included."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.long)
    assert s.unique().numel() == n
    return s


# ---------------------------------------------------------------------------------------------
# An independent float64 reference: one row at a time, by sorting, on z = logit / T.
# ---------------------------------------------------------------------------------------------


def kept_probs_f64(logits, temperature, top_k, top_p, min_p):
    n, v = logits.shape
    out = torch.zeros(n, v, dtype=torch.float64)
    for r in range(n):
        x = logits[r].double()
        t, k, p, mp = float(temperature[r]), int(top_k[r]), float(top_p[r]), float(min_p[r])
        if not t > 0 or not torch.isfinite(x).any():
            out[r, int(torch.argmax(x))] = 1.0  # greedy; torch.argmax takes the first maximum
            continue
        z = x / t
        prob = torch.softmax(z, dim=0)
        order = sorted((i for i in range(v) if math.isfinite(z[i])), key=lambda i: -z[i].item())
        keep = order
        if mp > 0:
            keep = [i for i in keep if prob[i] >= mp * prob[order[0]]]
        if 0 < k < len(keep):
            kth = z[keep[k - 1]]
            keep = [i for i in keep if z[i] >= kth]  # ties with the k-th are kept
        if p < 1:
            total = sum(prob[i].item() for i in keep)
            mass = 0.0
            for i in keep:
                mass += prob[i].item()
                if mass >= p * total:
                    threshold = z[i]
                    break
            keep = [i for i in keep if z[i] >= threshold]  # ties with the last one are kept
        idx = torch.tensor(keep)
        out[r, idx] = prob[idx] / prob[idx].sum()
    return out


def chi_square_pvalue(tokens, probs):
    """Goodness of fit of draws to a distribution over token ids; bins with an expected count
    below 5 are merged, smallest first. Fails at once on a draw of a zero-probability token."""
    probs = probs.double()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    outside = counts[probs == 0].sum().item()
    assert outside == 0, f"{outside} draws of tokens outside the kept set"
    expected = probs * tokens.numel()
    order = torch.argsort(expected)
    order = order[expected[order] > 0]
    bins_o, bins_e, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():
        acc_o += counts[i].item()
        acc_e += expected[i].item()
        if acc_e >= 5:
            bins_o.append(acc_o)
            bins_e.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:  # the rest joins the last full bin
        if bins_e:
            bins_o[-1] += acc_o
            bins_e[-1] += acc_e
        else:
            bins_o, bins_e = [acc_o], [acc_e]
    if len(bins_e) < 2:
        return 1.0
    o, e = torch.tensor(bins_o, dtype=torch.float64), torch.tensor(bins_e, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    df = len(bins_e) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


def assert_margins(logits, configs, margin=5e-5):
    """Top-p and min-p values must not sit on a boundary of the data (where float32 rounding
    could legitimately tip a token in or out): a precondition of the tests, not of the code."""
    for r, (t, k, p, mp) in enumerate(configs):
        if not t > 0:
            continue
        x = logits[r].double() / t
        prob = torch.softmax(x, dim=0)
        ratios = prob / prob.max()
        if mp > 0:
            assert (ratios - mp).abs().min() > 1e-4 * mp, f"row {r}: min_p {mp} on a token's ratio"
        if p < 1:
            keep = prob * (ratios >= mp)
            if 0 < k < int((keep > 0).sum()):
                keep = keep * (x >= x[keep > 0].sort(descending=True).values[k - 1])
            # mass of each tie group and everything better, as a fraction of the kept mass
            values = x[keep > 0].unique()
            cum = torch.stack([keep[x >= val].sum() for val in values]) / keep.sum()
            assert (cum - p).abs().min() > margin, f"row {r}: top_p {p} on a cumulative mass"


# ---------------------------------------------------------------------------------------------
# (5) the torch reference against the float64 one
# ---------------------------------------------------------------------------------------------


def reference_cases():
    g = torch.Generator().manual_seed(5)
    v = 97  # not a power of two
    configs = []
    for t in (0.35, 1.0, 1.7):
        for k in (0, 1, 5, 40, 97, 500, -1):
            for p, mp in ((1.0, 0.0), (0.87, 0.0), (0.5, 0.02), (1.0, 0.2), (0.07, 0.0)):
                configs.append((t, k, p, mp))
    configs += [(0.0, 5, 0.5, 0.1), (1e-30, 0, 1.0, 0.0), (1e-30, 3, 0.9, 0.0)]
    n = len(configs)
    logits = torch.randn(n, v, generator=g) * 2.5
    # some rows with ties (integer logits) and masked (-inf) tokens
    ties = torch.randint(-3, 4, (n, v), generator=g).float()
    logits = torch.where(torch.arange(n).unsqueeze(1) % 3 == 1, ties, logits)
    logits[torch.rand(n, v, generator=g) < 0.15] = -INF
    return logits, configs


def test_kept_probs_matches_float64_reference():
    logits, configs = reference_cases()
    assert_margins(logits, configs)
    params = stack_params(configs)
    ref32 = kept_probs_torch(logits, *params)
    ref64 = kept_probs_f64(logits, *params)
    assert ref32.dtype == torch.float32 and ref32.shape == logits.shape
    assert torch.isfinite(ref32).all()
    torch.testing.assert_close(ref32.sum(-1), torch.ones(len(configs)), rtol=0, atol=1e-5)
    torch.testing.assert_close(ref32.double(), ref64, rtol=1e-4, atol=1e-7)
    # the same kept sets: float32 keeps nothing float64 drops, and everything not underflowing
    assert not (ref32 > 0)[ref64 == 0].any()
    assert (ref32 > 0)[ref64 > 1e-30].all()
    # the filters did cut: many rows keep a strict subset of the finite tokens
    cut = ((ref64 > 0).sum(-1) < torch.isfinite(logits).sum(-1)).sum().item()
    assert cut > len(configs) // 2


def test_kept_probs_documented_ties_and_edges():
    flat = torch.zeros(1, 10)
    one = lambda *c: kept_probs_torch(flat, *stack_params([c]))[0]  # noqa: E731
    # a tie at the threshold keeps the whole tie: top-k 3 and top-p 0.2 of a flat row keep all 10
    torch.testing.assert_close(one(1.0, 3, 1.0, 0.0), torch.full((10,), 0.1))
    torch.testing.assert_close(one(1.0, 0, 0.2, 0.0), torch.full((10,), 0.1))
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, -INF, 0.0]])
    kept = lambda *c: (kept_probs_torch(x, *stack_params([c]))[0] > 0).nonzero().flatten().tolist()  # noqa: E731
    assert kept(1.0, 1, 1.0, 0.0) == [1, 2]  # the two best are tied
    assert kept(1.0, 3, 1.0, 0.0) == [1, 2, 3]
    assert kept(1.0, 0, 1.0, 0.0) == [0, 1, 2, 3, 5]  # -inf is never kept
    assert kept(1.0, 0, 1.0, 0.3) == [1, 2, 3]  # e^-1 >= 0.3 > e^-2
    assert kept(1.0, 0, 1.0, 1.0) == [1, 2]  # min_p 1 keeps the best and its ties
    assert kept(1.0, 0, 0.0, 0.0) == [1, 2]  # top_p 0 too
    assert kept(0.0, 0, 1.0, 0.0) == [1]  # greedy: the first maximum
    assert kept(1e-30, 0, 1.0, 0.0) == [1, 2]  # near-zero temperature: the tied best, evenly
    allmasked = torch.full((1, 4), -INF)
    assert kept_probs_torch(allmasked, *rows(1)).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    # a prefix whose mass reaches top_p exactly ends the set: masses 1 + 0.5 + 0.5, top_p 0.5
    half = torch.tensor([[0.0, -math.log(2), -math.log(2)]])
    assert torch.exp(half).tolist() == [[1.0, 0.5, 0.5]]  # precondition: exact float32 masses
    params = stack_params([(1.0, 0, 0.5, 0.0)])
    assert (kept_probs_torch(half, *params)[0] > 0).tolist() == [True, False, False]
    assert draw("triton", half, params, random_seeds(1)).item() == 0  # the kernel keeps the same


# ---------------------------------------------------------------------------------------------
# (1) greedy rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLERS)
def test_greedy_rows_take_the_first_argmax(name):
    g = torch.Generator().manual_seed(1)
    n, v = 10, 300
    logits = torch.randn(n, v, generator=g)
    logits[1, [7, 250]] = 9.0  # a tie: the lowest index wins
    logits[2, :] = 0.5  # all tied
    logits[3, :200] = -INF  # masked tokens
    logits[4, :] = -INF  # nothing finite: token 0
    logits[5, 299] = 50.0  # the last token
    logits[6, 0] = 50.0
    before = logits.clone()
    configs = [(0.0, 0, 1.0, 0.0)] * 7 + [
        (0.0, 1, 0.1, 0.5),
        (-1.0, 3, 0.5, 0.0),
        (0.0, 0, 1.0, 0.9),
    ]
    tokens = SAMPLERS[name](logits, *stack_params(configs), random_seeds(n))
    assert tokens.dtype == torch.long and tokens.shape == (n,)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens[1:7].tolist() == [7, 0, 200 + logits[3, 200:].argmax().item(), 0, 299, 0]
    assert torch.equal(logits, before)  # the logits are not modified


def test_every_row_is_written():
    """The kernel writes each row of preallocated outputs, the public path gives the same."""
    g = torch.Generator().manual_seed(2)
    n, v = 9, 70
    logits = torch.randn(n, v, generator=g)
    configs = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.1),
        (1.3, 10, 0.9, 0.05),
        (0.0, 2, 0.5, 0.0),
        (1.0, 1, 1.0, 0.0),
        (2.0, 0, 0.3, 0.0),
    ]
    params, seeds = stack_params(configs), random_seeds(n)
    assert_margins(logits, configs)
    out = draw("triton", logits, params, seeds)  # into outputs poisoned with -5 and -7
    assert torch.equal(out, sample_triton(logits, *params, seeds))
    probs = kept_probs_torch(logits, *params)
    assert (probs[torch.arange(n), out] > 0).all()
    empty = torch.empty(0, v)
    for sampler in SAMPLERS.values():
        assert sampler(empty, *rows(0), torch.empty(0, dtype=torch.long)).shape == (0,)


# ---------------------------------------------------------------------------------------------
# (2) the draws follow the reference distribution (chi-square goodness of fit)
# ---------------------------------------------------------------------------------------------

CHI_COMBOS = {  # (temperature, top_k, top_p, min_p)
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_k": (1.0, 6, 1.0, 0.0),
    "top_p": (1.2, 0, 0.75, 0.0),
    "min_p": (0.9, 0, 1.0, 0.05),
    "combined": (1.3, 12, 0.85, 0.02),
}
DRAWS = {"triton": 100, "torch": 3000}


def chi_square_logits():
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(40, generator=g) * 2.5  # peaked enough for 100 draws to tell 2x temperature
    base[[3, 17]] = -INF
    return base


@pytest.mark.parametrize("name", SAMPLERS)
def test_draws_follow_the_kept_distribution(name):
    base = chi_square_logits()
    r = DRAWS[name]
    configs = [c for c in CHI_COMBOS.values() for _ in range(r)]
    logits = base.expand(len(configs), -1)  # stride 0 between rows: one row, many draws
    assert_margins(logits[::r], list(CHI_COMBOS.values()))
    params = stack_params(configs)
    tokens = draw(name, logits, params, random_seeds(len(configs), seed=7))  # one launch
    probs = kept_probs_torch(logits[::r], *stack_params(list(CHI_COMBOS.values())))
    for i, combo in enumerate(CHI_COMBOS):
        kept = int((probs[i] > 0).sum())
        assert 3 <= kept < 38 or combo == "temperature", (combo, kept)  # the filters do something
        pvalue = chi_square_pvalue(tokens[i * r : (i + 1) * r], probs[i])
        assert pvalue > 1e-3, f"{name} {combo}: chi-square p-value {pvalue:.2e}"


def test_chi_square_rejects_a_wrong_distribution():
    """The goodness-of-fit check has power: the torch draws at one temperature fail against the
    distribution at another, and draws ignoring top-k fail against the top-k distribution."""
    base = chi_square_logits()
    r = DRAWS["torch"]
    logits = base.expand(r, -1)
    tokens = sample_torch(logits, *rows(r, temperature=0.8), random_seeds(r, seed=8))
    wrong = kept_probs_torch(logits[:1], *rows(1, temperature=1.0))[0]
    assert chi_square_pvalue(tokens, wrong) < 1e-3
    right = kept_probs_torch(logits[:1], *rows(1, temperature=0.8))[0]
    assert chi_square_pvalue(tokens, right) > 1e-3
    small = DRAWS["triton"]  # the kernel's sample size still tells a 2x temperature apart
    assert (
        chi_square_pvalue(
            tokens[:small], kept_probs_torch(logits[:1], *rows(1, temperature=1.6))[0]
        )
        < 1e-3
    )
    with pytest.raises(AssertionError, match="outside the kept set"):
        chi_square_pvalue(
            tokens, kept_probs_torch(logits[:1], *rows(1, temperature=0.8, top_k=6))[0]
        )


# ---------------------------------------------------------------------------------------------
# (3) never a token outside the kept set, on adversarial rows
# ---------------------------------------------------------------------------------------------


def adversarial_rows(v=64):
    g = torch.Generator().manual_seed(3)
    pats = {
        "ties": torch.randint(0, 4, (v,), generator=g).float(),  # four values, many ties each
        "flat": torch.zeros(v),
        "dominant": torch.cat([torch.tensor([30.0]), torch.randn(v - 1, generator=g)]),
        "masked": torch.where(
            torch.rand(v, generator=g) < 0.6, -INF, torch.randn(v, generator=g) * 3
        ),
        "huge": torch.randn(v, generator=g) * 1e4,  # gaps overflow at small temperatures
        "one_finite": torch.full((v,), -INF).index_fill_(0, torch.tensor([v - 1]), -1e30),
    }
    filters = [
        (1.0, 2, 1.0, 0.0),
        (1.0, 0, 0.45, 0.0),
        (1.0, 0, 1.0, 0.3),
        (0.7, 5, 0.7, 0.1),
        (1e-30, 0, 1.0, 0.0),
        (1e-3, 3, 0.9, 0.0),
        (50.0, 0, 0.95, 0.0),
    ]
    logits, configs, names = [], [], []
    for pname, x in pats.items():
        for f in filters:
            logits.append(x)
            configs.append(f)
            names.append((pname, f))
    return torch.stack(logits), configs, names


@pytest.mark.parametrize("name", SAMPLERS)
def test_never_draws_outside_the_kept_set(name):
    base, configs, names = adversarial_rows()
    assert_margins(base, configs)
    reps = 1 if name == "triton" else 25  # the kernel's kept sets are also checked exactly
    logits = base.repeat_interleave(reps, dim=0)
    configs_r = [c for c in configs for _ in range(reps)]
    params = stack_params(configs_r)
    tokens = draw(name, logits, params, random_seeds(len(configs_r), seed=11))
    probs = kept_probs_torch(logits, *params)
    ok = probs[torch.arange(len(tokens)), tokens] > 0
    bad = [(names[i // reps], tokens[i].item()) for i in (~ok).nonzero().flatten().tolist()]
    assert not bad, f"drawn outside the kept set: {bad[:5]}"


@pytest.mark.parametrize("name", SAMPLERS)
def test_ties_at_the_threshold_are_all_kept(name):
    """The documented set, not a narrower one: top-k 2 / top-p 0.1 of a flat row keep every token
    (the kernel's kept set is checked exactly in `draw`), so the draws spread over more than 2
    tokens; a tiny temperature splits the tied best."""
    n, v = 8, 64
    flat = torch.zeros(3 * n, v)
    configs = [(1.0, 2, 1.0, 0.0)] * n + [(1.0, 0, 0.1, 0.0)] * n + [(1.0, 1, 0.5, 0.9)] * n
    tokens = draw(name, flat, stack_params(configs), random_seeds(3 * n, seed=12))
    spread = [tokens[i : i + n].unique().numel() for i in range(0, 3 * n, n)]
    assert min(spread) >= 5, spread  # 8 uniform draws over 64 tokens: about 7.6 distinct
    best2 = torch.full((12, v), -5.0)
    best2[:, [9, 40]] = 2.0
    tokens = draw(name, best2, rows(12, temperature=1e-30), random_seeds(12, seed=13))
    assert set(tokens.tolist()) == {9, 40}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    """16-bit logits (many ties in bfloat16) are read as they are: the same kept sets."""
    g = torch.Generator().manual_seed(4)
    n, v = 8, 100
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    configs = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (1.0, 7, 1.0, 0.0),
        (1.0, 0, 0.6, 0.0),
        (1.0, 0, 1.0, 0.15),
        (0.8, 10, 0.75, 0.05),
        (0.0, 3, 1.0, 0.0),
        (2.0, 2, 1.0, 0.0),
    ]
    params = stack_params(configs)
    assert_margins(logits.float(), configs)
    tokens = draw("triton", logits, params, random_seeds(n, seed=14))
    probs = kept_probs_torch(logits, *params)
    assert (probs[torch.arange(n), tokens] > 0).all()
    assert tokens[0] == logits[0].float().argmax() and tokens[6] == logits[6].float().argmax()


def test_many_chunks_give_the_same_draws(monkeypatch):
    """Chunking is invisible: a vocabulary that is no multiple of a small chunk gives the very
    same tokens as one chunk (each token's random number depends on its index only)."""
    g = torch.Generator().manual_seed(6)
    n, v = 7, 300
    logits = torch.randn(n, v, generator=g) * 2
    logits[0, [45, 237, 290]] = 10.0  # greedy tie across chunks (45 and 237 share a lane): 45 wins
    logits[1, :150] = -INF
    logits[2] = torch.randint(0, 3, (v,), generator=g).float()
    configs = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 4, 1.0, 0.0),
        (1.0, 9, 0.8, 0.0),
        (1.0, 0, 0.7, 0.0),
        (0.9, 0, 1.0, 0.05),
        (1.1, 25, 0.9, 0.01),
        (1.0, 0, 1.0, 0.0),
    ]
    params, seeds = stack_params(configs), random_seeds(n, seed=15)
    assert_margins(logits, configs)
    one_chunk = draw("triton", logits, params, seeds)
    monkeypatch.setattr(sampling, "_BLOCK_MAX", 32)
    monkeypatch.setattr(sampling, "_PIVOT_BLOCK_MAX", 16)
    many = draw("triton", logits, params, seeds)  # the same kept sets, checked in draw
    assert many.tolist() == one_chunk.tolist()
    assert many[0] == 45
    probs = kept_probs_torch(logits, *params)
    assert (probs[torch.arange(n), many] > 0).all()


# ---------------------------------------------------------------------------------------------
# (4) a row's draw depends on its seed only
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLERS)
def test_same_seed_same_token_whatever_the_batch(name):
    sample = SAMPLERS[name]
    g = torch.Generator().manual_seed(9)
    n, v = 6, 64
    logits = torch.randn(n, v, generator=g) * 2
    configs = [
        (1.0, 0, 1.0, 0.0),
        (0.7, 8, 1.0, 0.0),
        (1.2, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.05),
        (1.0, 20, 0.9, 0.01),
        (0.0, 0, 1.0, 0.0),
    ]
    params, seeds = stack_params(configs), random_seeds(n, seed=16)
    alone = sample(logits, *params, seeds)

    perm = torch.tensor([4, 1, 5, 0, 3, 2])
    permuted = sample(logits[perm], *(t[perm] for t in params), seeds[perm])
    assert permuted.tolist() == alone[perm].tolist()

    # interleaved with other rows (other logits, parameters and seeds)
    mates = torch.randn(n, v, generator=g)
    mixed_logits = torch.stack([mates, logits], dim=1).reshape(2 * n, v)
    mixed_params = [
        torch.stack([m, t], dim=1).flatten()
        for m, t in zip(stack_params([(1.5, 3, 0.5, 0.2)] * n), params)
    ]
    mixed_seeds = torch.stack([random_seeds(n, seed=17), seeds], dim=1).flatten()
    mixed = sample(mixed_logits, *mixed_params, mixed_seeds)
    assert mixed[1::2].tolist() == alone.tolist()

    single = sample(logits[2:3], *(t[2:3] for t in params), seeds[2:3])
    assert single.item() == alone[2].item()

    # a row of a wider tensor (row stride != V) is the same row
    wide = torch.cat([logits, torch.randn(n, 5, generator=g)], dim=1)[:, :v]
    assert sample(wide, *params, seeds).tolist() == alone.tolist()


@pytest.mark.parametrize("name", SAMPLERS)
def test_different_seeds_give_different_draws(name):
    n, v = 16, 64
    flat = torch.zeros(n, v)
    params = rows(n)
    by_seed = SAMPLERS[name](flat, *params, torch.arange(n, dtype=torch.long) * 7919)
    high_bits = SAMPLERS[name](
        flat, *params, (torch.arange(n, dtype=torch.long) << 33) | 5
    )  # low 32 bits alike
    repeated = SAMPLERS[name](flat, *params, torch.full((n,), 123456789, dtype=torch.long))
    # 16 uniform draws over 64 tokens: about 14 distinct
    assert by_seed.unique().numel() >= 9
    assert high_bits.unique().numel() >= 9
    assert repeated.unique().numel() == 1
