"""The HF tensor names a decoder needs, with their shapes, and how they become the model's weights.

Every loader (HF safetensors, GGUF) produces HF-named tensors; `check_tensors` says which file holds
a missing or misshapen one, and `model_weights` fuses and casts them into `model.ModelWeights`
(q/k/v into one matrix, gate/up into another).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ModelError
from ..model import LayerWeights, ModelWeights
from ..moe import ExpertWeights
from ..weights import BlockInt8Embedding
from .lazy_tensors import LazyTensors, tensor_shape

if TYPE_CHECKING:
    from ..weight_transforms import BlockWeights


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
            }
        )
        if c.is_moe_layer(n):
            shapes.update(_expert_shapes(c, p + "mlp."))
        else:
            shapes.update(
                {
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
        if c.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if c.qk_norm:
            whole = c.qk_norm_whole
            shapes[p + "self_attn.q_norm.weight"] = (c.q_size if whole else c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.kv_size if whole else c.head_dim,)
    return shapes


def _expert_shapes(c: ModelConfig, mlp: str) -> dict[str, tuple[int, ...]]:
    """A mixture of experts' tensors (Qwen's MoE names) under `mlp` ("model.layers.N.mlp.")."""
    h, i = c.hidden_size, c.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {mlp + "gate.weight": (c.num_experts, h)}
    for e in range(c.num_experts):
        x = f"{mlp}experts.{e}."
        shapes |= {x + "gate_proj.weight": (i, h), x + "up_proj.weight": (i, h)}
        shapes[x + "down_proj.weight"] = (h, i)
    if c.shared_expert_intermediate_size:
        s, x = c.shared_expert_intermediate_size, mlp + "shared_expert."
        shapes |= {x + "gate_proj.weight": (s, h), x + "up_proj.weight": (s, h)}
        shapes |= {x + "down_proj.weight": (h, s), mlp + "shared_expert_gate.weight": (1, h)}
    return shapes


def check_tensors(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    origin: dict[str, str] | None = None,
) -> None:
    """Raise EngineError naming the file and tensor when one is missing or has the wrong shape.

    origin maps a tensor name to the file it was read from (default: `source`)."""
    origin = origin or {}
    for name, shape in expected_shapes(config).items():
        found = tensor_shape(tensors, name)
        if found is None:
            raise ModelError(
                f"{source}: missing tensor {name!r} (expected shape {list(shape)})", field=name
            )
        if found != shape:
            raise ModelError(
                f"{origin.get(name, source)}: tensor {name!r} has shape {list(found)}, "
                f"expected {list(shape)}",
                field=name,
            )


# The HF matrices that each of a decoder layer's Linear modules (`weight_transforms.PROJECTIONS`)
# stacks by rows, under "model.layers.N."
PROJECTION_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def layer_matrices(config: ModelConfig, layer: int) -> dict[str, tuple[str, ...]]:
    """Each matrix a layer multiplies by, as the model keeps it (a key of `StoredProjections`
    after the layer's index), with the HF matrices it stacks by rows, under "model.layers.N.": the
    `PROJECTION_PARTS`, or for a mixture of experts the attention's and each expert's
    ("experts.gate_up.3", "experts.down.3"; Qwen2-MoE's "experts.shared_gate_up", ...)."""
    if not config.is_moe_layer(layer):
        return dict(PROJECTION_PARTS)
    out = {name: PROJECTION_PARTS[name] for name in ("qkv", "o_proj")}
    for e in range(config.num_experts):
        x = f"mlp.experts.{e}."
        out[f"experts.gate_up.{e}"] = (x + "gate_proj", x + "up_proj")
        out[f"experts.down.{e}"] = (x + "down_proj",)
    if config.shared_expert_intermediate_size:
        x = "mlp.shared_expert."
        out["experts.shared_gate_up"] = (x + "gate_proj", x + "up_proj")
        out["experts.shared_down"] = (x + "down_proj",)
    return out


def fused_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """The fused matrices a family's files hold in place of the HF names above, under
    "model.layers.N.", each with the parts it stacks by rows and their row counts (Phi-3's
    qkv_proj and gate_up_proj); empty for the families that store each part."""
    if config.architecture != "phi3":
        return {}
    c = config
    return {
        "self_attn.qkv_proj.weight": (
            ("self_attn.q_proj.weight", c.q_size),
            ("self_attn.k_proj.weight", c.kv_size),
            ("self_attn.v_proj.weight", c.kv_size),
        ),
        "mlp.gate_up_proj.weight": (
            ("mlp.gate_proj.weight", c.intermediate_size),
            ("mlp.up_proj.weight", c.intermediate_size),
        ),
    }


def layer_tensor(name: str) -> tuple[str, str] | None:
    """("N", the rest) of a layer's HF tensor name "model.layers.N.rest"; None for another."""
    head, _, tail = name.partition("model.layers.")
    number, _, rest = tail.partition(".")
    return (number, rest) if not head and number.isdigit() and rest else None


def stored_parts(
    config: ModelConfig, name: str, rows: int, source: str
) -> list[tuple[str, slice | int | None]]:
    """The HF-named tensors a tensor read from a file gives, each with its index into it: a fused
    matrix's parts (`fused_parts`: runs of rows), a layer's experts stacked into one tensor (as
    GGUF files hold them, "mlp.experts.gate_proj.weight" [E, I, H]: one expert each), or the
    tensor itself whole (None)."""
    layer = layer_tensor(name)
    if layer is None:
        return [(name, None)]
    number, module = layer
    if config.num_experts and module.startswith("mlp.experts.") and module.count(".") == 3:
        if rows != config.num_experts:
            raise ModelError(
                f"{source}: tensor {name!r} stacks {rows} experts, expected {config.num_experts}",
                field=name,
            )
        part = module.split(".")[2]
        return [(f"model.layers.{number}.mlp.experts.{e}.{part}.weight", e) for e in range(rows)]
    parts = fused_parts(config).get(module)
    if parts is None:
        return [(name, None)]
    if rows != sum(n for _, n in parts):
        raise ModelError(
            f"{source}: tensor {name!r} has {rows} rows, expected {sum(n for _, n in parts)}",
            field=name,
        )
    out: list[tuple[str, slice | int | None]] = []
    start = 0
    for part, n in parts:
        out.append((f"model.layers.{number}.{part}", slice(start, start + n)))
        start += n
    return out


# Mixtral's names for its experts' matrices (under "block_sparse_moe.experts.N.")
_MIXTRAL_EXPERT_MATRICES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_name(config: ModelConfig, name: str) -> str:
    """One spelling of a tensor's HF name for the builder: Mixtral's router and experts under
    Qwen's MoE names ("block_sparse_moe.experts.3.w1" -> "mlp.experts.3.gate_proj"); every other
    name as it is."""
    layer = layer_tensor(name)
    if config.architecture != "mixtral" or layer is None:
        return name
    number, rest = layer
    if not rest.startswith("block_sparse_moe."):
        return name
    parts = rest.removeprefix("block_sparse_moe.").split(".")
    if parts[0] == "experts" and len(parts) == 4:
        parts[2] = _MIXTRAL_EXPERT_MATRICES.get(parts[2], parts[2])
    return f"model.layers.{number}.mlp." + ".".join(parts)


def split_fused(
    config: ModelConfig, name: str, tensor: torch.Tensor, source: str
) -> dict[str, torch.Tensor]:
    """A tensor as read from a file under HF names: a fused matrix or stacked experts
    (`stored_parts`) as views of its parts, any other as it is."""
    return {
        part: tensor if index is None else tensor[index]
        for part, index in stored_parts(config, name, tensor.shape[0], source)
    }


def _discard(tensors: MutableMapping[str, torch.Tensor], name: str) -> None:
    """`name` out of the mapping, without reading a lazy tensor's values to do it."""
    if isinstance(tensors, LazyTensors):
        tensors.discard(name)
    else:
        tensors.pop(name, None)


def model_weights(
    config: ModelConfig,
    tensors: MutableMapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    take: bool = False,
    blocks: BlockWeights | None = None,
) -> ModelWeights:
    """The model's weights from checked HF-named tensors, cast and moved. The mapping is
    unchanged, or with `take` each tensor is taken out of it as it is used, so that a part of a
    fused matrix is freed as soon as the fused copy exists rather than when the whole model is
    built. With `blocks` (a model quantized for the native kernels), each layer's projections
    are made by it as the layer is built, and the LM head (with a tied embedding) from the file's
    own blocks where it has them: a quantized model never holds all its float matrices at once.
    Without, they are the stacked float matrices."""

    def get(name: str) -> torch.Tensor:
        return (tensors.pop(name) if take else tensors[name]).to(device=device, dtype=dtype)

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([get(n) for n in names])

    def optional(name: str, present: bool) -> torch.Tensor | None:
        return get(name) if present else None

    def matrix(
        n: int, key: str, parts: tuple[str, ...], bias: torch.Tensor | None = None
    ) -> torch.Tensor | nn.Module:
        """Layer n's matrix `key` (`layer_matrices`), stacking the HF matrices `parts`."""
        names = [f"model.layers.{n}.{part}.weight" for part in parts]
        if blocks is None:
            return cat(*names)
        built = blocks.projection((n, key), lambda: cat(*names), bias)
        if take:
            for part in names:
                _discard(tensors, part)
        return built

    def experts(n: int, matrices: dict[str, tuple[str, ...]]) -> ExpertWeights:
        def expert(key: str) -> torch.Tensor | nn.Module:
            return matrix(n, key, matrices[key])

        shared = config.shared_expert_intermediate_size > 0
        return ExpertWeights(
            router=get(f"model.layers.{n}.mlp.gate.weight"),
            gate_up=[expert(f"experts.gate_up.{e}") for e in range(config.num_experts)],
            down=[expert(f"experts.down.{e}") for e in range(config.num_experts)],
            shared_gate_up=expert("experts.shared_gate_up") if shared else None,
            shared_down=expert("experts.shared_down") if shared else None,
            shared_gate=optional(f"model.layers.{n}.mlp.shared_expert_gate.weight", shared),
        )

    layers = []
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        moe = config.is_moe_layer(n)
        matrices = layer_matrices(config, n)
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        o_bias = get(a + "o_proj.bias") if config.o_proj_bias else None
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                post_attention_norm=get(p + "post_attention_layernorm.weight"),
                qkv=matrix(n, "qkv", matrices["qkv"], qkv_bias),
                qkv_bias=qkv_bias,
                o=matrix(n, "o_proj", matrices["o_proj"], o_bias),
                o_bias=o_bias,
                gate_up=None if moe else matrix(n, "gate_up", matrices["gate_up"]),
                down=None if moe else matrix(n, "down", matrices["down"]),
                pre_feedforward_norm=optional(
                    p + "pre_feedforward_layernorm.weight", config.sandwich_norms
                ),
                post_feedforward_norm=optional(
                    p + "post_feedforward_layernorm.weight", config.sandwich_norms
                ),
                q_norm=optional(a + "q_norm.weight", config.qk_norm),
                k_norm=optional(a + "k_norm.weight", config.qk_norm),
                experts=experts(n, matrices) if moe else None,
            )
        )
    tied = config.tie_word_embeddings
    head = None if blocks is None else blocks.head()
    embed: torch.Tensor | nn.Module | None = None
    if head is not None and tied:
        embed = BlockInt8Embedding(head, dtype)  # its rows read from the head's blocks
    elif blocks is not None and not tied:
        embed = blocks.embedding(dtype)
    lm_head: torch.Tensor | nn.Module | None = head
    if head is None and not tied:
        lm_head = get("lm_head.weight")
    if embed is None:
        embed = get("model.embed_tokens.weight")
    if take:  # (those made from the file's own forms: never read as floats)
        _discard(tensors, "model.embed_tokens.weight")
        _discard(tensors, "lm_head.weight")
    return ModelWeights(embed=embed, norm=get("model.norm.weight"), lm_head=lm_head, layers=layers)
