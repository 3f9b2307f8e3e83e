"""A step's forward: its new tokens to final-norm hidden states or to logits, by one route chosen
when the model runner is built (`choose_forward`).

- `LayerByLayer`: the step's plan (`step_plan.build_step_plan`, then the kernel family's
  `KernelOps.plan`), the embedding, then `model.CausalLM.forward_embedded`: each decoder layer
  through the family's operations. Every family, every step; the reference for the others.
- `NativeStack`: the same kernels with the same arguments, the decoder layers as one native call
  (`cpu_kernels.decoder_layers`), and a step of decodes only from token ids to the final norm or
  the logits in one (`cpu_kernels.decode_forward`), where the family says so
  (`KernelOps.runs_layer_stack`, `decodes_in_one_call`) and every matmul weight is packed for the
  C kernels. The same bits as layer by layer; what goes is the Python between the kernels.
- `CapturedGraphs`: steps of decodes replayed from CUDA graphs (`captured_decode`), where the
  family's decode steps can be captured (`KernelOps.captures_decode_graphs`) and
  `EngineConfig.cuda_graphs` asks for it.

A route serves the steps it can and passes the others to layer by layer (`NativeStack`: a step
with enough rows that a quantized projection is widened for oneDNN; `CapturedGraphs`: steps with
prefill chunks, or more decodes than the largest graph). A sharded model (tensor parallelism)
runs layer by layer: its ranks add their partial sums between layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .captured_decode import CapturedDecode
from .config import EngineConfig
from .cpu_kernels.decode_forward import (
    EMBED_BLOCKS,
    EMBED_FILE,
    EMBED_ROWS_INT8,
    EMBED_TABLE,
    DecodeForward,
    EmbeddingRows,
)
from .cpu_kernels.decoder_layers import LayerStack
from .cpu_kernels.gguf_to_blocks import TYPE_NUMBERS
from .model import CausalLM
from .paged_cache import LayerKVCache
from .step_plan import AttentionSpec, StepPlan, build_step_plan
from .weights import BlockInt8Embedding, Embedding, FileEmbedding, Int8Embedding

Embed = Callable[[list[int]], torch.Tensor]  # token ids -> embeddings [T, H]


@dataclass
class StepInputs:
    """What one forward takes from the batch scheduler (what every tensor-parallel rank is sent):
    the block copies to make first, then the new tokens of each sequence."""

    token_ids: list[int]  # the flat batch
    query_lens: list[int]  # per sequence: its new tokens
    seq_lens: list[int]  # per sequence: its context after this step
    block_tables: list[list[int]]  # per sequence: the blocks that context is in
    block_copies: list[tuple[int, int]]

    @property
    def decodes_only(self) -> bool:
        """Whether the step has tokens and every sequence adds exactly one."""
        return bool(self.token_ids) and all(n == 1 for n in self.query_lens)


class Forward(ABC):
    """One route from a step's inputs to hidden states or logits."""

    name: ClassVar[str]  # as the start log names it

    @abstractmethod
    def hidden(self, inputs: StepInputs) -> torch.Tensor:
        """The step's tokens (at least one) -> final-norm hidden states [T, H]."""

    @abstractmethod
    def logits(self, inputs: StepInputs, sample: Sequence[bool]) -> torch.Tensor:
        """float32 logits [n, V] of the last token of each sequence with sample[i] (n of them)."""


class LayerByLayer(Forward):
    """The model's layers one by one through its kernel family's operations."""

    name = "layer by layer"

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionSpec,
        kv_caches: Sequence[LayerKVCache],
        embed: Embed,
    ):
        self.model = model
        self.attention = attention
        self.kv_caches = list(kv_caches)
        # (a tensor-parallel runner's: rank 0 broadcasts the embeddings, the workers receive them)
        self.embed = embed

    def plan(self, inputs: StepInputs) -> StepPlan:
        """The step's plan: its layout, and what the family's kernels precompute for it."""
        layout = build_step_plan(
            inputs.query_lens,
            inputs.seq_lens,
            inputs.block_tables,
            self.attention.block_size,
            self.model.device,
            self.model.config.sliding_window,
        )
        return self.model.plan(layout, self.attention)

    def hidden(self, inputs: StepInputs) -> torch.Tensor:
        plan = self.plan(inputs)
        return self.model.forward_embedded(self.embed(inputs.token_ids), plan, self.kv_caches)

    def logits(self, inputs: StepInputs, sample: Sequence[bool]) -> torch.Tensor:
        # the whole step runs whether or not a sequence samples: its tokens' K and V are written
        hidden = self.hidden(inputs)
        last, offset = [], 0
        for n, s in zip(inputs.query_lens, sample):
            offset += n
            if s:
                last.append(offset - 1)
        if not last:
            return torch.empty(
                0, self.model.config.vocab_size, dtype=torch.float32, device=hidden.device
            )
        rows = hidden.index_select(0, torch.tensor(last, device=hidden.device))
        return self.model.compute_logits(rows)


class NativeStack(LayerByLayer):
    """The decoder layers as one native call; a step of decodes only in one call from token ids
    (`decodes`, None where the family sends decodes another way)."""

    name = "native stack"

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionSpec,
        kv_caches: Sequence[LayerKVCache],
        embed: Embed,
        stack: LayerStack,
        decodes: DecodeForward | None,
        widen_from: int | None,
    ):
        super().__init__(model, attention, kv_caches, embed)
        self.stack = stack
        self.decodes = decodes
        # from this many rows a quantized projection is widened for oneDNN (`widen_probe`), which
        # the C stack does not do: such steps go layer by layer
        self.widen_from = widen_from

    def _stacked(self, inputs: StepInputs) -> bool:
        return self.widen_from is None or len(inputs.token_ids) < self.widen_from

    def hidden(self, inputs: StepInputs) -> torch.Tensor:
        if not self._stacked(inputs):
            return super().hidden(inputs)
        if self.decodes is not None and inputs.decodes_only:
            return self._decodes(inputs, logits=False)
        plan = self.plan(inputs)
        x = self.embed(inputs.token_ids)
        rope = self.model.ops.rotary_tables(self.model.rotary, plan.positions, x.dtype)
        x, residual = self.stack.run(x, plan, self.kv_caches, rope)
        return self.model.final_norm(x, residual)

    def logits(self, inputs: StepInputs, sample: Sequence[bool]) -> torch.Tensor:
        head = self.decodes is not None and self.decodes.head is not None
        if head and inputs.decodes_only and all(sample) and self._stacked(inputs):
            return self._decodes(inputs, logits=True).float()
        return super().logits(inputs, sample)

    def _decodes(self, inputs: StepInputs, logits: bool) -> torch.Tensor:
        assert self.decodes is not None
        return self.decodes.run(
            inputs.token_ids,
            inputs.seq_lens,
            inputs.block_tables,
            self.kv_caches,
            self.attention.block_size,
            self.model.config.sliding_window,
            self.model.rotary.table(max(inputs.seq_lens)),
            logits,
        )


class CapturedGraphs(LayerByLayer):
    """Steps of decodes replayed from CUDA graphs (`captured`); other steps layer by layer."""

    name = "captured graphs"

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionSpec,
        kv_caches: Sequence[LayerKVCache],
        embed: Embed,
        captured: CapturedDecode,
    ):
        super().__init__(model, attention, kv_caches, embed)
        self.captured = captured

    def logits(self, inputs: StepInputs, sample: Sequence[bool]) -> torch.Tensor:
        if inputs.decodes_only and all(sample):
            logits = self.captured.logits(inputs.token_ids, inputs.seq_lens, inputs.block_tables)
            if logits is not None:
                return logits
        return super().logits(inputs, sample)


def choose_forward(
    model: CausalLM,
    attention: AttentionSpec,
    kv_caches: Sequence[LayerKVCache],
    embed: Embed,
    engine_config: EngineConfig,
) -> Forward:
    """The route for this model, its kernel family and the engine's configuration (the module's
    docstring). Call it once the weights are in their final form and the family's widening
    measured (`KernelOps.widen_rows`)."""
    ops = model.ops
    if model.sharded:
        return LayerByLayer(model, attention, kv_caches, embed)
    if engine_config.cuda_graphs and ops.captures_decode_graphs:
        captured = CapturedDecode(
            model,
            attention,
            kv_caches,
            engine_config.max_num_seqs,
            engine_config.max_model_len or model.config.max_position_embeddings,
        )
        return CapturedGraphs(model, attention, kv_caches, embed, captured)
    # the C stack implements the plain Llama layer alone
    stacked = model.config.plain_layers and ops.runs_layer_stack(attention)
    stack = LayerStack.of(model.layers) if stacked else None
    if stack is None:
        return LayerByLayer(model, attention, kv_caches, embed)
    rows = embedding_rows(model) if ops.decodes_in_one_call else None
    decodes = DecodeForward(model, stack, rows) if rows is not None else None
    widen_from = min(ops.widen_rows.values(), default=None)
    return NativeStack(model, attention, kv_caches, embed, stack, decodes, widen_from)


def embedding_rows(model: CausalLM) -> EmbeddingRows | None:
    """The model's token table as the one-call decode reads it, or None where it is in none of
    those forms: a table in the model's type, rows of a packed int8 head (`BlockInt8Embedding`),
    int8 rows with a float32 scale each (`Int8Embedding`), a GGUF tensor's own blocks
    (`FileEmbedding`)."""
    embed = model.embed_tokens
    if isinstance(embed, BlockInt8Embedding) and embed.dtype == model.dtype:
        packed = embed.packed
        return EmbeddingRows(EMBED_BLOCKS, packed.data, None, packed.n, packed.fmt)
    if isinstance(embed, FileEmbedding) and embed.dtype == model.dtype:
        number = TYPE_NUMBERS[embed.type_name]
        return EmbeddingRows(EMBED_FILE, embed.data, None, embed.shape[0], number)
    if isinstance(embed, Embedding) and embed.weight.dtype == model.dtype:
        weight = embed.weight
        if weight.is_contiguous():
            return EmbeddingRows(EMBED_TABLE, weight, None, weight.shape[0])
    if (
        isinstance(embed, Int8Embedding)
        and embed.dtype == model.dtype
        and embed.qweight.is_contiguous()
        and embed.scale.dtype == torch.float32
        and embed.scale.dim() == 1
        and embed.scale.is_contiguous()
    ):
        return EmbeddingRows(EMBED_ROWS_INT8, embed.qweight, embed.scale, embed.qweight.shape[0])
    return None
