"""Configuration of the model (what the weights are) and of the engine (how it runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, ModelError

# HF `architectures` entry -> our family name. Mistral and Llama share one implementation.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
# HF `model_type` of a config saved without `architectures` -> our family name
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3_text": "gemma3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
}
# Families whose sliding window (when the config sets one) is every layer's
WINDOWED_EVERYWHERE = ("mistral", "phi3", "mixtral")
# Families with Qwen's attention: q/k/v biased by default (Qwen2's), or q and k normed per head
QWEN2_ATTENTION = ("qwen2", "qwen2_moe")
QWEN3_ATTENTION = ("qwen3", "qwen3_moe")
# Families whose experts' probabilities are always renormalized over the chosen (Mixtral); the
# others say so in `norm_topk_prob`
MOE_ALWAYS_RENORMALIZED = ("mixtral",)
# HF activation names of the gated MLP we run ("gelu_pytorch_tanh": GELU's tanh approximation)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")


def _error(message: str, field: str) -> ModelError:
    return ModelError(message, field=field)


@dataclass(frozen=True)
class ModelConfig:
    # "llama" | "qwen2" | "qwen3" | "mistral" | "phi3" | "gemma3" | "mixtral" | "qwen2_moe" |
    # "qwen3_moe" | "olmoe"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # HF style, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None means plain rotary.
    # GGUF files that carry llama.cpp's per-dimension factors (tensor rope_freqs) give
    # {"rope_type": "freq_factors", "factors": [...]}.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # q/k/v bias (Qwen2; Llama's, Mistral's and Qwen3's attention_bias also adds an o_proj bias)
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Extension: keys further back than this many positions are not attended (Mistral v0.1), in
    # every layer unless `layer_windows` says otherwise.
    sliding_window: int | None = None
    # Each layer's window (None: the whole context), where the layers differ (Gemma 3's local and
    # global layers); None: every layer attends with `sliding_window`.
    layer_windows: tuple[int | None, ...] | None = None
    # Rotary theta of the windowed layers, which then rotate without `rope_scaling` (Gemma 3's
    # local layers); None: every layer rotates alike.
    local_rope_theta: float | None = None
    # Attention scores are scaled by query_pre_attn_scalar**-0.5 (Gemma); None: head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    # The gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
    hidden_act: str = "silu"
    # Gemma's RMSNorm: it scales by 1 + weight, multiplied in float32 before the cast back.
    norm_adds_one: bool = False
    # Gemma's layer: norms on the attention and MLP outputs too (post_attention_layernorm is then
    # the attention output's, pre_feedforward_layernorm the MLP input's), and an RMSNorm over each
    # head of q and k before rotary (q_norm, k_norm; Qwen3 has these alone, scaled by the weight).
    sandwich_norms: bool = False
    qk_norm: bool = False
    # OLMoE's QK-norm: q and k each normed as one vector over all their heads (weights [Hq*D] and
    # [Hkv*D]), not head by head
    qk_norm_whole: bool = False
    # The token embeddings are multiplied by this, in the model dtype (Gemma: sqrt(hidden_size)).
    embedding_scale: float | None = None
    # logits -> cap * tanh(logits / cap) (Gemma 2); None: no capping.
    final_logit_softcapping: float | None = None
    # A mixture of experts (`moe`; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): in each layer not among
    # `dense_layers` the MLP is `num_experts` gated MLPs of `moe_intermediate_size` columns, each
    # token running the `num_experts_per_tok` its router scores highest (renormalized over the
    # chosen where `norm_topk_prob`); 0 experts: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert, a gated MLP of this many columns every token runs; 0: none
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()

    @property
    def o_proj_bias(self) -> bool:
        # HF Llama/Mistral/Qwen3 put `attention_bias` on o_proj as well; Qwen2 never biases o_proj.
        return self.attention_bias and self.architecture in ("llama", "mistral", *QWEN3_ATTENTION)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def attention_scale(self) -> float:
        """What attention scores q.k are multiplied by."""
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5

    def layer_window(self, layer: int) -> int | None:
        """The window layer `layer` attends with (None: its whole context)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def other_windows(self) -> tuple[int | None, ...]:
        """The windows some layers attend with other than `sliding_window` (a step is planned
        once for each of these too)."""
        if self.layer_windows is None:
            return ()
        return tuple(w for w in dict.fromkeys(self.layer_windows) if w != self.sliding_window)

    def uses_local_rotary(self, layer: int) -> bool:
        """Whether layer `layer` rotates by `local_rope_theta` (a windowed layer of a model that
        has one)."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is the plain Llama form (one window for all, SiLU, RMSNorm scaled
        by its weight, no QK-norm, no extra norms, unscaled embeddings, uncapped logits): the
        form the native layer stack and one-call decode implement (`forward.choose_forward`)."""
        return (
            self.layer_windows is None
            and self.local_rope_theta is None
            and self.hidden_act == "silu"
            and not (self.norm_adds_one or self.sandwich_norms or self.qk_norm)
            and self.embedding_scale is None
            and self.final_logit_softcapping is None
            and self.num_experts == 0
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K plus V for one token over all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a HF config.json dict (transformers 4.x `rope_scaling` or 5.x
        `rope_parameters`)."""
        archs = d.get("architectures") or []
        arch = None
        for a in archs:
            if a in HF_ARCHITECTURES:
                arch = HF_ARCHITECTURES[a]
                break
        if arch is None and not archs and d.get("model_type") in HF_MODEL_TYPES:
            arch = HF_MODEL_TYPES[d["model_type"]]  # config saved from a bare config object
        if arch is None:
            raise _error(
                f"{source}: unknown architecture {archs or d.get('model_type')!r} "
                "in field 'architectures'; "
                f"supported: {sorted(HF_ARCHITECTURES)}",
                "architectures",
            )

        def need(key: str):
            if d.get(key) is None:
                raise _error(f"{source}: missing field {key!r}", key)
            return d[key]

        # Gemma's configs name it hidden_activation
        act_field = "hidden_activation" if "hidden_activation" in d else "hidden_act"
        act = d.get(act_field) or "silu"
        if act not in SUPPORTED_ACTIVATIONS or (act != "silu" and arch != "gemma3"):
            raise _error(
                f"{source}: unsupported {act_field} {act!r} in field {act_field!r} for {arch} "
                f"(supported: {list(SUPPORTED_ACTIVATIONS)}, GELU for gemma3 only)",
                act_field,
            )
        if d.get("clip_qkv") is not None:
            raise _error(f"{source}: unsupported field 'clip_qkv'={d['clip_qkv']!r}", "clip_qkv")
        if d.get("mlp_bias"):
            raise _error(f"{source}: unsupported field 'mlp_bias'=true", "mlp_bias")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise _error(
                f"{source}: unsupported field 'partial_rotary_factor'", "partial_rotary_factor"
            )

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise _error(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}",
                "num_key_value_heads",
            )

        if arch == "gemma3":
            for key in ("vocab_size", "intermediate_size", "num_hidden_layers"):
                need(key)
            return cls._gemma3(d, source, arch, hidden, heads, kv_heads, head_dim, act)

        # Rotary: transformers 5 keeps theta and scaling together in `rope_parameters`.
        rope = dict(d.get("rope_parameters") or {})
        if "rope_theta" not in rope:
            rope.update(d.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        # (transformers 5 keeps Phi-3's partial rotary factor among the rotary parameters)
        if float(rope.pop("partial_rotary_factor", None) or 1.0) != 1.0:
            raise _error(
                f"{source}: unsupported field 'partial_rotary_factor'", "partial_rotary_factor"
            )
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = normalize_rope_scaling(rope, rope_type, source)

        sliding = None
        if arch in WINDOWED_EVERYWHERE:
            sliding = d.get("sliding_window")
        elif arch in (*QWEN2_ATTENTION, *QWEN3_ATTENTION) and d.get("use_sliding_window"):
            raise _error(
                f"{source}: unsupported field 'use_sliding_window'=true for {arch}",
                "use_sliding_window",
            )

        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(
                d.get("attention_bias", d.get("qkv_bias", arch in QWEN2_ATTENTION))
            ),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_ids(d),
            sliding_window=int(sliding) if sliding else None,
            qk_norm=arch in (*QWEN3_ATTENTION, "olmoe"),
            qk_norm_whole=arch == "olmoe",
            **_moe_fields(d, arch, int(need("num_hidden_layers")), source),
        )

    @classmethod
    def _gemma3(
        cls,
        d: dict[str, Any],
        source: str,
        arch: str,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        act: str,
    ) -> ModelConfig:
        """A HF gemma3_text config: local (sliding-window) and global layers by `layer_types`
        (or every `sliding_window_pattern`-th layer global), each kind with its own rotary."""
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if d.get(key):
                raise _error(f"{source}: unsupported field {key!r}={d[key]!r} for gemma3", key)
        layers = int(d.get("num_hidden_layers") or 0)
        kinds = d.get("layer_types")
        if kinds is None:
            kinds = gemma3_layer_kinds(layers, int(d.get("sliding_window_pattern") or 6))
        unknown = set(kinds) - {"full_attention", "sliding_attention"}
        if unknown or len(kinds) != layers:
            raise _error(
                f"{source}: field 'layer_types' must give 'full_attention' or "
                f"'sliding_attention' for each of the {layers} layers",
                "layer_types",
            )
        window = d.get("sliding_window")
        window = int(window) if window else None
        # transformers 5: rope_parameters by layer kind; 4.x: rope_theta, rope_local_base_freq
        # and rope_scaling (the global layers')
        by_kind = d.get("rope_parameters") or {}
        if "full_attention" in by_kind or "sliding_attention" in by_kind:
            full = dict(by_kind.get("full_attention") or {})
            local = dict(by_kind.get("sliding_attention") or {})
        else:
            full = {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta")}
            local = {"rope_theta": d.get("rope_local_base_freq")}
        theta = float(full.pop("rope_theta", None) or 1_000_000.0)
        local_theta = float(local.pop("rope_theta", None) or 10_000.0)
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise _error(
                f"{source}: unsupported rope type for the sliding-window layers: {local}",
                "rope_parameters",
            )
        rope_type = full.get("rope_type", full.get("type", "default"))
        cap = d.get("final_logit_softcapping")
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=normalize_rope_scaling(full, rope_type, source),
            max_position_embeddings=int(d.get("max_position_embeddings") or 131072),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_ids(d),
            hidden_act=act,
            **gemma3_fields(
                hidden,
                kinds,
                window,
                local_theta,
                float(d.get("query_pre_attn_scalar") or 256),  # (HF's default)
                float(cap) if cap else None,
            ),
        )


def _moe_fields(d: dict[str, Any], arch: str, layers: int, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a HF mixture-of-experts config (none for a dense one)."""
    experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    if not experts:
        return {}
    top_k = int(d.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise _error(
            f"{source}: num_experts_per_tok={top_k} must be between 1 and the {experts} experts",
            "num_experts_per_tok",
        )
    step = int(d.get("decoder_sparse_step") or 1)
    only_mlp = set(d.get("mlp_only_layers") or ())
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        # Mixtral's experts are intermediate_size wide; Qwen's MoE configs say so apart
        moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
        norm_topk_prob=arch in MOE_ALWAYS_RENORMALIZED or bool(d.get("norm_topk_prob")),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
        dense_layers=tuple(n for n in range(layers) if n in only_mlp or (n + 1) % step != 0),
    )


def gemma3_layer_kinds(layers: int, pattern: int) -> list[str]:
    """HF's layer_types for a Gemma 3 whose every `pattern`-th layer is global."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]


def gemma3_fields(
    hidden: int,
    layer_kinds: list[str],
    window: int | None,
    local_rope_theta: float,
    query_pre_attn_scalar: float,
    final_logit_softcapping: float | None,
) -> dict[str, Any]:
    """The `ModelConfig` fields that make a model Gemma 3 (from a HF config or a GGUF file)."""
    return dict(
        sliding_window=window,
        layer_windows=tuple(window if k == "sliding_attention" else None for k in layer_kinds),
        local_rope_theta=local_rope_theta,
        query_pre_attn_scalar=query_pre_attn_scalar,
        norm_adds_one=True,
        sandwich_norms=True,
        qk_norm=True,
        embedding_scale=hidden**0.5,
        final_logit_softcapping=final_logit_softcapping,
    )


def _eos_ids(d: dict[str, Any]) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def normalize_rope_scaling(params: dict, rope_type: str | None, source: str) -> dict | None:
    """HF-style scaling dict with a `rope_type` key, or None for plain rotary."""
    if rope_type in (None, "default"):
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _error(
            f"{source}: unsupported rope type {rope_type!r} in field 'rope_scaling'", "rope_scaling"
        )
    out = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    out["rope_type"] = rope_type
    return out


QUANTIZATIONS = (None, "int8", "int4", "auto")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int | None = (
        None  # budget for K+V of all layers; None -> default (see model_runner)
    )
    gpu_memory_fraction: float = 0.85  # used on CUDA when kv_cache_bytes is None
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    # "float32" | "bfloat16" | "auto": the faster of the two on this machine for this model,
    # measured at start (`dtype_probe`); the engine's config then holds the one chosen
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # "auto": fused Triton kernels on CUDA; on the CPU "native" (decode attention in C, built at
    # first use) where a C compiler is found, else "torch". "torch", "triton", "native" force one.
    kernels: str = "auto"
    # None | "int8": weights as int8 codes (per output channel; in blocks of 32 on the native
    # kernels, which multiply them as stored) | "int4": 4-bit codes in blocks of 32 with a scale
    # and a minimum (GGUF's Q4_1; native kernels only) | "auto": as the file stores its layers
    # (`stored_quantization`: int4 for a 4-bit GGUF, int8 for a wider one, None for floats); the
    # engine's config then holds the one chosen
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "int8" | "fp8" (e4m3, CUDA)
    # Tokens that depend on the request alone, not on the batch, chunking, cache or threads
    # (`kernel_ops.deterministic_ops` on the CPU, `deterministic_triton_ops` on CUDA); a KV cache
    # of the model dtype.
    deterministic: bool = False
    # Ranks the model's heads and MLP columns are split over (`tensor_parallel`): rank 0 is this
    # process, ranks 1..N-1 worker processes it starts
    tensor_parallel_size: int = 1
    # The CPUs the engine computes on, one thread each (`cpus`); None: torch's threads on every
    # CPU the process may use, shared with the rest of it
    engine_cpus: tuple[int, ...] | None = None
    # Decode steps captured once per batch size as CUDA graphs and replayed (`captured_decode`;
    # CUDA and the triton kernels only)
    cuda_graphs: bool = False

    def __post_init__(self):
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"unsupported quantization {self.quantization!r}; "
                f"choose one of {list(QUANTIZATIONS)}",
                field="quantization",
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"choose one of {list(KV_CACHE_DTYPES)}",
                field="kv_cache_dtype",
            )
        if self.deterministic and self.kv_cache_dtype != "auto":
            # an int8 block's scale grows as its tokens arrive and requantizes the codes already
            # there, so its codes depend on how the tokens were split into steps
            raise ConfigError(
                f"deterministic mode does not run with kv_cache_dtype={self.kv_cache_dtype!r}: a "
                "quantized block's codes depend on how its tokens were split into steps",
                field="kv_cache_dtype",
            )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(
                f"tensor_parallel_size must be a whole number of at least 1, not {tp!r}",
                field="tensor_parallel_size",
            )
        if tp > 1 and self.engine_cpus is not None:
            raise ConfigError(
                "engine_cpus does not run with tensor_parallel_size > 1: the ranks divide the "
                "machine's threads among themselves",
                field="engine_cpus",
            )
        if self.cuda_graphs and self.device != "auto" and not str(self.device).startswith("cuda"):
            raise ConfigError(
                f"cuda_graphs captures decode steps on a CUDA device, not on {self.device!r}",
                field="cuda_graphs",
            )
        if self.cuda_graphs and tp > 1:
            raise ConfigError(
                "cuda_graphs does not run with tensor_parallel_size > 1: the ranks' all-reduce "
                "runs between the layers, outside any graph",
                field="cuda_graphs",
            )
        if tp > 1 and self.deterministic:
            # an all-reduce adds the ranks' partial sums in an order of its own, and provenance
            # does not record the split: the bits would not be the single-process ones
            raise ConfigError(
                "deterministic mode does not run with tensor_parallel_size > 1: the all-reduce "
                "sums the ranks' partial results in an order of its own",
                field="tensor_parallel_size",
            )

    @property
    def kv_torch_dtype(self):
        """The element type of the KV cache."""
        import torch

        if self.kv_cache_dtype == "int8":
            return torch.int8
        if self.kv_cache_dtype == "fp8":
            return torch.float8_e4m3fn
        return self.torch_dtype

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype)


def torch_dtype(dtype):
    """The torch dtype named "float32", "bfloat16" or "float16" (a torch dtype is returned as
    is)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ConfigError(
            f"unsupported dtype {dtype!r}; choose one of {sorted(dtypes)}", field="dtype"
        )
    return dtypes[dtype]
