"""Incremental detokenizer: real SmolLM2 token ids fed one by one; stop strings across tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.errors import EngineError
from sluice.engine.loader.default import default_model_path
from sluice.engine.loader.gguf_file import GGUFFile
from sluice.engine.tokenizer import Tokenizer

GGUF_PATH = str(default_model_path())  # the default model: a requirement, installed by bootstrap

_SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(str(GGUF_PATH)), str(GGUF_PATH))


def stream(tok, ids, stop=(), chunks=None, skip_special_tokens=True):
    """Feed ids (one at a time, or in the given chunk sizes); return (deltas, stopped, ids
    consumed)."""
    d = IncrementalDetokenizer(tok, [], list(stop), skip_special_tokens)
    deltas, pos, sizes = [], 0, iter(chunks or [])
    while pos < len(ids):
        size = next(sizes, 1)
        delta, hit = d.add(ids[pos : pos + size])
        pos += size
        deltas.append(delta)
        if hit:
            return deltas, True, pos, d
    deltas.append(d.flush())
    return deltas, False, pos, d


MULTIBYTE = [
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 heart ❤️ done",
    "日本語のテキストと中文字符、한국어 텍스트도 있습니다。",
    "café naïve résumé Ørsted Ångström façade jalapeño ﬁ ligature",
    "mixed: Привет 😀 мир — “quotes” … ½ ² ∑∫",
]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_characters_are_held_until_complete(tok, text):
    ids = tok.encode(text)
    assert len(tok.token_bytes[ids[0]]) >= 1
    deltas, stopped, _, d = stream(tok, ids)
    assert not stopped
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == d.text == tok.decode(ids) == text
    # Some prefix of the ids ends mid-character: a plain decode of it shows U+FFFD, while the
    # stream so far holds the partial character back.
    held = [t for t in range(1, len(ids)) if tok.decode(ids[:t]).endswith("\ufffd")]
    assert held, "expected a token that splits a character"
    for t in held:
        assert "".join(deltas[:t]) == tok.decode(ids[:t]).rstrip("\ufffd")


@_SETTINGS
@given(
    text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60),
    seed=st.integers(0, 2**16),
)
def test_random_text_streams_exactly(tok, text, seed):
    ids = tok.encode(text)
    rng = random.Random(seed)
    chunks = [rng.randint(1, 3) for _ in ids]
    deltas, stopped, _, _ = stream(tok, ids, chunks=chunks)
    assert not stopped
    # (SmolLM2's vocabulary lacks a few control bytes such as \x06, so decode may drop them.)
    assert "".join(deltas) == tok.decode(ids)
    # U+FFFD only where the full decode has one (bytes missing from the vocabulary break a
    # character).
    assert all("\ufffd" not in x for x in deltas) or "\ufffd" in tok.decode(ids)


@_SETTINGS
@given(ids=st.lists(st.integers(0, 49151), max_size=30))
def test_arbitrary_ids_match_full_decode(tok, ids):
    # Invalid byte sequences inside the text (a model can emit them) become U+FFFD exactly as in a
    # full decode; an incomplete character at the very end is dropped instead of shown as U+FFFD.
    for skip in (True, False):
        deltas, _, _, _ = stream(tok, ids, skip_special_tokens=skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        joined = "".join(deltas)
        assert joined == full or (
            full.startswith(joined) and set(full[len(joined) :]) == {"\ufffd"}
        )


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert "".join(stream(tok, ids)[0]) == "assistant\nHi there"
    assert (
        "".join(stream(tok, ids, skip_special_tokens=False)[0])
        == "<|im_start|>assistant\nHi there<|im_end|>"
    )


def test_ids_beyond_the_tokenizer_vocab_decode_to_nothing(tok):
    d = IncrementalDetokenizer(tok, [], [])
    assert d.add([49152 + 5]) == ("", False)


def test_stop_string_spanning_tokens(tok):
    text = "Hello world, this is a test."
    ids = tok.encode(text)
    assert tok.decode(ids[:1]) == "Hello"  # so "lo wo" spans two tokens
    deltas, stopped, used, d = stream(tok, ids, stop=["lo wo"])
    assert stopped and used == 2 and d.stop_string == "lo wo"
    assert deltas == ["Hel", ""]  # "lo" was held back: it might start the stop string
    assert d.text == "Hel"
    assert d.add(ids[2:]) == ("", True)  # nothing after a stop
    assert d.flush() == ""


def test_held_text_released_when_it_is_not_a_stop(tok):
    ids = tok.encode("Hello world")
    deltas, stopped, _, d = stream(tok, ids, stop=["lo there", "xyz"])
    assert not stopped
    assert deltas[0] == "Hel"
    assert "".join(deltas) == d.text == "Hello world"


def test_held_stop_prefix_released_at_finish(tok):
    ids = tok.encode("say hel")
    deltas, stopped, _, d = stream(tok, ids, stop=["hello"])
    assert not stopped and deltas[-1] == "hel"  # only flush() lets the possible prefix go
    assert d.text == "say hel"


def test_earliest_of_several_stops_wins(tok):
    ids = tok.encode("one two three four")
    # " two" completes both "two" and "e t"; the earlier in the text wins.
    deltas, stopped, used, d = stream(tok, ids, stop=["four", "two", "e t"])
    assert stopped and used == 2 and d.text == "on" and d.stop_string == "e t"


def test_stop_inside_a_single_token_and_multibyte_stop(tok):
    deltas, stopped, _, d = stream(tok, tok.encode("abc international xyz"), stop=["nation"])
    assert stopped and d.text == "abc inter"
    deltas, stopped, _, d = stream(tok, tok.encode("I like 😀 a lot"), stop=["😀"])
    assert stopped and d.text == "I like " and all("\ufffd" not in x for x in deltas)


def test_empty_stop_string_is_rejected(tok):
    with pytest.raises(EngineError) as e:
        IncrementalDetokenizer(tok, [], ["ok", ""])
    assert e.value.field == "stop"


_small = st.text(alphabet="ab \né😀", min_size=0, max_size=30)


@_SETTINGS
@given(
    text=_small,
    stops=st.lists(st.text(alphabet="ab \né😀", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_against_reference(tok, text, stops):
    ids = tok.encode(text)
    # Reference: generation stops at the first token whose text contains a stop string; the output
    # is that text up to the earliest stop in it.
    expected, first = tok.decode(ids), None
    for t in range(1, len(ids) + 1):
        prefix = tok.decode(ids[:t])
        found = [i for i in (prefix.find(s) for s in stops) if i >= 0]
        if found:
            expected, first = prefix[: min(found)], t
            break
    deltas, stopped, used, d = stream(tok, ids, stop=stops)
    assert stopped == (first is not None)
    assert "".join(deltas) == d.text == expected
    assert all("\ufffd" not in x for x in deltas)
    if stopped:
        assert used == first
