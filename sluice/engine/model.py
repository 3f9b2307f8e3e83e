"""Llama / Mistral / Qwen2 decoder in plain torch, run over a flat batch of tokens.

Shapes: T tokens in the flat batch, H hidden size, Hq/Hkv query/KV heads of size D.
At load time q/k/v become one [Hq*D + 2*Hkv*D, H] matrix and gate/up one [2*I, H] matrix, so a
layer does four matmuls. Norms follow HF's RMSNorm exactly (float32 statistics, cast back, then
scale) so float32 logits match transformers to ~1e-6.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from .attention_backend import attend
from .config import ModelConfig
from .errors import EngineError
from .rope import RotaryEmbedding, apply_rotary, full_width


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


# On the CPU the projection weights are handed to oneDNN once, reordered into its blocked layout
# (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU backend does too), and every
# matmul then runs oneDNN's kernel on them. Measured on SmolLM2's shapes (2 cores, AVX-512):
# float32 1.5x faster at 1 row, ~1.5x at 64, ~1.25x at 2048 than F.linear's BLAS call; bfloat16
# ~1.35x at 64 rows. Where the op is missing or disagrees with F.linear, weights stay as they are.
PACK_BATCH_HINT = 64  # the row count oneDNN tunes the layout for (decode batches); any count works


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed form of a [N, K] weight, or None where that path is not available."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or mkldnn is None:
        return None
    try:
        packed = mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        want = F.linear(x, weight)
        tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item()):
            return None
        return packed
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, for plain or oneDNN-packed weights."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _pack_attribute(module: nn.Module, name: str, packed: torch.Tensor) -> None:
    """Replace parameter `name` of `module` by its packed form (a buffer, same attribute name)."""
    delattr(module, name)
    module.register_buffer(name, packed, persistent=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor]):
        super().__init__()
        c = config
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.scale = c.head_dim**-0.5
        self.input_norm = RMSNorm(w["input_layernorm.weight"], c.rms_norm_eps)
        self.post_attn_norm = RMSNorm(w["post_attention_layernorm.weight"], c.rms_norm_eps)
        a = "self_attn."
        self.qkv_weight = _param(torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]))
        self.qkv_bias = None
        if c.attention_bias:
            self.qkv_bias = _param(torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]))
        self.o_weight = _param(w[a + "o_proj.weight"])
        self.o_bias = _param(w.get(a + "o_proj.bias")) if c.o_proj_bias else None
        self.gate_up_weight = _param(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        self.down_weight = _param(w["mlp.down_proj.weight"])
        self.inter = c.intermediate_size
        self.eps = c.rms_norm_eps
        self.kernels = "torch"  # or "triton", "native": see CausalLM.use_kernels
        self.int8 = False

    def quantize_int8(self) -> None:
        """Weight-only int8 for the four projections: per output channel scales (buffers
        `<name>_q` int8 [N, K] and `<name>_scale` float32 [N]); the float weights are dropped."""
        from .kernels.int8_linear import quantize_int8

        for name in PROJECTIONS:
            q, scale = quantize_int8(getattr(self, name).data)
            delattr(self, name)
            self.register_buffer(name + "_q", q, persistent=False)
            self.register_buffer(name + "_scale", scale, persistent=False)
        self.int8 = True

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.int8:
            return int8_linear(x, getattr(self, name + "_q"), getattr(self, name + "_scale"), bias, self.kernels)
        return linear(x, getattr(self, name), bias)

    def pack_weights(self) -> bool:
        """Pack the four projection weights for oneDNN (see PACK_BATCH_HINT); False if unavailable."""
        if self.int8:
            return False
        names = PROJECTIONS
        packed = [pack_linear_weight(getattr(self, n)) for n in names]
        if any(p is None for p in packed):
            return False
        for name, p in zip(names, packed):
            _pack_attribute(self, name, p)
        return True

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """The torch path: x [T, H] -> [T, H]; cos, sin from `rope.full_width`."""
        t = x.shape[0]
        h = self.input_norm(x)
        qkv = self._linear(h, "qkv_weight", self.qkv_bias)
        # q and k heads side by side: one rotary pass over [T, Hq + Hkv, D]
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, self.hq + self.hkv, self.d), cos, sin)
        q, k = qk.split([self.hq, self.hkv], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.hkv, self.d)
        attn = attend(q, k, v, kv_cache, meta, self.scale, kernels=self.kernels)
        x = x + self._linear(attn.reshape(t, self.q_size), "o_weight", self.o_bias)

        h = self.post_attn_norm(x)
        gate, up = self._linear(h, "gate_up_weight").split([self.inter, self.inter], dim=-1)
        return x + self._linear(F.silu(gate).mul_(up), "down_weight")

    def forward_fused(self, x, residual, cos, sin, meta: AttentionMetadata, kv_cache):
        """The fused path (Triton kernels, or the native C ones), residual stream kept apart:
        (x, residual) -> (x, residual), where the layer's input is x + residual (residual None: x
        alone). cos, sin [T, D/2] float32."""
        add_rmsnorm, silu_and_mul, rotary_ = fused_ops(self.kernels)
        t = x.shape[0]
        h, residual = add_rmsnorm(x, residual, self.input_norm.weight, self.eps)
        qkv = self._linear(h, "qkv_weight", self.qkv_bias)
        q = qkv[:, : self.q_size].view(t, self.hq, self.d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.hkv, self.d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.hkv, self.d)
        rotary_(q, k, cos, sin)
        attn = attend(q, k, v, kv_cache, meta, self.scale, kernels=self.kernels)
        x = self._linear(attn.reshape(t, self.q_size), "o_weight", self.o_bias)
        h, residual = add_rmsnorm(x, residual, self.post_attn_norm.weight, self.eps)
        return self._linear(silu_and_mul(self._linear(h, "gate_up_weight")), "down_weight"), residual


def fused_ops(kernels: str):
    """(add_rmsnorm, silu_and_mul, rotary_) of the fused path: the Triton kernels or the C ones."""
    if kernels == "native":
        from .cpu_kernels.layer_ops import add_rmsnorm_native, rotary_native_, silu_and_mul_native

        return add_rmsnorm_native, silu_and_mul_native, rotary_native_
    from .kernels.activation import silu_and_mul_triton
    from .kernels.norm import add_rmsnorm_triton
    from .kernels.rotary import rotary_triton_

    return add_rmsnorm_triton, silu_and_mul_triton, rotary_triton_


PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def int8_linear(x, q, scale, bias, kernels: str) -> torch.Tensor:
    if kernels == "triton":
        from .kernels.int8_linear import int8_linear_triton

        return int8_linear_triton(x, q, scale, bias)
    from .kernels.int8_linear import int8_linear_torch

    return int8_linear_torch(x, q, scale, bias)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names the model needs, with their shapes."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (c.q_size, h),
                p + "self_attn.k_proj.weight": (c.kv_size, h),
                p + "self_attn.v_proj.weight": (c.kv_size, h),
                p + "self_attn.o_proj.weight": (h, c.q_size),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
        if c.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (c.q_size,),
                    p + "self_attn.k_proj.bias": (c.kv_size,),
                    p + "self_attn.v_proj.bias": (c.kv_size,),
                }
            )
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    return shapes


def check_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str, origin: dict[str, str] | None = None) -> None:
    """Raise EngineError naming the file and tensor when one is missing or has the wrong shape.

    origin maps a tensor name to the file it was read from (default: `source`)."""
    origin = origin or {}
    for name, shape in expected_shapes(config).items():
        t = tensors.get(name)
        if t is None:
            raise EngineError(f"{source}: missing tensor {name!r} (expected shape {list(shape)})", field=name)
        if tuple(t.shape) != shape:
            raise EngineError(
                f"{origin.get(name, source)}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}",
                field=name,
            )


def _to_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    from .config import EngineConfig

    return EngineConfig(dtype=dtype).torch_dtype


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[DecoderLayer], embed, norm, lm_head, device):
        super().__init__()
        self.config = config
        self.embed_weight = _param(embed)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head_weight = self.embed_weight if lm_head is None else _param(lm_head)
        self.rotary = RotaryEmbedding(config, device=device)
        self.packed = False
        self.kernels = "torch"
        self.int8 = False
        self.float_dtype = self.embed_weight.dtype

    def use_kernels(self, kernels: str) -> None:
        """"torch", "triton" or "native" (resolved by `kernels.resolve_backend`) for every layer."""
        self.kernels = kernels
        for layer in self.layers:
            layer.kernels = kernels

    def quantize_int8(self) -> None:
        """Weight-only int8 everywhere a matrix is multiplied: the four projections of every layer
        and the vocabulary matrices. The embedding's rows are the tied LM head's output channels,
        so one int8 copy with per-row scales serves both the lookup and the head. Norm weights stay
        in the model dtype. Replaces oneDNN packing (the two are not combined)."""
        from .kernels.int8_linear import quantize_int8

        if self.packed:
            raise RuntimeError("quantize before packing: packed weights cannot be quantized")
        for layer in self.layers:
            layer.quantize_int8()
        tied = self.lm_head_weight is self.embed_weight
        embed_q, embed_scale = quantize_int8(self.embed_weight.data)
        head = None if tied else quantize_int8(self.lm_head_weight.data)
        del self.lm_head_weight, self.embed_weight
        self.register_buffer("embed_q", embed_q, persistent=False)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        head_q, head_scale = head or (embed_q, embed_scale)
        self.register_buffer("head_q", head_q, persistent=False)
        self.register_buffer("head_scale", head_scale, persistent=False)
        self.int8 = True

    def weight_bytes(self) -> int:
        """Bytes of all weights as held (a tensor shared by two names counted once)."""
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            if t.is_mkldnn:
                total += t.numel() * t.element_size()
                continue
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def pack_weights(self) -> bool:
        """Hand the matmul weights to oneDNN in its packed layout (CPU only; see PACK_BATCH_HINT).

        A tied LM head gets a packed copy of its own (the embedding lookup needs the plain matrix).
        Returns False, changing nothing, where the packed path is unavailable."""
        if self.packed:
            return True
        head = pack_linear_weight(self.lm_head_weight)
        if head is None or not self.layers[0].pack_weights():
            return False
        for layer in self.layers[1:]:
            if not layer.pack_weights():
                raise RuntimeError("oneDNN packed the first layer's weights but not a later one's")
        if self.lm_head_weight is self.embed_weight:
            del self.lm_head_weight  # the attribute, not the (shared) parameter
            self.register_buffer("lm_head_weight", head, persistent=False)
        else:
            _pack_attribute(self, "lm_head_weight", head)
        self.packed = True
        return True

    @property
    def dtype(self) -> torch.dtype:
        return self.float_dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @classmethod
    def from_state_dict(cls, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype=torch.float32, device="cpu",
                        source: str = "state dict", quantization: str | None = None) -> "CausalLM":
        """Build from HF-named tensors (they are cast and moved; the dict itself is not changed).

        quantization "int8": weight-only int8 (`quantize_int8`); else the CPU packs for oneDNN."""
        dtype = _to_dtype(dtype)
        check_tensors(config, tensors, source)

        def get(name):
            return tensors[name].to(device=device, dtype=dtype)

        layers = []
        for n in range(config.num_hidden_layers):
            prefix = f"model.layers.{n}."
            w = {k[len(prefix):]: get(k) for k in tensors if k.startswith(prefix)}
            layers.append(DecoderLayer(config, w))
        embed = get("model.embed_tokens.weight")
        lm_head = None if config.tie_word_embeddings else get("lm_head.weight")
        norm = RMSNorm(get("model.norm.weight"), config.rms_norm_eps)
        model = cls(config, layers, embed, norm, lm_head, device).eval()
        if quantization == "int8":
            model.quantize_int8()
        elif quantization is not None:
            raise EngineError(f"unsupported quantization {quantization!r}", field="quantization")
        else:
            model.pack_weights()
        return model

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.int8:
            rows = F.embedding(input_ids, self.embed_q).to(self.float_dtype)
            return rows * self.embed_scale[input_ids].unsqueeze(1).to(self.float_dtype)
        return F.embedding(input_ids, self.embed_weight)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """input_ids, positions [T] -> final-norm hidden states [T, H]."""
        x = self.embed(input_ids)
        if self.kernels in ("triton", "native"):
            return self._forward_fused(x, positions, meta, kv_caches)
        cos, sin = full_width(*self.rotary.cos_sin(positions, x.dtype))
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, kv)
        return self.norm(x)

    def _forward_fused(self, x, positions, meta, kv_caches) -> torch.Tensor:
        add_rmsnorm = fused_ops(self.kernels)[0]
        cos, sin = (c.squeeze(1) for c in self.rotary.cos_sin(positions, torch.float32))
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer.forward_fused(x, residual, cos, sin, meta, kv)
        return add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32.

        The matmul runs in the model dtype (bf16 matmuls accumulate in float32 and round once at
        the end) and is then upcast, as vLLM and transformers do, rather than keeping a float32
        copy of the vocabulary matrix."""
        if self.int8:
            return int8_linear(hidden, self.head_q, self.head_scale, None, self.kernels).float()
        return linear(hidden, self.lm_head_weight).float()
