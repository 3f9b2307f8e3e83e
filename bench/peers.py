"""sluice against llama.cpp on this CPU, at the same weights, in one run.

    .venv/bin/pip install -e '.[peers]'      # llama-cpp-python, compiled here from source (~7 min)
    .venv/bin/python -m bench.peers            # 64 requests x 128 tokens; a single request
    .venv/bin/python -m bench.peers --quick    # a smaller version, a few minutes
    .venv/bin/python -m bench.peers --rounds 3 # every configuration 3 times in turn: medians
    .venv/bin/python -m bench.peers --model qwen2.5-coder-1.5b --quick   # a catalog model's file
    .venv/bin/python -m bench.peers --table-from bench/results/peers.json

llama.cpp's default build (-march=native) suits most CPUs. On a CPU with AMX, its AMX path died
with SIGSEGV repacking this model's Q8_0 and Q4_1 tensors (llama-cpp-python 0.3.36, an Intel Xeon
with AMX-INT8); there, build it with its other vector paths and without AMX (the flags below are
that Xeon's: one is AVX-VNNI, which AMD Zen 4 lacks, and such a build dies there by SIGILL):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
      .venv/bin/pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36

A phase whose process dies is reported as not measured and the others still run.

Weights: the default model's GGUF (SmolLM2-135M: Q4_1, with a Q8_0 embedding) and what llama.cpp's
own quantizer (`llama_model_quantize`, requantizing allowed) makes of it: F32, BF16 and Q8_0 files,
written once under bench/results/peers-models. All hold the same weights: F32 is the Q4_1 file's
values exactly, BF16 and Q8_0 are llama.cpp's rounding of those.

Engines, each phase in its own subprocess (its own peak memory), one after the other:
  llama.cpp  through llama-cpp-python's bindings to its C API: the batched API with one sequence a
             request (prompts packed into batches of --n-batch tokens, then every live sequence
             one token a decode call; a KV stream a sequence), greedy by argmax of its logits; on
             each of F32, BF16, Q8_0 and Q4_1. llama.cpp's server (continuous batching) is not
             part of llama-cpp-python's build, so it is not run here.
  sluice     LLMEngine (bench/engine_throughput.py's sluice phase): float32 on F32, bfloat16 on
             BF16, --quantization int8 on F32 with float32 and with bfloat16 activations (its
             int8 codes are llama.cpp's Q8_0 codes of those weights: `quantize_blocks`), and
             --quantization int4 on Q4_1 (4-bit blocks by llama.cpp's Q4_1 rule, of the file's
             own 4-bit values; the LM head int8, as the file's is Q8_0).

With --model NAME (a catalog model, `sluice models list`, or a GGUF path) both engines run that
one file as stored instead: llama.cpp as it loads it, sluice with its defaults (`--quantization
auto`: the file's 4-bit layers as stored, its wider ones in int8; `--dtype auto`).

Both sides get the same seeded random prompt ids and produce exactly --output-len tokens each (no
EOS). Reported: output tokens/s of the whole workload (prefill included), the single request's
median ms/token, peak RSS, and greedy agreement: the share of each request's tokens before its
first difference from sluice float32's, averaged (1.0 = the same text). Ratios are against
llama.cpp's best in the same round. A shared machine's speed drifts within minutes (the same
lone-request run measured 3.9 and 4.9 ms/token a quarter of an hour apart), so with --rounds N
every configuration runs N times in turn, each ratio is taken within a round, and the table
gives the medians and each ms/token ratio's range. Writes bench/results/peers.json and prints a
table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import engine_throughput as et
from bench.cpu_meter import Timed
from sluice.engine import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "peers.json"
MODELS = ROOT / "bench" / "results" / "peers-models"
FORMATS = ("F32", "BF16", "Q8_0", "Q4_1")
# sluice's configurations: (name, weights file, dtype, quantization)
SLUICE = (
    ("float32", "F32", "float32", None),
    ("bfloat16", "BF16", "bfloat16", None),
    ("int8 (float32 act.)", "F32", "float32", "int8"),
    ("int8 (bfloat16 act.)", "F32", "bfloat16", "int8"),
    ("int4 (float32 act.)", "Q4_1", "float32", "int4"),
    ("int4 (bfloat16 act.)", "Q4_1", "bfloat16", "int4"),
)
AS_STORED = "as stored"  # --model: the one file, each engine's defaults
SLUICE_AS_STORED = (("default", AS_STORED, "auto", "auto"),)


# --- weights -----------------------------------------------------------------------------------


def weight_files() -> dict[str, Path]:
    """Each format's GGUF file, converted by llama.cpp from the default model where missing."""
    from sluice.engine.loader.default import default_model_path

    source = default_model_path()
    files = {"Q4_1": source}
    for fmt in FORMATS:
        if fmt in files:
            continue
        target = MODELS / f"{source.stem.rsplit('.', 1)[0]}.{fmt}.gguf"
        if not target.exists():
            et.log(f"weights: converting {source.name} to {fmt} with llama.cpp's quantizer")
            convert(source, target, fmt)
        files[fmt] = target
    return files


def convert(source: Path, target: Path, fmt: str) -> None:
    import llama_cpp as L

    ftype = {
        "F32": L.LLAMA_FTYPE_ALL_F32,
        "BF16": L.LLAMA_FTYPE_MOSTLY_BF16,
        "Q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0,
    }[fmt]
    target.parent.mkdir(parents=True, exist_ok=True)
    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = target.with_suffix(".partial")
    rc = L.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {fmt} failed ({rc})")
    tmp.rename(target)


# --- phase: llama.cpp --------------------------------------------------------------------------


GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_CONT = 3, 5  # ggml.h


def quiet_log(level: int, text: bytes) -> None:
    if GGML_LOG_LEVEL_WARN <= level < GGML_LOG_LEVEL_CONT:
        sys.stderr.write(text.decode(errors="replace"))


class LlamaCpp:
    """A llama.cpp model and context through its C API: batched greedy decoding."""

    def __init__(self, path: str, threads: int, n_ctx: int, n_seq: int, n_batch: int):
        import llama_cpp as L
        import numpy as np

        self.L, self.np = L, np
        # llama.cpp logs every graph input at load; keep its warnings and errors only
        self._log = L.llama_log_callback(lambda level, text, _: quiet_log(level, text))
        L.llama_log_set(self._log, ctypes.c_void_p())
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        p.n_threads = p.n_threads_batch = threads
        # a KV stream per sequence: a sequence's attention reads its own cells only (a unified
        # buffer makes every sequence attend over all of them, masked: 4x slower at 64)
        p.kv_unified = False
        p.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(max(n_batch, n_seq), 0, 1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries; the greedy next
        token of each entry that wants logits, in order."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        picks = []
        for i, (_, _, _, logits) in enumerate(entries):
            if logits:
                row = self.L.llama_get_logits_ith(self.ctx, i)
                picks.append(int(self.np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax()))
        return picks

    def generate(self, prompts: list[list[int]], n: int, on_token=None) -> list[list[int]]:
        """n greedy tokens for each prompt, all sequences at once."""
        self.clear()
        out: list[list[int]] = [[] for _ in prompts]
        pending: list[tuple[int, int, int, bool]] = []
        owners: list[int] = []

        def flush():
            for seq, tok in zip(owners, self.decode(pending)):
                out[seq].append(tok)
                if on_token:
                    on_token(seq)
            pending.clear()
            owners.clear()

        for seq, prompt in enumerate(prompts):  # prefill, packed into batches of n_batch tokens
            for pos, tok in enumerate(prompt):
                last = pos == len(prompt) - 1
                pending.append((tok, pos, seq, last))
                if last:
                    owners.append(seq)
                if len(pending) == self.n_batch:
                    flush()
        if pending:
            flush()
        for _ in range(n - 1):  # decode: one token of every sequence a call
            for seq, prompt in enumerate(prompts):
                pending.append((out[seq][-1], len(prompt) + len(out[seq]) - 1, seq, True))
                owners.append(seq)
            flush()
        return out


def run_llama(a) -> dict:
    w = json.loads(a.workload)
    prompts, single = et.workload(w, 49152)  # (the lengths do not depend on the vocabulary)
    # per sequence: its longest prompt and output, in whole 256-cell pages
    longest = max(map(len, prompts + [single])) + max(w["output_len"], w["single_output_len"])
    per_seq = -(-(longest + 16) // 256) * 256
    n_ctx = per_seq * len(prompts)
    t0 = time.perf_counter()
    llama = LlamaCpp(a.model, a.threads, n_ctx, len(prompts), a.n_batch)
    load_s = time.perf_counter() - t0
    prompts, single = et.workload(w, llama.n_vocab)  # the ids sluice's side draws too
    llama.generate([p[:48] for p in prompts[:4]], 8)  # warm-up

    stamps: list[float] = []

    def single_run():
        stamps.clear()
        with Timed() as timed:
            tokens = llama.generate(
                [single], w["single_output_len"], lambda _: stamps.append(time.perf_counter())
            )[0]
        return timed, tokens

    single_timed, single_tokens, _ = et.least_disturbed(
        single_run, a.retries, a.wait_idle, "llama.cpp single"
    )
    per_token = [b - a_ for a_, b in zip(stamps, stamps[1:])]
    total = len(prompts) * w["output_len"]
    et.log(f"llama.cpp: {len(prompts)} requests x {w['output_len']} tokens")

    def batch_run():
        et.reset_rss_peak()
        progress = et.Progress("llama.cpp", total)
        done = [0]

        def counted(_seq):
            done[0] += 1
            if done[0] % 512 == 0:
                progress.update(done[0])

        with Timed() as timed:
            outputs = llama.generate(prompts, w["output_len"], counted)
        return timed, (outputs, et.rss_peak_mib())

    timed, (outputs, peak), attempts = et.least_disturbed(
        batch_run, a.retries, a.wait_idle, "llama.cpp"
    )
    return {
        "engine": "llama.cpp",
        "llama_cpp_python": __import__("llama_cpp").__version__,
        "system_info": __import__("llama_cpp").llama_print_system_info().decode().strip(),
        "load_s": load_s,
        "single_ms_per_token": et.median_ms(per_token),
        "single_tokens": single_tokens,
        "throughput_tok_s": total / timed.wall,
        **timed.as_dict(),
        "attempts": attempts,
        "batch_peak_rss_mib": peak,
        "outputs": outputs,
        "prompt_digest": et.digest([prompts, single]),
    }


# --- the run -----------------------------------------------------------------------------------


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each output's tokens before its first difference from the reference's."""

    def prefix(x: list[int], y: list[int]) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    return statistics.mean(prefix(x, y) / max(1, len(y)) for x, y in zip(outputs, reference))


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a smaller workload (a few minutes)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--n-batch", type=int, default=512, help="llama.cpp's batch size in tokens")
    p.add_argument(
        "--model",
        help="a catalog model or a GGUF file: both engines on that file as stored (default: the "
        "default model, in llama.cpp's formats below)",
    )
    p.add_argument("--formats", default=",".join(FORMATS), help="llama.cpp's weight formats to run")
    p.add_argument(
        "--sluice",
        default=",".join(name for name, *_ in SLUICE),
        help="sluice's configurations to run (names as in the table)",
    )
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS")
    p.add_argument("--retries", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, in turn; the table gives medians of the "
        "values and of the ratios, each ratio taken within its round (this machine's speed "
        "drifts within minutes), and the ms/token ratio's range",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--table-from", type=Path, metavar="JSON")
    p.add_argument("--phase", choices=["llama"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)  # spawn passes it
    a = p.parse_args()
    if a.rounds < 1:
        p.error("--rounds: at least 1")
    if a.phase:
        result = run_llama(a)
        Path(a.out).write_text(json.dumps(result))
        return
    if a.table_from:
        return summarize(json.loads(a.table_from.read_text()))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("bench/peers.py needs llama-cpp-python: .venv/bin/pip install -e '.[peers]'")

    quick = dict(
        num_requests=8,
        prompt_min=32,
        prompt_max=128,
        output_len=32,
        single_prompt_len=64,
        single_output_len=32,
    )
    w = dict(quick if a.quick else et.FULL_WORKLOAD, seed=a.seed)
    w["prompt_tokens"] = et.prompt_tokens(w)
    if a.model:
        from sluice.engine.loader import catalog

        model = Path(a.model) if Path(a.model).is_file() else catalog.locate(a.model)
        files = {AS_STORED: model}
        a.formats, a.sluice = AS_STORED, ",".join(name for name, *_ in SLUICE_AS_STORED)
    else:
        files = weight_files()
    started = time.time()
    et.log(f"workload: {w}; {a.threads} threads")
    kv_mib = et.kv_cache_mib_for(w, 4)  # float32-sized for every configuration
    rounds = []
    for n in range(a.rounds):
        if a.rounds > 1:
            et.log(f"round {n + 1} of {a.rounds}")
        rounds.append(run_round(a, w, files, kv_mib))
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "command": " ".join(
            [os.path.relpath(sys.executable, ROOT), "-m", "bench.peers", *sys.argv[1:]]
        ),
        "machine": {
            "cpu": et.cpu_model(),
            "cpu_flags": sorted(
                f for f in cpu_kernels.cpu_flags() if f.startswith(("avx", "amx", "fma"))
            ),
            "logical_cpus": os.cpu_count(),
            "threads": a.threads,
            "python": platform.python_version(),
        },
        "model": files[AS_STORED].name if a.model else "SmolLM2-135M",
        "workload": w,
        "rounds": rounds,
    }
    summarize(report)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=1))
    et.log(f"wrote {a.json}")


def run_round(a, w: dict, files: dict[str, Path], kv_mib: int) -> dict[str, dict]:
    """Every configuration once, one after the other: results by label, each output replaced by
    its agreement with sluice float32's."""
    runs: dict[str, dict] = {}
    for name, fmt, dtype, quant in SLUICE_AS_STORED if AS_STORED in files else SLUICE:
        if name not in a.sluice.split(","):
            continue
        et.log(f"sluice {name}: load + run ({files[fmt].name})")
        a.dtype = dtype
        extra = ["--model", str(files[fmt]), "--kv-cache-mib", str(kv_mib), "--tm-samples", "0"]
        extra += ["--quantization", quant] if quant else []
        r = spawn_or_failure("sluice", a, w, extra)
        r.update(engine="sluice", config=name, weights=fmt)
        runs[f"sluice {name}"] = r
    a.dtype = "float32"
    for fmt in a.formats.split(","):
        et.log(f"llama.cpp {fmt}: load + run")
        extra = ["--model", str(files[fmt]), "--n-batch", str(a.n_batch)]
        r = spawn_or_failure("llama", a, w, extra, module="bench.peers")
        r.update(engine="llama.cpp", config=fmt, weights=fmt)
        runs[f"llama.cpp {fmt}"] = r

    measured = [r for r in runs.values() if "failed" not in r]
    digests = {r["prompt_digest"] for r in measured}
    assert len(digests) <= 1, f"the engines saw different prompts: {digests}"
    # agreement with sluice float32's tokens, or with llama.cpp's on a file run as stored
    reference = runs.get("sluice float32") or runs.get(f"llama.cpp {AS_STORED}")
    ref_outputs = None if reference is None or "failed" in reference else reference["outputs"]
    for r in measured:
        outputs = r.pop("outputs")
        if ref_outputs is not None:
            r["agreement"] = agreement(outputs, ref_outputs)
            r["single_agreement"] = agreement([r["single_tokens"]], [reference["single_tokens"]])
    return runs


def spawn_or_failure(phase: str, a, w: dict, extra: list[str], **kw) -> dict:
    """A phase's results, or {"failed": why} when its process died (llama.cpp's AMX path
    segfaulted on some builds): the other phases still run and the table says which failed."""
    try:
        return et.spawn(phase, a, w, extra, **kw)
    except subprocess.CalledProcessError as e:
        why = f"exit {e.returncode}" if e.returncode > 0 else f"killed by signal {-e.returncode}"
        if e.returncode == -signal.SIGILL:
            why += " (SIGILL: llama.cpp was built for instructions this CPU lacks; see the top)"
        et.log(f"{phase}: the phase's process died ({why}); going on without it")
        return {"failed": why}


def round_ratios(runs: dict[str, dict]) -> dict[str, tuple[float, float]]:
    """Each measured run's (throughput, ms/token) against llama.cpp's best in the same round."""
    llama = [x for x in runs.values() if x["engine"] == "llama.cpp"]
    best_tput = max((x["throughput_tok_s"] for x in llama), default=float("nan"))
    best_ms = min((x["single_ms_per_token"] for x in llama), default=float("nan"))
    return {
        label: (x["throughput_tok_s"] / best_tput, x["single_ms_per_token"] / best_ms)
        for label, x in runs.items()
    }


def summarize(r: dict) -> None:
    rounds = r.get("rounds") or [r["runs"]]  # a report written before rounds: one round
    for n, runs in enumerate(rounds):
        for label, x in runs.items():
            if "failed" in x:
                print(f"{label}: not measured in round {n + 1}, its process died ({x['failed']})")
    rounds = [{k: x for k, x in runs.items() if "failed" not in x} for runs in rounds]
    ratios = [round_ratios(runs) for runs in rounds]
    labels = list(dict.fromkeys(label for runs in rounds for label in runs))
    w = r["workload"]
    print(
        f"\n{r.get('model', 'SmolLM2-135M')}, {r['machine']['threads']} threads, "
        f"{r['machine']['cpu']}, {r['date']}\n"
        f"{w['num_requests']} requests ({w['prompt_tokens']} prompt tokens) x {w['output_len']} "
        f"tokens; single request {w['single_prompt_len']} in, {w['single_output_len']} out"
        + (f"; medians of {len(rounds)} rounds" if len(rounds) > 1 else "")
        + "\n"
    )
    spread = len(rounds) > 1
    head = (
        f"{'engine':<34} {'tok/s':>8} {'x best':>7} {'ms/tok':>8} {'x best':>7} "
        + (f"{'range':>11} " if spread else "")
        + f"{'RSS MiB':>8} {'agree':>6} {'others':>7}"
    )
    print(head)
    print("-" * len(head))

    def med(values):
        return statistics.median(values) if values else float("nan")

    for label in labels:
        xs = [runs[label] for runs in rounds if label in runs]
        tput_x = [q[label][0] for q in ratios if label in q]
        ms_x = [q[label][1] for q in ratios if label in q]
        line = (
            f"{label:<34} {med([x['throughput_tok_s'] for x in xs]):>8.1f} {med(tput_x):>7.2f} "
            f"{med([x['single_ms_per_token'] for x in xs]):>8.2f} {med(ms_x):>7.2f} "
        )
        if spread:
            line += f"{f'{min(ms_x):.2f}-{max(ms_x):.2f}':>11} "
        line += (
            f"{med([x['batch_peak_rss_mib'] for x in xs]):>8.0f} "
            f"{med([x.get('agreement', float('nan')) for x in xs]):>6.2f} "
            f"{max(x.get('others_cores', float('nan')) for x in xs):>7.2f}"
        )
        print(line)
    print(
        "\nx best: against llama.cpp's best in the same round (throughput: higher is better; "
        "ms/token: lower is better)"
        + ("; range: the ms/token ratio's lowest and highest over the rounds" if spread else "")
        + ". agree: share of tokens before the first difference from sluice float32's (llama.cpp's "
        "with --model), averaged "
        "over requests. others: cores other processes used meanwhile (the most in any round)."
    )


if __name__ == "__main__":
    main()
