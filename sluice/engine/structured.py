"""Structured output: the tokens a request samples follow a grammar (a JSON Schema, any JSON object,
a regular expression, or a context-free grammar), applied as a mask on the logits before sampling.

A request says which with ``response_format`` (OpenAI's forms, and two of sluice's):

* ``{"type": "text"}``: no constraint;
* ``{"type": "json_object"}``: any JSON object;
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``: JSON that
  validates against the schema;
* ``{"type": "regex", "regex": "..."}``: text that the regular expression matches in full;
* ``{"type": "grammar", "grammar": "..."}``: text the grammar derives, in the Lark syntax
  (``start: "yes" | "no"``).

JSON is written compactly (no whitespace between tokens of the JSON), so that a model cannot
spend its tokens on blank space. The grammar engine is llguidance: on our 49k-token vocabulary its
mask costs microseconds a token (bench/grammar_masks.py measured llguidance, xgrammar and
outlines-core all well under 1% of a decode step), it has no dependencies (xgrammar needs Triton,
which the CPU wheel lacks), and it parses context-free grammars (outlines-core only regular ones).

Each completion has its own :class:`Matcher`, advanced by every token it samples (and by the tokens
of a completion taken up again), so a mask depends on the request alone. The engine computes a
step's masks in a thread of their own while the model runs (as the -inf the sampler adds to what a
mask excludes).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from sluice.engine.errors import EngineError

FIELD = "response_format"
COMPACT_JSON: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions
_CACHED_GRAMMARS = 64
_SHIFTS = torch.arange(32, dtype=torch.int32)


def _grammar_source(response_format: Mapping[str, Any]) -> str | None:
    """The llguidance grammar of a response format (None: no constraint)."""
    import llguidance

    kind = response_format.get("type")
    matcher = llguidance.LLMatcher
    if kind == "text":
        return None
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, overrides=COMPACT_JSON)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise EngineError("json_schema.schema: must be a JSON Schema object", FIELD)
        try:
            return matcher.grammar_from_json_schema(json.dumps(schema), overrides=COMPACT_JSON)
        except ValueError as exc:
            raise EngineError(f"json_schema.schema: {exc}", FIELD) from None
    if kind == "regex":
        regex = response_format.get("regex")
        if not isinstance(regex, str) or not regex:
            raise EngineError("regex: must be a non-empty string", FIELD)
        return matcher.grammar_from_regex(regex)
    if kind == "grammar":
        grammar = response_format.get("grammar")
        if not isinstance(grammar, str) or not grammar.strip():
            raise EngineError("grammar: must be a non-empty Lark grammar", FIELD)
        return matcher.grammar_from_lark(grammar)
    raise EngineError(
        f"type: must be text, json_object, json_schema, regex or grammar (got {kind!r})", FIELD
    )


class Matcher:
    """Where one completion stands in its grammar."""

    def __init__(self, inner: Any):
        self._inner = inner

    def consume(self, token: int) -> None:
        if not self._inner.consume_token(token):
            raise EngineError(
                f"token {token} breaks the response format: {self._inner.get_error()}"
            )

    def fill(self, words: torch.Tensor) -> None:
        """Write the allowed next tokens into `words` (int32, 32 tokens a word)."""
        self._inner.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)


class Grammars:
    """Response formats compiled for one tokenizer, and the masks of a step."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits (may exceed the tokenizer's vocabulary)
        self._lltokenizer: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary: made once, at the first structured request (it
        takes a second or two)."""
        with self._lock:
            if self._lltokenizer is None:
                import llguidance

                self._lltokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), eos_token=list(self.tokenizer.eos_token_ids)
                )
            return self._lltokenizer

    def matcher(self, response_format: Mapping[str, Any] | None) -> Matcher | None:
        """A fresh matcher for a request's response format; None when it constrains nothing.
        Raises EngineError (field response_format) when the format is not one that can be used."""
        if response_format is None:
            return None
        if self.tokenizer is None:
            raise EngineError("structured output needs the model's tokenizer", FIELD)
        import llguidance

        key = json.dumps(response_format, sort_keys=True)
        grammar = self._compiled.get(key)
        if grammar is None:
            grammar = _grammar_source(response_format)
            if grammar is None:
                return None
            problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
            if problem and not problem.startswith("WARNING"):
                raise EngineError(problem, FIELD)
            self._compiled[key] = grammar
            if len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        inner = llguidance.LLMatcher(self._tokenizer(), grammar)
        if inner.is_error():
            raise EngineError(inner.get_error(), FIELD)
        return Matcher(inner)

    def masks_later(self, matchers: Sequence[Matcher | None]) -> Future | None:
        """The allowed tokens of each guided row (`allowed_tokens`), computed in a thread of
        their own (the model step runs meanwhile); None when no row is guided."""
        if all(m is None for m in matchers):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(self.allowed_tokens, list(matchers))

    def allowed_tokens(
        self, matchers: Sequence[Matcher | None]
    ) -> tuple[list[int], torch.Tensor] | None:
        """(the rows that have a matcher, a float32 [rows, vocab] to add to their logits: 0 where
        a token is allowed, -inf where not)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        known = self._tokenizer().vocab_size
        words = torch.zeros((len(rows), (known + 31) // 32), dtype=torch.int32)
        for out, row in enumerate(rows):
            matcher = matchers[row]
            assert matcher is not None
            matcher.fill(words[out])
        bits = ((words.unsqueeze(-1) >> _SHIFTS) & 1).flatten(1)
        width = min(known, self.vocab_size)  # ids past the tokenizer's are never allowed
        bias = torch.full((len(rows), self.vocab_size), float("-inf"))
        bias[:, :width].masked_fill_(bits[:, :width].bool(), 0.0)
        return rows, bias
