"""Qwen3 (q and k normed per head), Phi-3 (q/k/v and gate/up stored fused, a window over every
layer) and the mixtures of experts (Mixtral with a window, Qwen2-MoE with a shared expert and a
dense layer, Qwen3-MoE) through the engine: greedy tokens as transformers gives them on tiny random
models whose prompts are longer than the windows, with chunked prefill (a small token budget),
prefix caching and mixed steps, on each CPU kernel family. Phi-3's layers are Llama's, so the
native family runs them in its C layer stack and decodes in one call; the others run layer by
layer. The per-position logits are checked in test_model_vs_hf.py, the GGUF forms in
test_gguf_loader.py."""

from __future__ import annotations

import pytest
from _hf_models import build, cpu_families, hf_greedy_tokens, prompts

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import ConfigError
from sluice.engine.forward import LayerByLayer, NativeStack
from sluice.engine.loader import load_model
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.weights import BlockInt8Linear

# head_dim 64 and blocks of 16: the shapes the native family's C kernels serve
SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
MODELS = {
    "qwen3": ("qwen3", {**SHAPE, "head_dim": 64}),
    "phi3": ("phi3", {**SHAPE, "sliding_window": 8}),
    "mixtral": ("mixtral", {**SHAPE, "sliding_window": 8}),
    "qwen2_moe": ("qwen2_moe", {**SHAPE, "num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "qwen3_moe": ("qwen3_moe", {**SHAPE, "head_dim": 64}),
    "olmoe": ("olmoe", SHAPE),
}
BLOCK = 16
NEW_TOKENS = 10


def engine(path, kernels: str, **config) -> LLMEngine:
    defaults = dict(kv_cache_bytes=8 << 20, block_size=BLOCK, max_num_batched_tokens=20)
    return LLMEngine(
        config=EngineConfig(kernels=kernels, **{**defaults, **config}),
        loaded=load_model(path, load_tokenizer=False),
    )


def greedy(e: LLMEngine, ps) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [r.token_ids for r in e.generate(prompt_token_ids=ps, params=params)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A function of a `MODELS` name: (its directory, the prompts, transformers' greedy tokens for
    each), saved once for the module."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            kind, overrides = MODELS[name]
            path = tmp_path_factory.mktemp(name)
            hf = build(kind, **overrides)
            hf.save_pretrained(path)
            ps = prompts(hf.config.vocab_size)
            cache[name] = path, ps, [hf_greedy_tokens(hf, p, NEW_TOKENS) for p in ps]
        return cache[name]

    return get


@pytest.mark.parametrize("kernels", cpu_families())
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_match_transformers(saved, name, kernels):
    path, ps, want = saved(name)
    e = engine(path, kernels)
    assert e.model_config.architecture == MODELS[name][0]
    assert type(e.runner.route) is LayerByLayer  # (float weights: the stack wants them packed)
    assert greedy(e, ps) == want
    # again, the shared prefix's blocks now read back from the prefix cache
    assert greedy(e, ps[-2:]) == want[-2:]


@pytest.mark.skipif("native" not in cpu_families(), reason="the native family is not built here")
def test_phi3_int8_on_the_native_stack_gives_its_layer_by_layer_tokens(saved):
    """With packed int8 weights Phi-3 runs in the C layer stack and decodes in one call: the
    tokens of the same weights run layer by layer."""
    path, ps, _ = saved("phi3")
    stacked, by_layer = (engine(path, "native", quantization="int8") for _ in range(2))
    route = stacked.runner.route
    assert type(route) is NativeStack and route.decodes is not None
    r = by_layer.runner
    r.route = LayerByLayer(r.model, r.attention, r.kv_caches, r.embed)
    assert greedy(stacked, ps) == greedy(by_layer, ps)


@pytest.mark.skipif("native" not in cpu_families(), reason="the native family is not built here")
def test_qwen3_in_deterministic_mode_is_refused(saved):
    """Its QK-norm has no fixed-order kernel yet: refused rather than run batch-dependent."""
    path, _, _ = saved("qwen3")
    with pytest.raises(ConfigError) as e:
        engine(path, "auto", deterministic=True)
    assert e.value.field == "deterministic"


def test_a_mixture_of_experts_refuses_what_it_has_no_kernels_for_yet(saved):
    """Experts quantized per output channel (the torch family's int8), fixed-order experts, and
    experts split over tensor-parallel ranks: refused by name rather than run otherwise than
    asked."""
    path, _, _ = saved("mixtral")
    for kernels, config, field in (
        ("torch", {"quantization": "int8"}, "quantization"),
        ("auto", {"deterministic": True}, "deterministic"),
        ("auto", {"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ):
        with pytest.raises(ConfigError) as e:
            engine(path, kernels, **config)  # type: ignore[arg-type]
        assert e.value.field == field, config


@pytest.mark.skipif("native" not in cpu_families(), reason="the native family is not built here")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_run_in_blocks_on_the_native_kernels(saved, quantization):
    """Every expert's matrices (the shared expert's too) are blocks the native kernels multiply
    (their arithmetic against a float64 reference: test_moe.py), through the engine's batching
    and chunked prefill."""
    path, ps, _ = saved("qwen2_moe")
    e = engine(path, "native", quantization=quantization)
    experts = [layer.experts for layer in e.runner.model.layers if layer.experts is not None]
    assert len(experts) == 2  # (its middle layer is dense)
    for moe in experts:
        matrices = [*moe.gate_up, *moe.down, moe.shared_gate_up, moe.shared_down]
        assert all(isinstance(m, BlockInt8Linear) for m in matrices)
    assert [len(tokens) for tokens in greedy(e, ps)] == [NEW_TOKENS] * len(ps)
