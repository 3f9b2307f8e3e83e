"""Deterministic mode's golden outputs: fixed requests on the default model (greedy and sampled,
with logprobs) in each dtype and quantization, and the token ids and logprob bits they gave,
kept in tests/engine/data/golden_numerics.json under the numerics version that produced them.

`tests/engine/test_golden_numerics.py` checks them on every build of the kernels CI makes
(`scripts/test_isa_levels.sh` builds them for each instruction-set level the CPU runs), so a
change that moves one bit fails until it is meant: then raise `provenance.NUMERICS_VERSION` and
record again with `python -m sluice.testing.golden_numerics --record` (docs/REPRODUCIBILITY.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.provenance import NUMERICS_VERSION
from sluice.engine.sampling_params import SamplingParams

GOLDEN_PATH = (
    Path(__file__).resolve().parents[2] / "tests" / "engine" / "data" / "golden_numerics.json"
)

VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
}
PROMPTS = (
    "The lighthouse keeper climbed the stairs one last time and",
    "def merge_sorted(a, b):\n    ",
)
PARAMS = (
    SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=16, logprobs=2, ignore_eos=True),
    SamplingParams(
        temperature=0.8, top_k=40, min_p=0.02, seed=99, max_tokens=16, logprobs=2, ignore_eos=True
    ),
)


def outputs(variant: str) -> list[dict]:
    """Each (prompt, params) pair's token ids and logprobs (as float.hex), in a deterministic
    engine of `variant`."""
    engine = LLMEngine(
        config=EngineConfig(kv_cache_bytes=128 << 20, deterministic=True, **VARIANTS[variant])
    )
    tokenizer = engine.tokenizer
    assert tokenizer is not None  # (the default model has its own)
    found = []
    for p, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        for q, params in enumerate(PARAMS):
            sample = engine.generate(prompt_token_ids=[ids], params=params)[0].samples[0]
            found.append(
                {
                    "prompt": p,
                    "params": q,
                    "token_ids": list(sample.token_ids),
                    "logprobs": [
                        [lp.logprob.hex(), [[t, v.hex()] for t, v in lp.top]]
                        for lp in sample.logprobs
                    ],
                }
            )
    return found


def recorded() -> dict:
    return json.loads(GOLDEN_PATH.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="write the golden file anew")
    args = parser.parse_args(argv)
    if not args.record:
        want = recorded()
        wrong = [v for v in VARIANTS if outputs(v) != want["variants"][v]]
        print("golden numerics:", "differ in " + ", ".join(wrong) if wrong else "identical")
        return 1 if wrong else 0
    variants = [
        f"  {json.dumps(v)}: [\n" + ",\n".join(f"   {json.dumps(e)}" for e in outputs(v)) + "\n  ]"
        for v in VARIANTS
    ]
    text = f'{{\n "numerics": {NUMERICS_VERSION},\n "variants": {{\n' + ",\n".join(variants)
    GOLDEN_PATH.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_PATH.write_text(text + "\n }\n}\n")  # a request a line
    print(f"recorded {GOLDEN_PATH} (numerics {NUMERICS_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
