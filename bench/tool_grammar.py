"""What the tool-call grammars cost per token: the mask sluice computes (`Grammars.allowed_tokens`,
the bias the sampler adds) at every token of a text answer and of a call, for `tool_choice`
`auto` and `required`, on the default model's tokenizer (49k tokens; its call tag is plain
characters, so `auto` has no grammar there) and on Qwen2.5-Coder's (152k; its tag is a token of
its own), when pulled. Prints a table and writes JSON.

    .venv/bin/python -m bench.tool_grammar
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.engine_throughput import cpu_model
from sluice.engine.errors import EngineError
from sluice.engine.loader import catalog, load_tokenizer
from sluice.engine.structured import Grammars
from sluice.engine.tool_formats import Tools

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "tool_grammar.json"
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TEXT = "The weather in Oslo is mild today, with some clouds and a light breeze from the west."
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'


def walk_ms(grammars: Grammars, grammar: str, token_ids: list[int]) -> list[float]:
    """Milliseconds of each token's mask along a walk of `token_ids`."""
    matcher = grammars.matcher({"type": "grammar", "grammar": grammar})
    assert matcher is not None
    times = []
    for token in token_ids:
        started = time.perf_counter()
        grammars.allowed_tokens([matcher])
        times.append((time.perf_counter() - started) * 1e3)
        matcher.consume(token)
    return times


def main() -> None:
    tokenizers = {"smollm2-135m (default)": load_tokenizer(None)[0]}
    try:
        tokenizers["qwen2.5-coder-1.5b"] = load_tokenizer(catalog.locate("qwen2.5-coder-1.5b"))[0]
    except EngineError as e:
        print(f"qwen2.5-coder-1.5b not pulled, left out: {e}")
    rows = []
    for name, tokenizer in tokenizers.items():
        grammars = Grammars(tokenizer, tokenizer.vocab_size)
        walks = {"text": TEXT, "call": CALL}
        for choice in ("auto", "required"):
            grammar = tokenizer.tool_format.grammar(Tools((WEATHER,), choice=choice))
            for walk, text in walks.items():
                if grammar is None or (choice == "required" and walk == "text"):
                    continue
                ids = tokenizer.encode(text, add_special_tokens=False)
                times = sorted(walk_ms(grammars, grammar, ids))
                rows.append(
                    {
                        "tokenizer": name,
                        "vocab": tokenizer.vocab_size,
                        "tool_choice": choice,
                        "walk": walk,
                        "tokens": len(ids),
                        "median_ms": round(statistics.median(times), 3),
                        "p90_ms": round(times[int(0.9 * (len(times) - 1))], 3),
                    }
                )
    print(f"CPU: {cpu_model()}")
    head = ("tokenizer", "vocab", "choice", "walk", "tokens", "median", "p90")
    print("{:24} {:>7} {:9} {:5} {:>6} {:>8} {:>8}".format(*head))
    for r in rows:
        print(
            f"{r['tokenizer']:24} {r['vocab']:>7} {r['tool_choice']:9} {r['walk']:5} "
            f"{r['tokens']:>6} {r['median_ms']:>6.2f}ms {r['p90_ms']:>6.2f}ms"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
