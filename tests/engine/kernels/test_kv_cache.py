"""Paged KV cache writes: plain copies, and int8 / float8_e4m3fn with per-(block, head) scales that
grow as blocks fill up over several steps. Triton kernel (interpreter on the CPU) vs torch
reference, both against an independent model of the documented rule (expected scales, error
bounds)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sluice.engine.kernels import kv_cache as kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = {"torch": kv.write_kv_torch, "triton": kv.write_kv_triton}
QDTYPES = [torch.int8, torch.float8_e4m3fn]
H, D = 2, 24  # D not a power of two: the kernels mask it


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _kv_views(T: int, dtype: torch.dtype, g: torch.Generator, scale: torch.Tensor):
    """k, v [T, H, D] as strided views (padded head stride, shared token rows), values
    k_true * scale."""
    buf = torch.randn(T, 2, H, D + 8, generator=g) * scale[:, None, None, None]
    tiny = torch.rand(buf.shape, generator=g)
    buf = torch.where(tiny < 0.05, buf * 1e-5, buf)  # float8 subnormals
    buf = torch.where(tiny > 0.98, torch.zeros_like(buf), buf)
    buf = buf.to(dtype).to(DEVICE)
    return buf[:, 0, :, :D], buf[:, 1, :, :D]


# ----------------------------------------------------------------------------------------------
# unquantized


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_write_equals_index_assignment(impl, dtype):
    bs, nb = 4, 9
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([5 * bs + 2, 5 * bs + 3, 1 * bs + 0, -1, 8 * bs + 1, 0, -1, 3 * bs + 3])
    k, v = _kv_views(len(slots), dtype, g, torch.ones(len(slots)))
    assert not k.is_contiguous()
    k_cache = torch.full((nb, H, bs, D), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, :, s % bs] = k[t]
            want_v[s // bs, :, s % bs] = v[t]
    IMPLS[impl](k, v, k_cache, v_cache, slots.to(DEVICE))
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)
    assert (~k_cache.isnan()).sum() == 6 * H * D  # exactly the six real tokens were written


def test_plain_write_rejects_mismatched_dtype_and_stray_scales():
    k = torch.zeros(2, H, D, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    cache = torch.zeros(2, H, 4, D, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError):
        kv.write_kv_triton(k, k, cache, cache.clone(), slots)
    cache = cache.float()
    with pytest.raises(ValueError):
        kv.write_kv_torch(k, k, cache, cache.clone(), slots, torch.ones(2, H), torch.ones(2, H))
    with pytest.raises(ValueError):  # a quantized cache without scales
        kv.write_kv_torch(k, k, cache.to(torch.int8), cache.to(torch.int8), slots)


# ----------------------------------------------------------------------------------------------
# quantized: an independent model of the documented rule


def _stage_bound(
    prev: torch.Tensor, value: torch.Tensor, s: torch.Tensor, cache_dtype
) -> torch.Tensor:
    """Error bound of an entry after one more (re)quantization at scale s, given its bound before.
    int8: half a step, s/2 (plus float32 slack on x/s and q*ratio). float8 e4m3: 2**-4 relative to
    the value being rounded (|value| + prev), or half the subnormal step 2**-9 * s, whichever is
    larger."""
    if cache_dtype == torch.int8:
        return prev + s * (0.5 + 1e-4)
    return (prev + 2.0**-4 * (value.abs() + prev) + 2.0**-10 * s) * (1 + 1e-5)


class Expected:
    """Per block: the true float values written, how many are valid, the expected scale (running
    absmax / QMAX since the block (re)started, floored) and each entry's error bound."""

    def __init__(self, nb: int, bs: int, cache_dtype):
        self.cache_dtype = cache_dtype
        self.qmax = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}[cache_dtype]
        self.truth = torch.zeros(nb, H, bs, D, dtype=torch.float64)
        self.bound = torch.zeros(nb, H, bs, D, dtype=torch.float64)
        self.scale = torch.zeros(nb, H)
        self.filled = [0] * nb
        self.requantizations = 0

    def write(self, block: int, first: int, vals: torch.Tensor) -> None:
        """vals [count, H, D] float32 written at offsets first.. of `block` in one step."""
        assert first in (0, self.filled[block]), "scenario bug: blocks fill from 0 upward"
        count = vals.shape[0]
        amax = vals.abs().amax(dim=(0, 2))
        prev = self.scale[block] if first > 0 else torch.zeros(H)
        s = torch.maximum(prev, amax / self.qmax).clamp_min(kv.SCALE_FLOOR)
        if first == 0:
            self.bound[block] = 0
        for h in range(H):
            if first > 0 and s[h] > self.scale[block, h]:
                self.requantizations += 1
                self.bound[block, h, :first] = _stage_bound(
                    self.bound[block, h, :first],
                    self.truth[block, h, :first],
                    float(s[h]),
                    self.cache_dtype,
                )
        new = vals.transpose(0, 1).double()  # [H, count, D]
        self.truth[block, :, first : first + count] = new
        self.bound[block, :, first : first + count] = _stage_bound(
            torch.zeros_like(new), new, s.double()[:, None, None], self.cache_dtype
        )
        self.scale[block] = s
        self.filled[block] = first + count


@dataclass
class Scenario:
    name: str
    block_size: int
    num_blocks: int
    tables: list  # block ids of each sequence (holes, any order)
    steps: list  # each step: [(sequence index, new tokens) or (-1, padding tokens)]


SCENARIOS = [
    Scenario("token_by_token_bs4_holes", 4, 10, [[5, 1, 8]], [[(0, 1)]] * 11),
    Scenario(
        "chunks_bs16", 16, 8, [[3, 0, 6]], [[(0, 13)], [(0, 1)], [(0, 1)], [(0, 20)], [(0, 5)]]
    ),
    Scenario(
        "all_at_once_short_and_long_two_seqs",
        16,
        12,
        [[2, 7, 4], [9, 10]],
        [[(0, 37), (-1, 2), (1, 5), (-1, 3)], [(0, 1), (1, 1)], [(1, 12), (-1, 1), (0, 3)]],
    ),
    Scenario(
        "prefill_chunks_two_seqs_bs4",
        4,
        16,
        [[11, 2, 14, 5, 7], [0, 13, 3]],
        [[(0, 6), (1, 3)], [(1, 5), (0, 1)], [(-1, 1), (0, 9), (1, 1)], [(0, 1), (1, 1), (-1, 2)]],
    ),
]


def _build_steps(sc: Scenario, model_dtype, seed: int):
    """Per step: k, v views, slot mapping, and per touched block (block, first offset, k, v
    values)."""
    g = torch.Generator().manual_seed(seed)
    bs = sc.block_size
    pos = [0] * len(sc.tables)
    steps = []
    for chunks in sc.steps:
        slots, owners = [], []
        for seq, n in chunks:
            if seq < 0:
                slots += [-1] * n
                owners += [None] * n
                continue
            for p in range(pos[seq], pos[seq] + n):
                slots.append(sc.tables[seq][p // bs] * bs + p % bs)
                owners.append(seq)
            pos[seq] += n
        T = len(slots)
        # magnitudes vary by token (and padding is huge) so scales grow within blocks and a
        # skipped token that leaked into a block would show in its scale
        mag = torch.exp(torch.rand(T, generator=g) * 3 - 1)
        mag = torch.where(torch.tensor([o is None for o in owners]), torch.full((T,), 1e4), mag)
        k, v = _kv_views(T, model_dtype, g, mag)
        writes = []
        for t, s in enumerate(slots):
            if s < 0:
                continue
            b, off = divmod(s, bs)
            if writes and writes[-1][0] == b:
                writes[-1][2].append(t)
            else:
                writes.append((b, off, [t]))
        steps.append((k, v, torch.tensor(slots, dtype=torch.int64, device=DEVICE), writes))
    return steps


def _run(impl, sc: Scenario, cache_dtype, steps, seed: int, check_each_step: bool):
    g = torch.Generator().manual_seed(seed)
    shape = (sc.num_blocks, H, sc.block_size, D)
    # garbage everywhere, scales included: a restarting block must ignore both
    init = [torch.randint(-128, 128, shape, generator=g, dtype=torch.int8) for _ in range(2)]
    init += [torch.rand(shape[:2], generator=g) * 50 for _ in range(2)]
    if cache_dtype == torch.float8_e4m3fn:
        init[:2] = [t.view(torch.float8_e4m3fn) for t in init[:2]]
    k_cache, v_cache, k_scale, v_scale = (t.clone().to(DEVICE) for t in init)
    exp_k, exp_v = (Expected(sc.num_blocks, sc.block_size, cache_dtype) for _ in range(2))
    for k, v, slots, writes in steps:
        IMPLS[impl](k, v, k_cache, v_cache, slots, k_scale, v_scale)
        for b, first, toks in writes:
            exp_k.write(b, first, k[toks].float().cpu())
            exp_v.write(b, first, v[toks].float().cpu())
        if check_each_step:
            _check_against_model(k_cache, k_scale, exp_k)
            _check_against_model(v_cache, v_scale, exp_v)
    return (k_cache, v_cache, k_scale, v_scale), init, (exp_k, exp_v)


def _check_against_model(cache, scale, exp: Expected):
    touched = [b for b, n in enumerate(exp.filled) if n > 0]
    ids = torch.tensor(touched, device=DEVICE)
    # the scale is exactly max(running absmax / QMAX, floor): same float32 ops, exact rounding
    assert torch.equal(scale[ids].cpu(), exp.scale[touched])
    deq = kv.dequantize_torch(cache, scale, ids, torch.float32).double().cpu()
    for i, b in enumerate(touched):
        n = exp.filled[b]
        err = (deq[i, :, :n] - exp.truth[b, :, :n]).abs()
        bound = exp.bound[b, :, :n] + 1e-6 * exp.truth[b, :, :n].abs() + 1e-30
        assert (err <= bound).all(), f"block {b}: error {(err - bound).max().item()} over the bound"


def _assert_paths_agree(ref, got, init, exp: Expected, cache_dtype, num_blocks):
    """ref, got, init: (k_cache, v_cache, k_scale, v_scale) of the torch path, the Triton path and
    the initial garbage."""
    touched = [b for b, n in enumerate(exp.filled) if n > 0]
    ids = torch.tensor(touched, device=DEVICE)
    untouched = [b for b in range(num_blocks) if b not in touched]
    untouched = torch.tensor(untouched, dtype=torch.int64, device=DEVICE)
    for i in range(4):
        # untouched blocks keep their bytes and scales (skipped slots wrote nothing)
        r, gt, ini = _raw(ref[i]), _raw(got[i]), _raw(init[i]).to(DEVICE)
        assert torch.equal(r[untouched], ini[untouched]) and torch.equal(
            gt[untouched], ini[untouched]
        )
    for i in range(2):
        assert torch.equal(got[i + 2], ref[i + 2])  # scales: the same float32 ops, exactly rounded
        r, gt = _raw(ref[i]), _raw(got[i])
        if cache_dtype == torch.int8:
            # exact but for a rounding tie decided differently (a GPU's arithmetic, say)
            assert (r.int() - gt.int()).abs().max() <= 1
        else:
            a = kv.dequantize_torch(ref[i], ref[i + 2], ids, torch.float32)
            b = kv.dequantize_torch(got[i], got[i + 2], ids, torch.float32)
            valid = torch.zeros_like(a, dtype=torch.bool)
            for j, blk in enumerate(touched):
                valid[j, :, : exp.filled[blk]] = True
            torch.testing.assert_close(
                b[valid], a[valid], rtol=2.0**-3, atol=2.0**-9 * ref[i + 2].max().item()
            )
        assert (r == gt).float().mean().item() > 0.999


@pytest.mark.parametrize("cache_dtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_quantized_write_follows_the_rule_torch_and_triton_agree(sc, cache_dtype):
    steps = _build_steps(sc, torch.float32, seed=len(sc.name))
    # the torch reference is checked after every step, the kernel at the end (interpreter time)
    ref, init, (exp_k, exp_v) = _run("torch", sc, cache_dtype, steps, seed=7, check_each_step=True)
    got, _, _ = _run("triton", sc, cache_dtype, steps, seed=7, check_each_step=False)
    _check_against_model(got[0], got[2], exp_k)
    _check_against_model(got[1], got[3], exp_v)
    if sc.name != "all_at_once_short_and_long_two_seqs":
        assert exp_k.requantizations > 0, "scenario never grew the scale of a partly filled block"
    _assert_paths_agree(ref, got, init, exp_k, cache_dtype, sc.num_blocks)


@pytest.mark.parametrize("cache_dtype", QDTYPES, ids=["int8", "fp8"])
def test_bfloat16_inputs_and_block_reuse(cache_dtype):
    """bfloat16 K/V, and blocks freed by one sequence and reused by another from offset 0: the old,
    larger scale (and the garbage one before it) must be dropped."""
    sc = Scenario("reuse", 4, 6, [[1, 4], [4, 1]], [[(0, 5)], [(0, 2)], [(1, 6)], [(1, 1)]])
    steps = _build_steps(sc, torch.bfloat16, seed=3)
    for k, v, _, _ in steps[:2]:  # the first sequence is loud, the second quiet
        k.mul_(100)
        v.mul_(100)
    ref, init, (exp_k, _) = _run("torch", sc, cache_dtype, steps, seed=9, check_each_step=True)
    got, _, _ = _run("triton", sc, cache_dtype, steps, seed=9, check_each_step=True)
    _assert_paths_agree(ref, got, init, exp_k, cache_dtype, sc.num_blocks)


def test_all_tokens_skipped_changes_nothing():
    k = torch.randn(3, H, D, device=DEVICE)
    slots = torch.full((3,), -1, device=DEVICE)
    cache = torch.randint(-128, 128, (4, H, 4, D), dtype=torch.int8, device=DEVICE)
    scale = torch.rand(4, H, device=DEVICE)
    for impl in IMPLS.values():
        c, s = cache.clone(), scale.clone()
        impl(k, k, c, c.clone(), slots, s, s.clone())
        assert torch.equal(c, cache) and torch.equal(s, scale)


def test_touched_blocks_plan():
    bs = 4
    slots = torch.tensor(
        [-1, 5 * bs + 2, 5 * bs + 3, 1 * bs + 0, -1, 9 * bs + 0, 9 * bs + 1, 9 * bs + 2]
    )
    blocks, first, count, start = kv.touched_blocks(slots, bs)
    assert blocks.tolist() == [1, 5, 9]
    assert first.tolist() == [0, 2, 0]
    assert count.tolist() == [1, 2, 3]
    assert start.tolist() == [3, 1, 5]


def test_qmax_and_dequantize():
    assert kv.kv_qmax(torch.int8) == 127.0 and kv.kv_qmax(torch.float8_e4m3fn) == 448.0
    with pytest.raises(ValueError):
        kv.kv_qmax(torch.bfloat16)
    cache = torch.tensor(
        [[[[1, -2]], [[127, 0]]], [[[3, 4]], [[-127, 5]]]], dtype=torch.int8
    )  # [2, 2, 1, 2]
    scale = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    got = kv.dequantize_torch(cache, scale, torch.tensor([1, 0]), torch.float32)
    want = torch.tensor([[[[3.0, 4.0]], [[-31.75, 1.25]]], [[[0.5, -1.0]], [[254.0, 0.0]]]])
    assert torch.equal(got, want)
    f8 = torch.tensor([1.5, -448.0, 0.001953125], dtype=torch.float8_e4m3fn).view(1, 1, 1, 3)
    got = kv.dequantize_torch(f8, torch.tensor([[2.0]]), torch.tensor([0]), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.flatten().tolist() == [3.0, -896.0, 0.00390625]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_rounding_ties_go_to_even(impl):
    """Values that land exactly halfway between two codes (scale 1: the absmax is QMAX) are stored
    like torch.round / torch's float8 cast do it: ties to even, subnormal float8 codes included."""
    int8_vals = [127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 3.25]
    int8_want = [127, 0, 2, 2, 0, -2, 126, -126, 3]
    fp8_vals = [
        448.0,
        1.0625,
        1.1875,
        17.0,
        19.0,
        -1.0625,
        0.0029296875,
        0.0048828125,
        0.0009765625,
        440.0,
    ]
    fp8_want = [448.0, 1.0, 1.25, 16.0, 20.0, -1.0, 0.00390625, 0.00390625, 0.0, 448.0]
    for cache_dtype, vals, want in (
        (torch.int8, int8_vals, int8_want),
        (torch.float8_e4m3fn, fp8_vals, fp8_want),
    ):
        k = torch.zeros(1, H, D)
        k[0, :, : len(vals)] = torch.tensor(vals)
        k = k.to(DEVICE)
        cache = torch.zeros(2, H, 4, D, dtype=cache_dtype, device=DEVICE)
        scale = torch.zeros(2, H, device=DEVICE)
        slots = torch.tensor([4], dtype=torch.int32, device=DEVICE)  # int32 slot mappings work too
        IMPLS[impl](k, k, cache, cache.clone(), slots, scale, scale.clone())
        assert scale[1].tolist() == [1.0] * H
        stored = cache[1, :, 0, : len(vals)].float().cpu()
        assert stored.tolist() == [want] * H
        if cache_dtype == torch.float8_e4m3fn:  # and byte for byte what torch's own cast gives
            torch_cast = (
                torch.tensor(vals).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            )
            assert torch.equal(cache[1, 0, 0, : len(vals)].view(torch.uint8).cpu(), torch_cast)


@pytest.mark.parametrize("cache_dtype", QDTYPES, ids=["int8", "fp8"])
def test_all_zero_values_get_the_floor_scale(cache_dtype):
    k = torch.zeros(3, H, D, device=DEVICE)
    for impl in IMPLS.values():
        cache = torch.ones(2, H, 4, D, device=DEVICE).to(cache_dtype)
        scale = torch.full((2, H), 5.0, device=DEVICE)
        impl(
            k, k, cache, cache.clone(), torch.tensor([4, 5, 6], device=DEVICE), scale, scale.clone()
        )
        assert torch.equal(scale[1], torch.full((H,), kv.SCALE_FLOOR, device=DEVICE))
        deq = kv.dequantize_torch(cache, scale, torch.tensor([1], device=DEVICE), torch.float32)
        assert torch.equal(deq[0, :, :3], torch.zeros(H, 3, D, device=DEVICE))
