"""The decoder layers in one native call (`cpu_kernels.decoder_layers`) give the bits of the
layer-by-layer path: the same sampled tokens and the same logprobs, exactly, over chunked
prefills, mixed prefill/decode steps, prefix-cache hits and random batch mates, for int8 and int4
weights in float32 and bfloat16, an int8 KV cache, attention and o_proj biases, a sliding window,
and deterministic mode's fixed-order weights; steps of decodes only run from token ids to the final
norm in one call (`DecodeForward`: the embedding, from a table, a packed int8 head, int8 rows or a
GGUF file's own blocks, and the final norm too). Each case also checks that the one calls really
ran (and the layer-by-layer path really did not)."""

from __future__ import annotations

import random

import pytest
from _hf_models import build
from test_engine_kernels import engine

from sluice.engine.cpu_kernels.decode_forward import DecodeForward
from sluice.engine.cpu_kernels.decoder_layers import LayerStack
from sluice.engine.forward import LayerByLayer, NativeStack
from sluice.engine.kernel_ops.native_ops import NativeOps
from sluice.engine.sampling_params import SamplingParams

D64 = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
CASES = {
    "llama-int8": ("llama", {}, dict(quantization="int8")),
    "llama-int4-bf16": ("llama", {}, dict(quantization="int4", dtype="bfloat16")),
    "llama-int8-int8kv": ("llama", {}, dict(quantization="int8", kv_cache_dtype="int8")),
    "qwen2-bias-int4": ("qwen2", {"tie_word_embeddings": True}, dict(quantization="int4")),
    "mistral-window-int8": ("mistral", {"sliding_window": 24}, dict(quantization="int8")),
    "deterministic-float32": ("llama", {}, dict(deterministic=True)),
    "deterministic-bf16-int4": (
        "llama",
        {},
        dict(deterministic=True, dtype="bfloat16", quantization="int4"),
    ),
}


def _requests(vocab: int, seed: int = 0):
    """Prompts of 5..70 tokens sharing a 32-token prefix in pairs, each sampled with its seed."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(32)]
    prompts = []
    for i in range(10):
        own = [rng.randrange(vocab) for _ in range(rng.randrange(5, 40))]
        prompts.append((shared + own) if i % 2 else own)
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10, ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    return prompts, params


def _outputs(e):
    prompts, params = _requests(e.model_config.vocab_size)
    results = e.generate(prompt_token_ids=prompts, params=params)
    again = e.generate(prompt_token_ids=prompts[1::2], params=params[1::2])  # prefix hits
    assert sum(r.usage.cached_tokens for r in again) >= 32 * len(again)
    return [(r.token_ids, r.samples[0].logprobs) for r in results + again]


@pytest.mark.parametrize("name", list(CASES))
def test_one_call_gives_the_layer_by_layer_bits(tmp_path, monkeypatch, name):
    kind, overrides, config = CASES[name]
    build(kind, **{**D64, **overrides}).save_pretrained(tmp_path)
    _one_call_matches_layer_by_layer(tmp_path, monkeypatch, config)


@pytest.mark.parametrize(
    "qtype, config",
    [("Q5_0", dict(quantization="int4")), ("Q8_0", dict(quantization="int8", dtype="bfloat16"))],
    ids=["Q5_0-int4", "Q8_0-int8-bf16"],
)
def test_one_call_reads_an_untied_embedding_left_in_the_file(tmp_path, monkeypatch, qtype, config):
    """A GGUF whose untied embedding is stored as `qtype`: its rows are decoded from the file's
    blocks (`FileEmbedding`), by the one decode call as by torch."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    from test_gguf_loader import write_gguf

    from sluice.engine.weights import FileEmbedding

    def stored(t):
        return quants.quantize(t.astype(np.float32), Q[qtype]), Q[qtype]

    # (head size 64 as hidden / heads: the file's writer here names no head size)
    shape = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    write_gguf(tmp_path / "m.gguf", build("llama", **shape), "llama", override={
        "token_embd.weight": stored
    })  # fmt: skip
    e = _one_call_matches_layer_by_layer(tmp_path, monkeypatch, config)
    assert isinstance(e.runner.model.embed_tokens, FileEmbedding)


@pytest.mark.parametrize(
    "qtype, config",
    [
        ("Q6_K", dict(quantization="int4")),
        ("Q6_K", dict(quantization="int8", dtype="bfloat16")),
        ("Q5_K", dict(quantization="int4")),
        ("Q5_0", dict(quantization="int8", dtype="bfloat16")),
    ],
    ids=["Q6_K-int4", "Q6_K-int8-bf16", "Q5_K-int4", "Q5_0-int8-bf16"],
)
def test_one_call_multiplies_wider_blocks_as_stored(tmp_path, monkeypatch, qtype, config):
    """A GGUF with its down projections and its tied vocabulary matrix stored as `qtype` (as
    Qwen2.5's Q4_K_M files keep them in Q6_K, Q5_K_M files in Q5_K): they keep the file's 6- or
    5-bit blocks (the head, and the embedding's rows read from it), and the one calls give the
    layer-by-layer bits."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    from test_gguf_loader import write_gguf

    from sluice.engine.cpu_kernels.block_int8_linear import FMT_Q5, FMT_Q6
    from sluice.engine.weights import BlockInt8Embedding

    rng = np.random.default_rng(9)

    def stored(t):
        rows, k = t.shape
        if qtype == "Q5_0":
            return quants.quantize(t.astype(np.float32), Q.Q5_0), Q.Q5_0
        # random blocks (nothing here quantizes to K-quants), scales small enough for sane logits
        size = {"Q6_K": 210, "Q5_K": 176}[qtype]
        raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
        d = rng.uniform(1e-4, 3e-4, (rows, k // 256, 2)).astype(np.float16).view(np.uint8)
        if qtype == "Q6_K":
            raw[..., 208:210] = d[..., :2]
        else:  # d and dmin
            raw[..., 0:4] = d.reshape(rows, k // 256, 4)
        return raw.reshape(rows, -1), Q[qtype]

    shape = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4}
    hf = build("llama", num_key_value_heads=2, tie_word_embeddings=True, **shape)
    layers = hf.config.num_hidden_layers
    override = {f"blk.{i}.ffn_down.weight": stored for i in range(layers)}
    write_gguf(tmp_path / "m.gguf", hf, "llama", override={"token_embd.weight": stored, **override})
    e = _one_call_matches_layer_by_layer(tmp_path, monkeypatch, config)
    model = e.runner.model
    fmt = FMT_Q6 if qtype == "Q6_K" else FMT_Q5
    assert model.lm_head.packed.fmt == fmt
    assert isinstance(model.embed_tokens, BlockInt8Embedding)
    assert all(layer.down.packed.fmt == fmt for layer in model.layers)


def _one_call_matches_layer_by_layer(path, monkeypatch, config):
    """The engine on the model at `path` with `config`, through the one calls and layer by layer:
    the same outputs; the layer-by-layer engine."""
    config = dict(block_size=16, max_num_batched_tokens=48, device="cpu", **config)
    calls = {"stack": 0, "decodes": 0}
    run, run_decodes = LayerStack.run, DecodeForward.run

    def counted(self, *args):
        calls["stack"] += 1
        return run(self, *args)

    def counted_decodes(self, *args):
        calls["decodes"] += 1
        return run_decodes(self, *args)

    monkeypatch.setattr(LayerStack, "run", counted)
    monkeypatch.setattr(DecodeForward, "run", counted_decodes)
    e = engine(path, "native", **config)
    assert isinstance(e.runner.route, NativeStack), e.runner.route.name
    stacked = _outputs(e)
    assert calls["stack"] > 0, "the one call never ran"
    # steps of decodes only run from token ids to the final norm in one call (deterministic mode
    # sends decodes through the prefill kernel: the model's forward)
    assert (calls["decodes"] > 0) == (not config.get("deterministic")), calls

    monkeypatch.setattr(NativeOps, "runs_layer_stack", lambda self, spec: False)
    calls.update(stack=0, decodes=0)
    e = engine(path, "native", **config)
    assert type(e.runner.route) is LayerByLayer, e.runner.route.name
    layered = _outputs(e)
    assert calls == {"stack": 0, "decodes": 0}
    assert stacked == layered
    return e


def test_float_weights_stay_on_the_layer_by_layer_path(tmp_path):
    """oneDNN-packed float weights are multiplied by torch: no one call for them."""
    build("llama", **D64).save_pretrained(tmp_path)
    e = engine(tmp_path, "native", block_size=16, device="cpu")
    assert LayerStack.of(e.runner.model.layers) is None
    assert type(e.runner.route) is LayerByLayer
