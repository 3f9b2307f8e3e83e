"""Token ids -> text deltas for streaming, with stop strings.

Works on bytes: each new token contributes its raw bytes (`Tokenizer.token_bytes`), an incremental
UTF-8 decoder turns them into text and holds back a character whose bytes are still incomplete, so a
delta never carries half an emoji as U+FFFD. The cost of a call is proportional to the new tokens,
never to the length of the output so far.

Stop strings can span tokens. Text that could still be the start of a stop string is held back until
the next tokens show it is not; when a stop string appears, the text before it is emitted and
nothing from the stop string on.

Without stop strings, the deltas concatenate to `tokenizer.decode(output_ids)`.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from sluice.engine.errors import EngineError


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ):
        # prompt_token_ids: unused; decoding works on the output's own bytes, so it needs no
        # context.
        self._table = tokenizer.token_bytes
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._strip_first_space = getattr(tokenizer, "strips_leading_space", False)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if any(not s for s in stop):
            raise EngineError("stop strings must be non-empty", "stop")
        self._stops = tuple(dict.fromkeys(stop))
        # Every proper prefix of a stop string: a suffix of the text in this set may be a stop
        # starting.
        self._stop_prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""  # decoded text not yet emitted because it may start a stop string
        self._seen_bytes = False
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found; further tokens are ignored
        self.stop_string: str | None = None  # which one

    def add(self, new_token_ids: Iterable[int]) -> tuple[str, bool]:
        """Feed the newly sampled ids. Returns (text safe to emit now, whether a stop string was
        hit)."""
        if self.stopped:
            return "", True
        table, skip, size = self._table, self._skip, len(self._table)
        # Ids past the tokenizer's vocabulary (models pad their embedding) decode to nothing.
        data = b"".join(table[i] for i in new_token_ids if i not in skip and 0 <= i < size)
        if data and not self._seen_bytes:
            self._seen_bytes = True
            if self._strip_first_space and data.startswith(b" "):
                data = data[1:]
        return self._emit(self._utf8.decode(data))

    def flush(self) -> str:
        """At finish: the rest of the held-back text, unless a stop string ends it.

        An incomplete trailing character (generation stopped inside its bytes, e.g. at max_tokens)
        is dropped rather than shown as U+FFFD: it is not text, and no delta carries U+FFFD for it.
        A full decode of the same ids ends with U+FFFD there instead."""
        if self.stopped:
            return ""
        self._utf8.reset()
        delta, self._held = self._held, ""
        self.text += delta
        return delta

    def _emit(self, new_text: str) -> tuple[str, bool]:
        if not self._stops:
            self.text += new_text
            return new_text, False
        if not new_text:
            return "", False
        # A stop string not wholly inside emitted text starts inside the held text or later:
        # otherwise its start would be a suffix of the text that is a stop prefix, and held.
        buf = self._held + new_text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.stop_string = next(s for s in self._stops if buf.startswith(s, cut))
            self._held = ""
            self.text += buf[:cut]
            return buf[:cut], True
        keep = 0
        for k in range(min(len(buf), self._longest_prefix), 0, -1):
            if buf[-k:] in self._stop_prefixes:
                keep = k
                break
        out = buf[: len(buf) - keep]
        self._held = buf[len(buf) - keep :]
        self.text += out
        return out, False
