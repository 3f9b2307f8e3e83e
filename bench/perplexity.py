"""Perplexity of sluice and of llama.cpp on the same GGUF file, over the same tokens, in one run.

    .venv/bin/pip install -e '.[peers]'           # llama.cpp's bindings, built here (~7 min)
    .venv/bin/python -m bench.perplexity            # every pulled catalog model
    .venv/bin/python -m bench.perplexity --models gemma3-270m --chunks 4
    .venv/bin/python -m bench.perplexity --table-from bench/results/perplexity.json

The method is llama.cpp's `llama-perplexity`: the text's tokens cut into chunks of --ctx (512),
each evaluated from an empty cache with a BOS in place of its first token where the model's
tokenizer adds one, and the second half of each chunk scored (every token's log-likelihood under
the logits of the position before it), so that each scored token has at least ctx/2 tokens before
it. Both engines get the same token ids (sluice's tokenizer; whether llama.cpp's own tokenizer
gives the same ids for the text is reported). llama.cpp runs through its C API
(llama-cpp-python, built from source here): a chunk in one decode, with every position's logits.

sluice runs the file twice: as `sluice generate --model NAME` does by default (`--quantization
auto`: the file's 4-bit layers as stored, its wider ones in int8; `--dtype auto`), and with
`--quantization none` in float32 (the file's values dequantized: what the file holds, computed
without quantized arithmetic). Reported per model and engine: perplexity, its ratio to
llama.cpp's, the share of scored positions whose most likely next token is llama.cpp's (top-1
agreement), and the mean KL divergence from llama.cpp's next-token distribution to the engine's
(what `llama-perplexity --kl-divergence` measures between two runs).

Text: bench/data/python-reference.txt, three chapters of the Python language reference as
Python 3.11 ships them (`pydoc_data.topics`: the execution model, the import system, assignment
statements; PSF license), kept fixed so that figures of different runs compare.
Writes bench/results/perplexity.json and prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "bench" / "data" / "python-reference.txt"
RESULTS = ROOT / "bench" / "results" / "perplexity.json"
SLUICE_RUNS = (  # (name, quantization, dtype)
    ("sluice (default)", "auto", "auto"),
    ("sluice float32", None, "float32"),
)


@dataclass
class Score:
    """The running sums of one engine's scored positions against llama.cpp's."""

    nll: float = 0.0  # sum of -log p(target)
    kl: float = 0.0  # sum of KL(llama.cpp || this engine)
    same_top: int = 0  # positions whose argmax is llama.cpp's
    positions: int = 0
    seconds: float = 0.0  # evaluating the chunks
    extra: dict = field(default_factory=dict)

    def add(self, logp: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> None:
        """logp, reference: [n, V] float64 log-probabilities; targets [n] the tokens that came."""
        self.nll -= logp.gather(1, targets[:, None]).sum().item()
        self.kl += (reference.exp() * (reference - logp)).sum().item()
        self.same_top += (logp.argmax(1) == reference.argmax(1)).sum().item()
        self.positions += len(targets)

    def row(self) -> dict:
        n = max(1, self.positions)
        return {
            "perplexity": math.exp(self.nll / n),
            "mean_kl": self.kl / n,
            "top1_agreement": self.same_top / n,
            "positions": self.positions,
            "seconds": self.seconds,
            **self.extra,
        }


def chunks(tokens: list[int], ctx: int, count: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive runs of ctx tokens, a BOS in place of each one's
    first token where the model starts its sequences with one."""
    out = []
    for i in range(min(count, len(tokens) // ctx)):
        chunk = tokens[i * ctx : (i + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


class LlamaCpp:
    """A GGUF file in llama.cpp through its C API: a chunk in one decode, with the logits of the
    positions from `first` on (llama-perplexity asks for those only)."""

    def __init__(self, path: Path, ctx: int, threads: int):
        import llama_cpp as L
        import numpy as np

        from bench.peers import quiet_log

        self.L, self.np = L, np
        self._log = L.llama_log_callback(lambda level, text, _: quiet_log(level, text))
        L.llama_log_set(self._log, ctypes.c_void_p())  # its warnings and errors only
        L.llama_backend_init()
        params = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        p = L.llama_context_default_params()
        p.n_ctx = p.n_batch = p.n_ubatch = ctx
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self.batch = L.llama_batch_init(ctx, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        out = (self.L.llama_token * (len(data) + 16))()
        n = self.L.llama_tokenize(self.vocab, data, len(data), out, len(out), False, False)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return list(out[:n])

    def logits(self, chunk: list[int], first: int) -> torch.Tensor:
        """float32 logits [len(chunk) - first, V] of the positions from `first` on."""
        L, b = self.L, self.batch
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        for i, token in enumerate(chunk):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, i, 1, i >= first
            b.seq_id[i][0] = 0
        b.n_tokens = len(chunk)
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [
            self.np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
            for i in range(first, len(chunk))
        ]
        return torch.from_numpy(self.np.stack(rows))

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


class Sluice:
    """A GGUF file in sluice's engine: every position's logits of one chunk, through the engine's
    chosen forward route from an empty KV cache (what a prompt's prefill computes)."""

    def __init__(self, path: Path, ctx: int, quantization: str | None, dtype: str):
        from sluice.engine.config import EngineConfig
        from sluice.engine.engine import LLMEngine

        config = EngineConfig(
            quantization=quantization,
            dtype=dtype,
            max_model_len=ctx,
            max_num_batched_tokens=ctx,
            kv_cache_bytes=None,
            enable_prefix_caching=False,
        )
        self.engine = LLMEngine(str(path), config)
        runner = self.engine.runner
        if runner.reserving is not None:
            runner.reserving.wait(timeout=600)
        self.blocks = list(range(-(-ctx // runner.block_size)))
        assert len(self.blocks) <= runner.num_blocks, "a chunk does not fit the KV cache"
        self.described = {
            "quantization": self.engine.config.quantization,
            "dtype": self.engine.config.dtype,
            "kernels": self.engine.kernels,
            "route": runner.route.name,
        }

    @torch.inference_mode()
    def logits(self, chunk: list[int], first: int) -> torch.Tensor:
        """float32 logits [len(chunk) - first, V] of the positions from `first` on."""
        from sluice.engine.forward import StepInputs

        runner = self.engine.runner
        inputs = StepInputs(chunk, [len(chunk)], [len(chunk)], [self.blocks], [])
        hidden = runner.forward(inputs)
        return runner.model.compute_logits(hidden[first:])

    def close(self) -> None:
        self.engine.close()


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities in float64, but for the last position (nothing to score)."""
    return torch.log_softmax(logits[:-1].double(), dim=-1)


def measure(name: str, ctx: int, count: int, threads: int) -> dict:
    from sluice.engine.loader import catalog, load_tokenizer

    path = catalog.locate(name)
    torch.set_num_threads(threads)
    tokenizer, _ = load_tokenizer(path)
    text = TEXT.read_text()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    pieces = chunks(tokens, ctx, count, tokenizer.bos_token_id)
    first = ctx // 2
    result: dict = {"model": name, "file": path.name, "ctx": ctx, "chunks": len(pieces)}
    result["text_tokens"] = len(tokens)

    # llama.cpp first, alone in the process: its log-probabilities are every engine's reference
    llama = LlamaCpp(path, ctx, threads)
    result["llama_cpp_tokenizes_alike"] = llama.tokenize(text) == tokens
    reference: list[torch.Tensor] = []
    score = Score()
    for chunk in pieces:
        started = time.perf_counter()
        logits = llama.logits(chunk, first)
        score.seconds += time.perf_counter() - started
        reference.append(log_probs(logits).float())
        score.add(reference[-1].double(), reference[-1].double(), torch.tensor(chunk[first + 1 :]))
        print(f"  {name} llama.cpp chunk {len(reference)}/{len(pieces)}", flush=True)
    llama.close()
    result["engines"] = {"llama.cpp": score.row()}

    for label, quantization, dtype in SLUICE_RUNS:
        sluice = Sluice(path, ctx, quantization, dtype)
        result["cpu"] = sluice.engine.provenance.device_name
        score = Score(extra=dict(sluice.described))
        for i, chunk in enumerate(pieces):
            started = time.perf_counter()
            logits = sluice.logits(chunk, first)
            score.seconds += time.perf_counter() - started
            score.add(log_probs(logits), reference[i].double(), torch.tensor(chunk[first + 1 :]))
            print(f"  {name} {label} chunk {i + 1}/{len(pieces)}", flush=True)
        result["engines"][label] = score.row()
        sluice.close()
        del sluice
        gc.collect()
    return result


def table(results: dict) -> str:
    lines = [
        f"CPU: {results['cpu']}, {results['threads']} threads; text: {results['text']}",
        f"{'model':<20} {'engine':<18} {'perplexity':>10} {'vs llama.cpp':>12} "
        f"{'top-1 agree':>11} {'mean KL':>9} {'s/chunk':>8}",
    ]
    for m in results["models"]:
        base = m["engines"]["llama.cpp"]["perplexity"]
        for label, e in m["engines"].items():
            lines.append(
                f"{m['model']:<20} {label:<18} {e['perplexity']:>10.4f} "
                f"{e['perplexity'] / base:>11.4f}x {e['top1_agreement']:>11.4f} "
                f"{e['mean_kl']:>9.5f} {e['seconds'] / max(1, m['chunks']):>8.2f}"
            )
        alike = "same ids" if m["llama_cpp_tokenizes_alike"] else "other ids"
        lines.append(
            f"{'':<20} ({m['chunks']} chunks of {m['ctx']}, {m['text_tokens']} tokens of text; "
            f"llama.cpp's tokenizer: {alike})"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.perplexity",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--models", default=None, help="comma-separated (default: every pulled one)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8, help="at most this many (the text's limit)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--table-from", type=Path, default=None)
    a = p.parse_args()
    if a.table_from:
        print(table(json.loads(a.table_from.read_text())))
        return

    from sluice.engine.loader import catalog

    names = (
        a.models.split(",")
        if a.models
        else [name for name, model in catalog.MODELS.items() if catalog.cached(model) is not None]
    )
    models = [measure(name, a.ctx, a.chunks, a.threads) for name in names]
    results = {
        "cpu": models[0]["cpu"] if models else platform.processor(),
        "threads": a.threads,
        "text": str(TEXT.relative_to(ROOT)),
        "models": models,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
