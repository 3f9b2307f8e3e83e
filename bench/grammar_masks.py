"""Which grammar engine masks our vocabulary fastest: llguidance, xgrammar and outlines-core on
the same JSON Schema, the same tokenizer (the default model's, 49k tokens), the same walks.

Each engine compiles the schema, then walks it: at every step it computes the mask of allowed
tokens, and the walk takes one of them (chosen by a seeded generator from the allowed set, so
every engine takes comparable walks), until the grammar accepts. It reports the compile time and
the per-token mask time (median, p99), and checks that each mask admits a token at every step.
Engines that are not installed are reported as such. Then, in sluice's engine (llguidance), the
time per generated token of a batch with and without the schema, interleaved round by round.

    pip install llguidance xgrammar outlines-core
    .venv/bin/python -m bench.grammar_masks --walks 20
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.engine_throughput import cpu_model
from sluice.engine.loader import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "grammar_masks.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["river", "lake", "sea"]},
        "depth_m": {"type": "integer"},
        "towns": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "town": {"type": "string", "maxLength": 16},
                    "size": {"enum": ["small", "large"]},
                },
                "required": ["town", "size"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
    },
    "required": ["name", "kind", "depth_m", "towns"],
    "additionalProperties": False,
}
MAX_STEPS = 200


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.torch

        self.lib = llguidance
        self.tok = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), eos_token=list(tokenizer.eos_token_ids)
        )
        self.vocab = self.tok.vocab_size

    def compile(self, schema):
        return self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema))

    def start(self, compiled):
        self.matcher = self.lib.LLMatcher(self.tok, compiled)
        self.mask = self.lib.torch.allocate_token_bitmask(1, self.vocab)

    def fill(self) -> torch.Tensor:
        self.lib.torch.fill_next_token_bitmask(self.matcher, self.mask)
        return self.mask[0]

    def advance(self, token: int) -> bool:
        assert self.matcher.consume_token(token), self.matcher.get_error()
        return self.matcher.is_stopped() or self.matcher.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo(
            list(tokenizer.token_bytes),
            xgrammar.VocabType.RAW,
            stop_token_ids=list(tokenizer.eos_token_ids),
        )
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab = len(tokenizer.token_bytes)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def start(self, compiled):
        self.matcher = self.lib.GrammarMatcher(compiled)
        self.mask = self.lib.allocate_token_bitmask(1, self.vocab)

    def fill(self) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self.mask)
        return self.mask[0]

    def advance(self, token: int) -> bool:
        assert self.matcher.accept_token(token)
        return self.matcher.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        import outlines_core

        self.lib = outlines_core
        eos = min(tokenizer.eos_token_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for i, raw in enumerate(tokenizer.token_bytes):
            if i not in tokenizer.eos_token_ids and raw:
                by_bytes.setdefault(raw, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)
        self.vocab = len(tokenizer.token_bytes)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        return self.lib.Index(build_regex_from_schema(json.dumps(schema)), self.vocabulary)

    def start(self, compiled):
        self.guide = self.lib.Guide(compiled)
        self.mask = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)

    def fill(self) -> torch.Tensor:
        self.guide.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)
        return self.mask

    def advance(self, token: int) -> bool:
        self.guide.advance(token)
        return self.guide.is_finished()


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The ids a 32-bit-word bitmask allows."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits.unsqueeze(1) >> shifts) & 1).flatten()[:vocab]
    return allowed.nonzero().flatten()


def walk(engine, compiled, rng: random.Random) -> tuple[list[float], int]:
    """Mask times (ms) of one walk through the grammar, and its length in tokens."""
    engine.start(compiled)
    times: list[float] = []
    for _ in range(MAX_STEPS):
        start = time.perf_counter()
        bits = engine.fill()  # the cost a step pays: the mask as a 32-bit-word bitmask
        times.append((time.perf_counter() - start) * 1000)
        allowed = unpack(bits, engine.vocab)
        assert allowed.numel() > 0, f"{engine.name}: a mask excluded every token"
        if engine.advance(int(allowed[rng.randrange(allowed.numel())])):
            break
    return times, len(times)


def engine_ms_per_token(rounds: int, batch: int) -> dict[str, float]:
    """Median ms per generated token of `batch` sampled requests of 64 tokens each, guided by a
    schema or not. The schema's text cannot end within 64 tokens (an object whose first field
    is a long string, then the nested one), so both batches keep every request to the end and
    the comparison is of steps of the same shape."""
    from sluice.engine import LLMEngine, SamplingParams
    from sluice.engine.config import EngineConfig

    engine = LLMEngine(None, EngineConfig(kv_cache_bytes=256 << 20))
    long_first = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 400}, "water": SCHEMA},
        "required": ["story", "water"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": long_first}}
    times: dict[str, list[float]] = {"guided": [], "free": []}
    for r in range(rounds):
        for mode in ("guided", "free"):
            params = [
                SamplingParams(
                    temperature=1.0,
                    seed=r * batch + i,
                    max_tokens=64,
                    ignore_eos=mode == "free",
                    response_format=fmt if mode == "guided" else None,
                )
                for i in range(batch)
            ]
            start = time.perf_counter()
            outs = engine.generate(["Describe a body of water as JSON:"] * batch, params)
            tokens = sum(len(o.token_ids) for o in outs)
            assert tokens == 64 * batch, (mode, tokens)
            times[mode].append((time.perf_counter() - start) * 1000 / tokens)
    return {mode: statistics.median(t) for mode, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.grammar_masks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3, help="engine rounds (0: skip)")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    tokenizer, _ = load_tokenizer(args.model)
    rows = []
    for kind in (LLGuidance, XGrammar, OutlinesCore):
        try:
            start = time.perf_counter()
            engine = kind(tokenizer)
            setup_ms = (time.perf_counter() - start) * 1000
        except ImportError as exc:
            rows.append({"engine": kind.name, "installed": False, "why": str(exc)})
            continue
        start = time.perf_counter()
        compiled = engine.compile(SCHEMA)
        compile_ms = (time.perf_counter() - start) * 1000
        rng = random.Random(0)
        times: list[float] = []
        lengths = []
        for _ in range(args.walks):
            t, n = walk(engine, compiled, rng)
            times += t
            lengths.append(n)
        times.sort()
        rows.append(
            {
                "engine": kind.name,
                "installed": True,
                "tokenizer_setup_ms": round(setup_ms, 1),
                "compile_ms": round(compile_ms, 1),
                "mask_ms_median": round(statistics.median(times), 4),
                "mask_ms_mean": round(statistics.fmean(times), 4),
                "mask_ms_p99": round(times[int(0.99 * (len(times) - 1))], 4),
                "tokens": len(times),
                "walk_tokens_median": statistics.median(lengths),
            }
        )
    print(f"CPU: {cpu_model()}; vocabulary {len(tokenizer.token_bytes)} tokens; {args.walks} walks")
    header = f"{'engine':<14} {'setup ms':>9} {'compile ms':>11} {'mask ms p50':>12} {'p99':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if not r["installed"]:
            print(f"{r['engine']:<14} not installed")
            continue
        print(
            f"{r['engine']:<14} {r['tokenizer_setup_ms']:>9.1f} {r['compile_ms']:>11.1f} "
            f"{r['mask_ms_median']:>12.4f} {r['mask_ms_p99']:>8.4f}"
        )
    in_engine = engine_ms_per_token(args.rounds, args.batch) if args.rounds else {}
    if in_engine:
        ratio = in_engine["guided"] / in_engine["free"]
        print(
            f"engine, {args.batch} sampled requests: {in_engine['guided']:.2f} ms/token guided, "
            f"{in_engine['free']:.2f} free ({ratio:.3f}x)"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    out = {"cpu": cpu_model(), "rows": rows, "engine_ms_per_token": in_engine}
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
