"""Shared helpers of the model tests: tiny random-weight HF models and a driver that runs prompts
through our model in several flat batches over a paged cache."""

from __future__ import annotations

import math
import random

import torch

from sluice.engine.attention import kv_cache_shape
from sluice.engine.model import CausalLM
from sluice.engine.paged_cache import LayerKVCache
from sluice.engine.step_plan import AttentionSpec, StepPlan, build_step_plan

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=101,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that attention is far from uniform and rotary matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(
                    torch.randn(p.shape, generator=g)
                    * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5 * 1.5)
                )


def build(kind: str, **overrides):
    """An eval-mode float32 transformers model of the given family."""
    import transformers as tf

    kw = {**TINY, **overrides}
    if kind == "llama":
        cfg = tf.LlamaConfig(**kw)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**kw)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**{"head_dim": 16, **kw})  # (its default head_dim is 128)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "phi3":
        # (its default token ids are beyond the tiny vocabulary)
        cfg = tf.Phi3Config(**{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **kw})
        model = tf.Phi3ForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, **kw})
        model = tf.MixtralForCausalLM(cfg)
    elif kind == "qwen2_moe":
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        cfg = tf.Qwen2MoeConfig(**{**moe, "shared_expert_intermediate_size": 48, **kw})
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif kind == "qwen3_moe":
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        cfg = tf.Qwen3MoeConfig(**{**moe, "head_dim": 16, "norm_topk_prob": True, **kw})
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind == "olmoe":
        moe = {"num_experts": 4, "num_experts_per_tok": 2}
        cfg = tf.OlmoeConfig(
            **{**moe, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **kw}
        )
        model = tf.OlmoeForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**kw)
        model = tf.MistralForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = tf.Gemma3TextConfig(**{"head_dim": 16, **kw})  # (its default head_dim is 256)
        model = tf.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    randomize(model)
    return model.float().eval()


LENGTHS = [1, 2, 5, 9, 17, 30]
BLOCK = 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def hf_logits(hf, prompts):
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


def hf_greedy_tokens(hf, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from transformers' full forward over the prompt and the tokens so
    far (no cache, no end-of-sequence stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def prompts(vocab: int) -> list[list[int]]:
    """Six prompts of 1 to 40 tokens for the engine tests, the last two sharing a 21-token prefix
    (cached blocks for the second)."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (21,), generator=g).tolist()
    own = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 6, 17, 40)]
    return own + [shared + [4, 5], shared + [7, 8, 9, 10, 11]]


def cpu_families() -> list[str]:
    """The CPU kernel families built here: torch, and native where a C compiler built it."""
    from sluice.engine.kernel_ops import resolve_kernel_ops

    out = ["torch"]
    try:
        resolve_kernel_ops("native", "cpu", False)
        out.append("native")
    except Exception:  # no C compiler: the native family is not built here
        pass
    return out


def make_prompts(vocab, lengths=LENGTHS, seed=0):
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n)] for n in lengths]


def shuffled_tables(lengths, num_blocks, seed=0):
    """Non-contiguous block tables that skip some blocks (block 0 is never used)."""
    g = random.Random(seed)
    free = list(range(1, num_blocks))
    g.shuffle(free)
    free = free[::2] + free[1::2]  # not sorted, with gaps between a seq's blocks
    tables = []
    for n in lengths:
        k = math.ceil(n / BLOCK)
        tables.append(free[:k])
        free = free[k:]
    return tables


def garbage_caches(config, num_blocks, dtype=torch.float32):
    shape = kv_cache_shape(num_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
    g = torch.Generator().manual_seed(1)
    return [
        LayerKVCache(
            torch.randn(shape, generator=g).to(dtype) * 50,
            torch.randn(shape, generator=g).to(dtype) * 50,
        )
        for _ in range(config.num_hidden_layers)
    ]


def plan_for(
    model: CausalLM, caches, query_lens, seq_lens, tables, sliding_window=None
) -> StepPlan:
    """The step's plan on the model's kernels (for each window its layers attend with), as the
    model runner builds it."""
    cache = caches[0]
    layout = build_step_plan(
        query_lens, seq_lens, tables, cache.k.shape[2], cache.k.device, sliding_window
    )
    return model.plan(layout, AttentionSpec.of(model.config, model.dtype, cache))


def step_plan(lengths):
    """Per step, per prompt: how many new tokens (chunk 1 ~ 40%, the rest but one, then one)."""
    plans = []
    for n in lengths:
        first = max(1, (2 * n) // 5)
        second = max(0, n - first - 1)
        third = n - first - second
        plans.append([first, second, third])
    return [[p[s] for p in plans] for s in range(3)]


def run_in_steps(model: CausalLM, prompts, tables, caches, sliding_window=None):
    """Logits for every prompt position, computed over three flat batches through the cache."""
    done = [0] * len(prompts)
    out = [[] for _ in prompts]
    for step in step_plan([len(p) for p in prompts]):
        seqs = [i for i, n in enumerate(step) if n > 0]
        # decodes first, then prefills (the scheduler's order); the model must not care anyway
        seqs.sort(key=lambda i: step[i] != 1)
        ids, pos = [], []
        for i in seqs:
            ids += prompts[i][done[i] : done[i] + step[i]]
            pos += range(done[i], done[i] + step[i])
        plan = plan_for(
            model,
            caches,
            [step[i] for i in seqs],
            [done[i] + step[i] for i in seqs],
            [tables[i] for i in seqs],
            sliding_window,
        )
        assert plan.positions.tolist() == pos
        device = caches[0].k.device
        logits = model.compute_logits(model(torch.tensor(ids, device=device), plan, caches))
        off = 0
        for i in seqs:
            out[i].append(logits[off : off + step[i]])
            off += step[i]
            done[i] += step[i]
    return [torch.cat(o) for o in out]
