"""Sampler and SamplingParams: greedy, penalties, truncation, seeded draws, distribution,
validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from sluice.engine.draws import draw_word
from sluice.engine.errors import EngineError
from sluice.engine.sampler import Sampler, apply_penalties
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.truncated_draw import kept_tokens


@dataclass
class Seq:  # the two attributes of engine Sequence the sampler reads
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0


sampler = Sampler()


def short(p: SamplingParams) -> str:
    """Test id: the fields that differ from the defaults."""
    default = SamplingParams()
    return (
        ",".join(f"{k}={v}" for k, v in p.__dict__.items() if v != getattr(default, k))
        or "defaults"
    )


def random_words(n: int) -> list[int]:
    """64-bit random words from torch's global generator (so torch.manual_seed fixes them)."""
    halves = torch.randint(0, 2**32, (n, 2), dtype=torch.int64).tolist()
    return [hi << 32 | lo for hi, lo in halves]


def run(logits, params, seqs=None, words=None):
    n = logits.shape[0]
    return sampler(logits, seqs or [Seq() for _ in range(n)], params, words or random_words(n))


def test_greedy_is_argmax_and_deterministic():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    logits[3, 7] = logits[3, 9] = 100.0  # a tie: the first index wins, like torch.argmax
    params = [SamplingParams(temperature=0)] * 8
    before = logits.clone()
    out = run(logits, params)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 7
    assert run(logits, params).token_ids == out.token_ids
    assert torch.equal(logits, before)  # the caller's logits are untouched


def test_greedy_over_a_vocabulary_wide_batch_takes_the_first_maximum():
    # wide enough that the reduction is split between threads: a tie across the split still
    # goes to the first index
    torch.manual_seed(2)
    logits = torch.randn(64, 49152)
    logits[5, 100] = logits[5, 40000] = 50.0
    logits[6, 30000] = logits[6, 49151] = 50.0
    for mixed in (False, True):
        params = [SamplingParams(temperature=0)] * 64
        if mixed:
            params = [*params[:63], SamplingParams(temperature=1.0)]
        out = run(logits, params)
        assert out.token_ids[:63] == logits[:63].argmax(-1).tolist()
        assert out.token_ids[5:7] == [100, 30000]


def test_greedy_rows_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    params = [
        SamplingParams(temperature=0 if i % 2 else 1.0, top_k=5, logprobs=2) for i in range(6)
    ]
    before = logits.clone()
    out = run(logits, params)
    for i in range(1, 6, 2):
        assert out.token_ids[i] == logits[i].argmax().item()
    for i in range(0, 6, 2):
        assert out.token_ids[i] in logits[i].topk(5).indices.tolist()
    assert torch.equal(logits, before)


def reference_penalties(logits, seq, p):
    """The textbook loops: repetition over prompt+output, presence/frequency over the output."""
    out = logits.clone()
    for tok in set(seq.token_ids):
        x = out[tok].item()
        out[tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    generated = seq.token_ids[seq.num_prompt_tokens :]
    for tok in set(generated):
        out[tok] -= p.frequency_penalty * generated.count(tok) + p.presence_penalty
    return out


def test_penalties_match_reference():
    torch.manual_seed(2)
    vocab = 50
    logits = torch.randn(4, vocab) * 3
    seqs = [
        Seq([1, 2, 3, 3, 4, 4, 4, 10], num_prompt_tokens=3),
        Seq([5, 5, 5, 6], num_prompt_tokens=1),
        Seq([7, 8, 9], num_prompt_tokens=3),  # nothing generated yet
        Seq([0, 1, 2], num_prompt_tokens=1),
    ]
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=2.0, presence_penalty=1.0),
        SamplingParams(),  # no penalty at all: its row must not change
    ]
    got = logits.clone()
    apply_penalties(got, seqs, params)
    for i in range(4):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], seqs[i], params[i]))

    # Through the public API: greedy picks the argmax of the penalized logits, and logprobs
    # (temperature 0 -> penalties only) are their log-softmax.
    greedy = [SamplingParams(**{**p.__dict__, "temperature": 0, "logprobs": 5}) for p in params]
    out = run(logits, greedy, seqs)
    for i in range(4):
        ref = torch.log_softmax(reference_penalties(logits[i], seqs[i], params[i]), -1)
        assert out.token_ids[i] == ref.argmax().item()
        lp = out.logprobs[i]
        assert lp.rank == 1 and math.isclose(lp.logprob, ref.max().item(), rel_tol=1e-5)
        assert [t for t, _ in lp.top] == ref.topk(5).indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), ref.topk(5).values)


def reference_kept(logits, p: SamplingParams) -> set[int]:
    """Tokens left after temperature, min-p, top-k, then top-p on what is left (renormalized)."""
    x = logits / (p.temperature or 1.0)
    probs = torch.softmax(x, -1)
    keep = set(range(len(x)))
    if p.min_p > 0:
        keep = {i for i in keep if probs[i] >= p.min_p * probs.max()}
    order = [i for i in torch.argsort(x, descending=True).tolist() if i in keep]
    if p.top_k > 0:
        order = order[: p.top_k]
    if p.top_p < 1:
        mass = torch.softmax(x[order], -1)
        kept, total = [], 0.0
        for i, m in zip(order, mass.tolist()):
            if total >= p.top_p:
                break
            kept.append(i)
            total += m
        order = kept
    return set(order)


TRUNCATIONS = [
    SamplingParams(top_k=7),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.95, temperature=1.5),
    SamplingParams(min_p=0.1),
    SamplingParams(top_k=20, top_p=0.7, temperature=0.7),
    SamplingParams(min_p=0.05, top_p=0.9),
    SamplingParams(top_k=3, min_p=0.3, top_p=0.99),
    SamplingParams(top_k=1),
    SamplingParams(top_p=1e-6),
]


@pytest.mark.parametrize(
    "vocab", [64, 3000]
)  # 3000: a flat row's nucleus is wider than the candidates looked at
def test_truncation_matches_reference_in_a_mixed_batch(vocab):
    torch.manual_seed(3)
    logits = torch.randn(len(TRUNCATIONS) + 1, vocab) * torch.tensor(
        [3.0] * len(TRUNCATIONS) + [0.1]
    ).unsqueeze(1)
    params = [*TRUNCATIONS, SamplingParams(top_p=0.9)]  # last row nearly flat
    scaled = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    kept = kept_tokens(scaled, params)
    for i, p in enumerate(params):
        assert set(kept[i].nonzero().flatten().tolist()) == reference_kept(logits[i], p), p


@pytest.mark.parametrize("p", TRUNCATIONS, ids=short)
def test_draws_stay_in_the_kept_set(p):
    torch.manual_seed(4)
    row = torch.randn(200) * 2
    n = 500
    out = run(row.expand(n, -1).contiguous(), [p] * n)
    assert set(out.token_ids) <= reference_kept(row, p)


def test_draws_in_a_mixed_batch_with_a_wide_nucleus():
    # The flat row's top-p set is wider than the first candidates looked at; its batch mates' are
    # not.
    torch.manual_seed(9)
    vocab, reps = 3000, 100
    flat, peaked = torch.randn(vocab) * 0.1, torch.randn(vocab) * 4
    cases = [
        (flat, SamplingParams(top_p=0.9)),
        (peaked, SamplingParams(top_k=5)),
        (peaked, SamplingParams(top_p=0.8)),
    ]
    logits = torch.stack([row for row, _ in cases] * reps)
    out = run(logits, [p for _, p in cases] * reps)
    for j, (row, p) in enumerate(cases):
        drawn = set(out.token_ids[j :: len(cases)])
        assert drawn <= reference_kept(row, p)
    assert len(set(out.token_ids[0 :: len(cases)])) > 50


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper critical value of chi-square (z=3.29: p ~ 0.0005), Wilson-Hilferty approximation."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(),
        SamplingParams(temperature=0.6, top_k=8),
        SamplingParams(top_p=0.8, min_p=0.02),
    ],
    ids=short,
)
def test_frequencies_follow_the_distribution(p):
    torch.manual_seed(5)
    vocab, n = 12, 20000
    row = torch.randn(vocab)
    kept = sorted(reference_kept(row, p))
    probs = torch.softmax(row[kept] / (p.temperature or 1.0), -1)
    out = run(row.expand(n, -1).contiguous(), [p] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).float()
    assert counts[[i for i in range(vocab) if i not in kept]].sum() == 0
    expected = probs * n
    chi2 = (((counts[kept] - expected) ** 2) / expected).sum().item()
    assert chi2 < _chi2_critical(len(kept) - 1)


def test_seeded_rows_do_not_depend_on_batch_mates():
    torch.manual_seed(6)
    vocab, steps = 500, 15
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def trajectory(batch_size: int, position: int, mates_seeded: bool) -> list[int]:
        tokens = []
        for step in range(steps):
            rows = torch.randn(batch_size, vocab)  # the mates' logits change from run to run
            rows[position] = torch.sin(torch.arange(vocab) * (step + 1.0)) * 4  # ours do not
            params = [SamplingParams(temperature=0.8, top_k=50)] * batch_size
            params[position] = target
            words = (
                [draw_word(99 + j, 0, step) for j in range(batch_size)]
                if mates_seeded
                else random_words(batch_size)
            )
            words[position] = draw_word(target.seed, 0, step)  # (seed, completion, position)
            tokens.append(run(rows, params, words=words).token_ids[position])
        return tokens

    alone = trajectory(1, 0, False)
    assert trajectory(7, 3, False) == alone
    assert trajectory(4, 0, True) == alone
    assert trajectory(9, 8, True) == alone
    assert len(set(alone)) > 1


def test_a_draw_is_its_key_alone():
    row = torch.zeros(1, 1000)  # uniform
    p = SamplingParams()
    by_seed = [run(row, [p], words=[draw_word(s, 0, 5)]).token_ids[0] for s in range(20)]
    assert len(set(by_seed)) > 10
    by_position = [run(row, [p], words=[draw_word(3, 0, pos)]).token_ids[0] for pos in range(20)]
    assert len(set(by_position)) > 10
    by_index = [run(row, [p], words=[draw_word(3, i, 5)]).token_ids[0] for i in range(20)]
    assert len(set(by_index)) > 10
    again = [run(row, [p], words=[draw_word(s, 0, 5)]).token_ids[0] for s in range(20)]
    assert again == by_seed
    with pytest.raises(ValueError, match="random word"):
        run(row, [p], words=[None])


def test_logprobs_of_the_processed_distribution():
    torch.manual_seed(8)
    logits = torch.randn(3, 100)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=4),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=2.0),
    ]
    out = run(logits, params)
    assert out.logprobs[2] is None
    lp0 = out.logprobs[0]
    ref = torch.log_softmax(logits[0] / 0.5, -1)  # temperature applied, top-k not
    assert lp0.token_id == out.token_ids[0]
    assert math.isclose(lp0.logprob, ref[lp0.token_id].item(), rel_tol=1e-5)
    assert lp0.rank == int((ref > ref[lp0.token_id]).sum()) + 1 <= 3
    assert [t for t, _ in lp0.top] == ref.topk(4).indices.tolist()
    assert out.logprobs[1].top == [] and out.logprobs[1].token_id == out.token_ids[1]


def test_empty_batch():
    out = sampler(torch.zeros(0, 10), [], [], [])
    assert out.token_ids == [] and out.logprobs == []


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("n", 0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("stop", [""]),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("seed", -1),
        ("seed", True),
        ("ignore_eos", "yes"),
    ],
)
def test_validation_names_the_field(name, value):
    p = SamplingParams(**{name: value})
    with pytest.raises(EngineError) as e:
        p.validate()
    assert e.value.field == name
    assert name in str(e.value)
    assert isinstance(e.value, ValueError)


def test_valid_params_pass():
    SamplingParams().validate()
    SamplingParams(
        temperature=0, top_k=-1, top_p=1, min_p=1, n=4, logprobs=20, seed=2**64 - 1
    ).validate()
    p = SamplingParams(stop="END")
    assert p.stop == ["END"] and p.greedy is False
    assert SamplingParams(temperature=0).greedy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_seeded_and_truncated():
    dev = torch.device("cuda")
    torch.manual_seed(10)
    row = torch.randn(5000, device=dev) * 3
    p = SamplingParams(temperature=0.9, top_p=0.9, min_p=0.01, seed=5)

    def draw(batch: int) -> list[int]:
        logits = torch.randn(batch, 5000, device=dev)
        logits[0] = row
        params = [p] + [SamplingParams(top_k=3)] * (batch - 1)
        return [
            run(logits, params, words=[draw_word(5, 0, pos)] + random_words(batch - 1)).token_ids[0]
            for pos in range(10)
        ]

    alone = draw(1)
    assert draw(64) == alone
    assert set(alone) <= reference_kept(
        row.cpu() / 1.0, SamplingParams(top_p=0.9, min_p=0.01, temperature=0.9)
    )
