"""The engine section of bench/gpu.py: LLMEngine decode on a Llama-3-8B-shaped model of random
weights, one variant (kernels, quantization, KV cache dtype) at a time, timed against the HBM bound.

sluice's engine modules are imported inside the functions, not here: bench/gpu.py must settle
TRITON_INTERPRET before anything imports a Triton kernel."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import traceback

import torch

from bench.gpu_common import Ctx, MissingKernel, cuda_healthy, log

ENGINE_VARIANTS = {  # name -> EngineConfig fields
    "triton": {"kernels": "triton"},
    # decode steps captured per batch size and replayed (its buckets up to the largest batch run)
    "graphs": {"kernels": "triton", "cuda_graphs": True, "max_num_seqs": 64},
    "torch": {"kernels": "torch"},
    "int8": {"kernels": "triton", "quantization": "int8"},
    "kv-fp8": {"kernels": "triton", "kv_cache_dtype": "fp8"},
    "kv-int8": {"kernels": "triton", "kv_cache_dtype": "int8"},
    # fixed-order matmuls, every token through the decode attention kernel (what the mode costs)
    "deterministic": {"kernels": "triton", "deterministic": True},
}
DEFAULT_ENGINE_VARIANTS = ("triton", "graphs", "torch", "int8", "kv-fp8", "deterministic")
SMOKE_ENGINE_VARIANTS = ("triton", "torch", "int8", "kv-int8")  # fp8 KV caches are CUDA-only


def llama3_8b_config(smoke: bool):
    from sluice.engine.config import ModelConfig

    if smoke:
        return ModelConfig(
            architecture="llama",
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=None,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            attention_bias=False,
            bos_token_id=None,
            eos_token_ids=(0,),
        )
    return ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    )


def random_loaded_model(config, device: torch.device, dtype: torch.dtype, seed: int):
    """A LoadedModel of random HF-named tensors made directly on the device (same seed: same
    weights), std 0.02 for matrices, ~1 for norm weights."""
    from sluice.engine.loader import LoadedModel
    from sluice.engine.loader.tensor_names import expected_shapes

    g = torch.Generator(device=device)
    g.manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.normal_(1.0, 0.05, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
        tensors[name] = t
    return LoadedModel(
        config=config, tensors=tensors, tokenizer=None, source="random Llama-3-8B-shaped weights"
    )


def bytes_read_per_step(model, batch: int) -> dict:
    """Weights a decode step reads: every parameter and buffer once (shared ones counted once),
    except the embedding table (only `batch` of its rows) and the rotary tables (a few rows)."""
    seen, total, embed = set(), 0, 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_mkldnn:
            key, nbytes = id(t), t.numel() * t.element_size()
        else:
            key, nbytes = (t.data_ptr(), t.numel()), t.numel() * t.element_size()
        if key in seen:
            continue
        seen.add(key)
        if "rotary" in name or "inv_freq" in name or "cos" in name or "sin" in name:
            continue
        if name.startswith("embed_tokens."):
            embed += nbytes
            continue
        total += nbytes
    # a tied head reads the whole table anyway: then it was counted under the head's name already
    rows = batch * model.config.hidden_size * 2
    return {"weights": total + min(rows, embed), "embedding_table": embed}


def engine_config_for(ctx: Ctx, variant: str, kv_bytes: int):
    from sluice.engine.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    want = dict(ENGINE_VARIANTS[variant])
    missing = [k for k in want if k not in fields]
    if missing:
        raise MissingKernel(f"EngineConfig has no field {', '.join(missing)}")
    return EngineConfig(
        device=str(ctx.device),
        dtype="bfloat16",
        kv_cache_bytes=kv_bytes,
        max_num_batched_tokens=2048 if not ctx.smoke else 256,
        **want,
    )


def engine_variant(
    ctx: Ctx,
    variant: str,
    batches: tuple[int, ...],
    prompt_len: int,
    steps: int,
    warm: int,
    tokens_seen: dict,
) -> list[dict]:
    from sluice.engine import LLMEngine

    cfg = llama3_8b_config(ctx.smoke)
    per_token = cfg.kv_bytes_per_token(2)
    max_tokens = warm + steps + 24
    kv_bytes = int(1.25 * max(batches) * (prompt_len + max_tokens + 32) * per_token) + (8 << 20)
    econf = engine_config_for(ctx, variant, kv_bytes)
    gc.collect()  # what an earlier variant (or its failure) left behind
    if ctx.cuda:
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    engine = LLMEngine(
        config=econf, loaded=random_loaded_model(cfg, ctx.device, torch.bfloat16, ctx.seed)
    )
    ctx.sync()
    build_s = time.perf_counter() - t0
    log(f"  engine {variant}: built in {build_s:.1f} s (kernels {getattr(engine, 'kernels', '?')})")
    rows = []
    try:
        model = engine.runner.model
        kv_per_token = sum(
            c.nbytes if hasattr(c, "nbytes") else sum(t.numel() * t.element_size() for t in c)
            for c in engine.runner.kv_caches
        ) / max(1, engine.runner.num_blocks * econf.block_size)
        for batch in batches:
            if ctx.time_left() < (2 if ctx.smoke else 10):
                rows.append(
                    {"variant": variant, "batch": batch, "status": "skipped", "why": "budget"}
                )
                continue
            row = {
                "variant": variant,
                "batch": batch,
                "build_s": build_s,
                "kernels": getattr(engine, "kernels", None),
                "config": ENGINE_VARIANTS[variant],
            }
            try:
                row.update(
                    decode_run(
                        ctx, engine, batch, prompt_len, steps, warm, max_tokens, cfg.vocab_size
                    )
                )
            except Exception as e:  # noqa: BLE001
                row.update(
                    status="error",
                    why=f"{type(e).__name__}: {e}",
                    traceback=traceback.format_exc(limit=8),
                )
                rows.append(row)
                if not cuda_healthy(ctx.device):
                    raise
                continue
            w = bytes_read_per_step(model, batch)
            kv_read = row["mean_context"] * batch * kv_per_token
            row.update(
                weight_bytes=w["weights"],
                embedding_table_bytes=w["embedding_table"],
                kv_read_bytes=kv_read,
            )
            if ctx.copy_gbs:
                row["bound_w_ms"] = w["weights"] / ctx.copy_gbs / 1e6
                row["bound_ms"] = (w["weights"] + kv_read) / ctx.copy_gbs / 1e6
                row["x_bound"] = row["ms_per_step"] / row["bound_ms"]
                row["x_bound_w"] = row["ms_per_step"] / row["bound_w_ms"]
                if ctx.read_gbs:
                    row["bound_read_bw_ms"] = (w["weights"] + kv_read) / ctx.read_gbs / 1e6
            first = row.pop("first_tokens")
            if variant == "triton":
                tokens_seen[batch] = first
            elif batch in tokens_seen and variant in ("torch", "graphs"):
                ref = tokens_seen[batch]
                # greedy rows: token 1 comes from the prefill, token 2 from the first decode step
                pairs = list(zip(first, ref))[::2]
                same1 = sum(a[:1] == b[:1] for a, b in pairs)
                same2 = sum(a[:2] == b[:2] for a, b in pairs)
                row["greedy_agree_with_triton"] = {
                    "token1": same1 / len(pairs),
                    "tokens1_2": same2 / len(pairs),
                }
                row["note"] = (
                    f"greedy tokens = triton's: 1st {same1}/{len(pairs)}, "
                    f"1st+2nd {same2}/{len(pairs)}"
                )
            rows.append(row)
            log(
                f"  engine {variant} batch {batch}: {row['ms_per_step']:.2f} ms/step"
                + (f", {row['x_bound']:.2f}x the bound" if "x_bound" in row else "")
            )
    finally:
        del engine
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
    return rows


def decode_run(
    ctx: Ctx,
    engine,
    batch: int,
    prompt_len: int,
    steps: int,
    warm: int,
    max_tokens: int,
    vocab: int,
) -> dict:
    """`batch` random prompts through prefill, then `warm` + `steps` decode steps of the whole
    batch; per-step wall time (the step returns token ids to the host, so it ends synchronized)."""
    from sluice.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(ctx.seed + batch)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def params(i: int) -> SamplingParams:
        """Even rows greedy (comparable across variants), odd rows sampled (the sampling kernel)."""
        if i % 2 == 0:
            return greedy
        return SamplingParams(
            temperature=0.8,
            top_p=0.95,
            top_k=50,
            seed=ctx.seed + i,
            max_tokens=max_tokens,
            ignore_eos=True,
        )

    ids = [
        engine.add_request(f"d{batch}-{i}-{ctx.counter}", prompt_token_ids=p, params=params(i))
        for i, p in enumerate(prompts)
    ]
    ctx.counter += 1
    produced = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    prefill_steps = 0
    try:
        while any(not v for v in produced.values()):
            for out in engine.step():
                if out.request_id in produced:
                    produced[out.request_id] += out.new_token_ids
            prefill_steps += 1
            if prefill_steps > 1000:
                raise RuntimeError("prefill did not finish in 1000 steps")
        ctx.sync()
        prefill_s = time.perf_counter() - t0
        times, ctx_sum, budget_cut = [], 0, False
        for i in range(warm + steps):
            if i >= warm and ctx.time_left() < 0 and len(times) >= 8:
                budget_cut = True
                break
            ctx.sync()
            t = time.perf_counter()
            outs = engine.step()
            ctx.sync()
            dt = time.perf_counter() - t
            n_new = 0
            for out in outs:
                if out.request_id in produced:
                    produced[out.request_id] += out.new_token_ids
                    n_new += len(out.new_token_ids)
            if n_new != batch:
                raise RuntimeError(f"a decode step produced {n_new} tokens for a batch of {batch}")
            if i >= warm:
                times.append(dt)
                ctx_sum += sum(prompt_len + len(v) for v in produced.values())
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.step()  # collect the aborted requests' finals
    med = statistics.median(times)
    return {
        "status": "ok",
        "prompt_len": prompt_len,
        "prefill_steps": prefill_steps,
        "prefill_s": prefill_s,
        "steps_timed": len(times),
        "ms_per_step": 1e3 * med,
        "ms_per_step_mean": 1e3 * statistics.fmean(times),
        "ms_per_step_min": 1e3 * min(times),
        "tok_s": batch / med,
        "mean_context": ctx_sum / max(1, len(times)) / batch,
        "budget_cut": budget_cut,
        "first_tokens": [v[:4] for v in produced.values()],
    }
