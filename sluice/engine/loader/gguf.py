"""GGUF files (llama.cpp's format): hyperparameters from metadata, and tensors read from the file's
memory map when the model builder asks for them (`lazy_tensors`): dequantized with numpy, or a
layer's 4-bit matrix as its own blocks (`gguf_blocks`) for int4 weights, never dequantized.

GGUF names map to HF names; llama-family files store the Q and K projection rows permuted for
llama.cpp's interleaved rotary, which `unpermute_qk` undoes (Qwen2 and Gemma 3 files use the HF
layout already). llama.cpp's converter stores Gemma's norm weights as the scale itself (1 + the
HF weight), which `load_gguf` turns back into HF's form.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from ..config import ModelConfig, gemma3_fields, gemma3_layer_kinds, torch_dtype
from ..cpu_kernels.gguf_to_blocks import (
    INT8_TYPES,
    Q5_TYPES,
    gguf_int4_blocks,
    gguf_int8_blocks,
    gguf_q5_blocks,
    gguf_q6_blocks,
)
from ..errors import ModelError
from .gguf_blocks import (
    FOUR_BIT_TYPES,
    BlockForm,
    Int4Blocks,
    Int8Blocks,
    Q5Blocks,
    Q6Blocks,
    StoredRows,
    WideBlocks,
    int4_blocks,
)
from .lazy_tensors import LazyMapping, LazyTensors, SharedRead
from .tensor_names import check_tensors, stored_parts

if TYPE_CHECKING:
    from .gguf_file import GGUFFile

# Types we dequantize (through gguf.quants, checked against our own block decoders in the tests).
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
ROWS_AT_A_TIME = 8192  # of a large matrix, dequantized at a time

ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
}
# A "llama" file with experts is Mixtral's
LLAMA_WITH_EXPERTS = "mixtral"
# llama.cpp renormalizes the chosen experts' weights for these (as Mixtral and Qwen3-MoE do)
RENORMALIZED_EXPERTS = {"llama", "qwen3moe"}
# llama.cpp's converter permutes Q/K rows for these architectures only
PERMUTED_QK = {"llama"}
# ... and stores RMSNorm weights with Gemma's 1 added for these
NORMS_PLUS_ONE = {"gemma3"}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# A mixture of experts' router and experts (each kind of matrix stacked over the experts,
# `tensor_names.stored_parts`), and Qwen2-MoE's shared expert
_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma's layer has four norms and QK-norm; its ffn_norm is the MLP input's norm
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **_QK_NORM_NAMES,
}
# Phi-3 stores q/k/v as one matrix, and gate/up as one under ffn_up (`tensor_names.fused_parts`)
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_LAYER_NAMES_BY_ARCHITECTURE = {
    "gemma3": _GEMMA3_LAYER_NAMES,
    "qwen3": {**_LAYER_NAMES, **_QK_NORM_NAMES},
    "phi3": _PHI3_LAYER_NAMES,
    "llama": {**_LAYER_NAMES, **_EXPERT_NAMES},
    "qwen2moe": {**_LAYER_NAMES, **_EXPERT_NAMES},
    "qwen3moe": {**_LAYER_NAMES, **_QK_NORM_NAMES, **_EXPERT_NAMES},
    "olmoe": {**_LAYER_NAMES, **_QK_NORM_NAMES, **_EXPERT_NAMES},
}
# llama.cpp's LongRoPE factors (Phi-3's 128k-context files), which sluice does not apply
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's Gemma 3 constants where the file carries no metadata of its own
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62  # whose queries are scaled by (hidden / heads)**-0.5, not head_dim**-0.5
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """HF tensor name for a GGUF tensor name of a file of `architecture` (GGUF's name for it;
    None for tensors the model does not use)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    layer_names = _LAYER_NAMES_BY_ARCHITECTURE.get(architecture, _LAYER_NAMES)
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: within each head, rows (j, i) interleaved -> (i, j)
    halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF layout -> GGUF layout); the tests use it to
    round-trip."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_type(tensor: Any, source: str) -> None:
    name = tensor.tensor_type.name
    if name not in SUPPORTED_TYPES:
        raise ModelError(
            f"{source}: tensor {tensor.name!r} has unsupported quantization type {name}; "
            f"supported: {', '.join(SUPPORTED_TYPES)}",
            field=tensor.name,
        )


def dequantize(tensor: Any, source: str = "gguf") -> np.ndarray:
    """A `gguf.ReaderTensor` -> float32 array in numpy (row-major, HF) order."""
    import gguf

    _check_type(tensor, source)
    qtype = tensor.tensor_type
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
    data = np.asarray(tensor.data)
    if len(shape) != 2 or shape[0] <= ROWS_AT_A_TIME or data.ndim != 2:
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(shape)
    # A vocabulary matrix, a slice of rows at a time: whole, gguf's float temporaries would be a
    # few times its float32 size.
    out = np.empty(shape, dtype=np.float32)
    for start in range(0, shape[0], ROWS_AT_A_TIME):
        rows = data[start : start + ROWS_AT_A_TIME]
        out[start : start + len(rows)] = gguf.quants.dequantize(rows, qtype).reshape(len(rows), -1)
    return out


class _Meta:
    def __init__(self, reader, source: str):
        self.reader, self.source = reader, source

    def get(self, key: str, default=None):
        return self.reader.fields.get(key, default)

    def need(self, key: str):
        v = self.get(key)
        if v is None:
            raise ModelError(f"{self.source}: missing metadata field {key!r}", field=key)
        return v


def read_config(reader: GGUFFile, source: str) -> tuple[ModelConfig, str]:
    m = _Meta(reader, source)
    gguf_arch = m.need("general.architecture")
    if gguf_arch not in ARCHITECTURES:
        raise ModelError(
            f"{source}: unknown architecture {gguf_arch!r} in field 'general.architecture'; "
            f"supported: {sorted(ARCHITECTURES)}",
            field="general.architecture",
        )
    if (m.get("split.count") or 1) > 1:
        raise ModelError(
            f"{source}: split GGUF files are not supported; merge them first", field="split.count"
        )
    a = gguf_arch
    names = {t.name: t for t in reader.tensors}
    heads = int(m.need(f"{a}.attention.head_count"))
    kv = m.get(f"{a}.attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer list in some files; we need it uniform
        if len(set(kv)) != 1:
            raise ModelError(
                f"{source}: per-layer head_count_kv differs", field=f"{a}.attention.head_count_kv"
            )
        kv = kv[0]
    hidden = int(m.need(f"{a}.embedding_length"))
    head_dim = int(m.get(f"{a}.attention.key_length") or hidden // heads)
    rot = m.get(f"{a}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelError(
            f"{source}: partial rotary (rope.dimension_count={rot}) is not supported",
            field=f"{a}.rope.dimension_count",
        )

    embd = names.get("token_embd.weight")
    vocab = m.get(f"{a}.vocab_size") or (int(embd.shape[1]) if embd is not None else None)
    if vocab is None:
        tokens = m.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else None
    if vocab is None:
        raise ModelError(f"{source}: cannot tell the vocabulary size", field=f"{a}.vocab_size")

    rope_scaling = None
    kind = m.get(f"{a}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        rope_scaling = {"rope_type": kind, "factor": float(m.need(f"{a}.rope.scaling.factor"))}
        orig = m.get(f"{a}.rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    elif kind not in (None, "none"):
        raise ModelError(
            f"{source}: unsupported rope scaling {kind!r}", field=f"{a}.rope.scaling.type"
        )
    for name in _LONGROPE_TENSORS:
        if name in names:
            raise ModelError(
                f"{source}: LongRoPE scaling (tensor {name!r}) is not supported", field=name
            )
    if "rope_freqs.weight" in names:  # llama3-style scaling baked into per-frequency divisors
        if rope_scaling is not None:
            raise ModelError(
                f"{source}: rope_freqs together with rope.scaling.type", field="rope_freqs.weight"
            )
        factors = dequantize(names["rope_freqs.weight"], source).reshape(-1)
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}

    eos = [
        m.get(k)
        for k in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
    ]
    config = ModelConfig(
        architecture=ARCHITECTURES[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(m.need(f"{a}.feed_forward_length")),
        num_hidden_layers=int(m.need(f"{a}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv),
        head_dim=head_dim,
        rms_norm_eps=float(m.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m.get(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(m.get(f"{a}.context_length") or 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )
    if gguf_arch == "gemma3":
        config = _gemma3_config(config, m)
    elif gguf_arch in ("qwen3", "qwen3moe"):
        config = replace(config, qk_norm=True)
    elif gguf_arch == "olmoe":  # (its q and k normed whole, over all heads)
        config = replace(config, qk_norm=True, qk_norm_whole=True)
    elif gguf_arch == "phi3":
        window = m.get(f"{a}.attention.sliding_window")
        config = replace(config, sliding_window=int(window) if window else None)
    if m.get(f"{a}.expert_count"):
        config = _experts_config(config, m, gguf_arch, names)
    return config, gguf_arch


def _experts_config(
    config: ModelConfig, m: _Meta, gguf_arch: str, names: dict[str, Any]
) -> ModelConfig:
    """A mixture of experts' fields: its layers with a router are the mixtures (Mixtral's file
    is a "llama" one with experts)."""
    a = gguf_arch
    experts = int(m.need(f"{a}.expert_count"))
    top_k = int(m.need(f"{a}.expert_used_count"))
    if not 0 < top_k <= experts:
        raise ModelError(
            f"{m.source}: {a}.expert_used_count={top_k} must be between 1 and the {experts} "
            "experts",
            field=f"{a}.expert_used_count",
        )
    layers = config.num_hidden_layers
    return replace(
        config,
        architecture=LLAMA_WITH_EXPERTS if a == "llama" else config.architecture,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(
            m.get(f"{a}.expert_feed_forward_length") or config.intermediate_size
        ),
        norm_topk_prob=a in RENORMALIZED_EXPERTS or bool(m.get(f"{a}.expert_weights_norm")),
        shared_expert_intermediate_size=int(m.get(f"{a}.expert_shared_feed_forward_length") or 0),
        dense_layers=tuple(n for n in range(layers) if f"blk.{n}.ffn_gate_inp.weight" not in names),
    )


def _gemma3_config(config: ModelConfig, m: _Meta) -> ModelConfig:
    """Gemma 3's local and global layers, as llama.cpp runs the file: every
    sliding_window_pattern-th layer global (6 where the file does not say), the local layers'
    rotary theta 10000 (where the file does not say), queries scaled by head_dim**-0.5 except in
    the 27B model."""
    a = "gemma3"
    layers = config.num_hidden_layers
    pattern = int(m.get(f"{a}.attention.sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN)
    window = m.get(f"{a}.attention.sliding_window")
    query_scalar = config.head_dim
    if layers == GEMMA3_27B_LAYERS:
        query_scalar = config.hidden_size // config.num_attention_heads
    cap = m.get(f"{a}.final_logit_softcapping")
    return replace(
        config,
        hidden_act="gelu_pytorch_tanh",
        max_position_embeddings=int(m.get(f"{a}.context_length") or 131072),
        **gemma3_fields(
            config.hidden_size,
            gemma3_layer_kinds(layers, pattern),
            int(window) if window else None,
            float(m.get(f"{a}.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_THETA),
            float(query_scalar),
            float(cap) if cap else None,
        ),
    )


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's header (`gguf_file.GGUFFile`); a ModelError naming the file where it cannot
    be read."""
    from .gguf_file import GGUFFile, GGUFFormatError

    try:
        return GGUFFile(path)
    except (OSError, GGUFFormatError) as e:
        raise ModelError(f"{path}: cannot read GGUF file: {e}", field="model") from e


def _qk_heads(name: str, config: ModelConfig, gguf_arch: str) -> int | None:
    """The heads whose rows llama.cpp permuted in a tensor of this name (None: not permuted)."""
    if gguf_arch not in PERMUTED_QK:
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_attention_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_key_value_heads
    return None


Blocks = TypeVar("Blocks", bound=BlockForm)


def _read_blocks(
    blocks_of: Callable[[np.ndarray, str, tuple[int, int]], Blocks],
    t: Any,
    name: str,
    config: ModelConfig,
    gguf_arch: str,
) -> Blocks:
    """A matrix's blocks read from the file's bytes by the native code (`gguf_to_blocks`:
    `blocks_of` is `int4_blocks_of` or `int8_blocks_of` below), in HF's row order (read only for
    the native kernels)."""
    k, n = (int(d) for d in t.shape)
    stored = blocks_of(np.asarray(t.data), t.tensor_type.name, (n, k))
    heads = _qk_heads(name, config, gguf_arch)
    if heads is not None:
        stored = stored.rows_permuted(lambda a: unpermute_qk(a, heads))
    return stored


def _rows(read: Callable[[], torch.Tensor], index: slice | int) -> torch.Tensor:
    return read()[index]


def _reshaped(read: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    return read().reshape(shape)


def _block_rows(read: Callable[[], Blocks], rows: slice) -> Blocks:
    return read().rows(rows)


def _read_expert_blocks(
    blocks_of: Callable[[np.ndarray, str, tuple[int, int]], Blocks], t: Any, expert: int
) -> Blocks:
    """One expert's matrix of a tensor stacking a layer's experts, as `_read_blocks` reads a
    matrix (experts' rows are never permuted)."""
    k, n, _ = (int(d) for d in t.shape)
    return blocks_of(np.asarray(t.data)[expert], t.tensor_type.name, (n, k))


def int4_blocks_of(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Blocks:
    return Int4Blocks(*gguf_int4_blocks(raw, type_name, shape))


def int8_blocks_of(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> WideBlocks:
    """A matrix stored wider than 4 bits as the kernels read it: the 5-bit types' and Q6_K's own
    blocks, the other types' as int8 blocks."""
    if type_name == "Q6_K":
        return Q6Blocks(*gguf_q6_blocks(raw, shape))
    if type_name in Q5_TYPES:
        return Q5Blocks(*gguf_q5_blocks(raw, type_name, shape))
    return Int8Blocks(*gguf_int8_blocks(raw, type_name, shape))


def _read_tensor(
    t: Any, name: str, config: ModelConfig, gguf_arch: str, target: torch.dtype, source: str
) -> torch.Tensor:
    """A tensor's values in HF's form and `target` dtype, read from the file now."""
    if t.tensor_type.name in ("Q4_0", "Q4_1") and len(t.shape) == 2:
        # the same float32 values as gguf's dequantization (d q + m; Q4_0's m = -8 d is exact,
        # only its zeros may be +0 where gguf's are -0), in half its time
        k, n = (int(d) for d in t.shape)
        w = int4_blocks(np.asarray(t.data), t.tensor_type.name, (n, k)).values()
    else:
        w = dequantize(t, source)
    heads = _qk_heads(name, config, gguf_arch)
    if heads is not None:
        w = unpermute_qk(w, heads)
    if gguf_arch in NORMS_PLUS_ONE and name.endswith("norm.weight"):
        w = w - 1.0  # back to HF's weight, which the norm adds 1 to
    w = np.asarray(w, dtype=np.float32)
    if not (w.flags.c_contiguous and w.flags.writeable):  # F32 tensors view the file's map
        w = np.array(w, order="C")
    return torch.from_numpy(w).to(target)


def load_gguf(path: Path, dtype: Any = None, load_tokenizer: bool = True):
    from .loaded import LoadedModel

    source = str(path)
    reader = open_gguf(source)
    config, gguf_arch = read_config(reader, source)
    target = torch.float32 if dtype is None else torch_dtype(dtype)

    tensors, types = LazyTensors(), {}
    blocks: LazyMapping[Int4Blocks] = LazyMapping()
    int8: LazyMapping[WideBlocks] = LazyMapping()
    rows: dict[str, StoredRows] = {}
    for t in reader.tensors:
        name = hf_name(t.name, gguf_arch)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        _check_type(t, source)
        type_name = t.tensor_type.name
        read_values: Callable[[], torch.Tensor] = partial(
            _read_tensor, t, name, config, gguf_arch, target, source
        )
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, *shape)  # (llama.cpp keeps Qwen2-MoE's [1, H] gate as a vector)
            read_values = partial(_reshaped, read_values, shape)
        # a fused matrix's parts, or a layer's stacked experts, each as a tensor of its own
        parts = stored_parts(config, name, shape[0], source)
        read_int4: Callable[[], Int4Blocks] = partial(
            _read_blocks, int4_blocks_of, t, name, config, gguf_arch
        )
        read_int8: Callable[[], WideBlocks] = partial(
            _read_blocks, int8_blocks_of, t, name, config, gguf_arch
        )
        if len(parts) > 1:  # each part's read takes its rows of one read of the whole
            read_values = SharedRead(read_values, len(parts))
            read_int4 = SharedRead(read_int4, len(parts))
            read_int8 = SharedRead(read_int8, len(parts))
        for part, index in parts:
            values, int4, int8_part = read_values, read_int4, read_int8
            part_shape = shape
            if isinstance(index, int):  # one expert of a stacked tensor
                part_shape = shape[1:]
                values = partial(_rows, read_values, index)
                int4 = partial(_read_expert_blocks, int4_blocks_of, t, index)
                int8_part = partial(_read_expert_blocks, int8_blocks_of, t, index)
            elif index is not None:  # a run of a fused matrix's rows
                part_shape = (index.stop - index.start, *shape[1:])
                values = partial(_rows, read_values, index)
                int4 = partial(_block_rows, read_int4, index)
                int8_part = partial(_block_rows, read_int8, index)
            tensors.add_tensor(part, part_shape, target, values)
            if len(part_shape) != 2:  # (the block readers read matrices)
                continue
            if t.name.startswith("blk.") and part.endswith("_proj.weight"):
                types[part] = type_name
                if type_name in FOUR_BIT_TYPES:
                    blocks.add(part, int4)
            if type_name in INT8_TYPES + Q5_TYPES:
                int8.add(part, int8_part)
        if len(shape) == 2 and type_name in INT8_TYPES and name == "model.embed_tokens.weight":
            rows[name] = StoredRows(source, t.offset, t.data.nbytes, type_name, shape)
    check_tensors(config, tensors, source)

    tokenizer = None
    if load_tokenizer:
        from ..tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(reader, source)
    return LoadedModel(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        source=source,
        int4_blocks=blocks,
        int8_blocks=int8,
        stored_rows=rows,
        stored_types=types,
    )
