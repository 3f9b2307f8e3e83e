"""Text <-> token ids, and the chat template.

One `Tokenizer` class wraps a `tokenizers` fast tokenizer, whichever way it was made:

- `from_hf_dir(dir)`: a Hugging Face model directory (tokenizer.json, tokenizer_config.json, and
  optionally chat_template.jinja / generation_config.json).
- `from_gguf(reader)`: a GGUF file has no tokenizer.json; it stores vocabulary, merges, token types
  and special ids as metadata under llama.cpp's key names. We rebuild the byte-level BPE tokenizer
  from those. The pre-tokenizer (how text is cut into words before BPE) is not stored, only named
  (`tokenizer.ggml.pre`); we map the name to the split rules the vocabulary was trained with, as
  llama.cpp does. For SmolLM2 ("smollm") that is: every numeral on its own, then GPT-2's word regex
  (the original tokenizer.json has Digits(individual_digits) before ByteLevel).
  transformers' GGUF loader (5.x) leaves the digit split out. Its ids then differ where whitespace
  runs precede a digit ("\n\n1." -> "\n", "\n", "1" there; "\n\n", "1" here and in training) or
  around non-ASCII numerals; everywhere else they are the same.
  A SentencePiece vocabulary (tokenizer.ggml.model "llama": Gemma, Llama 2) becomes a BPE with
  byte fallback: spaces are "\u2581", the merges follow from the vocabulary where the file has none
  (Gemma's), control and user-defined tokens (<start_of_turn>, "\n", ...) are matched whole.

The detokenizer needs each token's raw bytes (a byte-level token may hold half a UTF-8 character);
`token_bytes` provides them, built once from the vocabulary.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from sluice.engine import tool_formats
from sluice.engine.errors import EngineError, ModelError
from sluice.engine.reasoning_formats import ReasoningFormat
from sluice.engine.tool_formats import ToolFormat

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4
_SPM_SPACE = "\u2581"  # how SentencePiece spells a space

# Special tokens that end a generation in the chat models we know, besides the declared eos:
# a chat model ends its turn with these, a base model may emit an end-of-text marker instead.
# (llama.cpp keeps a similar list of "end of generation" tokens.)
_END_OF_GENERATION = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
)

# Word-splitting regexes for byte-level BPE vocabularies (used with `Split` before `ByteLevel`).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> how to pre-tokenize. "gpt2": GPT-2's regex (built into ByteLevel);
# "digits+gpt2": each digit isolated first; otherwise a regex for Split.
_GGUF_PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"], "gpt2"),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"],
        "digits+gpt2",
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}
_IGNORE_MERGES = {_LLAMA3_SPLIT}  # llama3-style vocabularies look a whole word up before merging


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_unicode().items()}


class Tokenizer:
    """A fast tokenizer plus what serving needs around it: special ids, chat template, token
    bytes."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        template_tokens: Mapping[str, str | None] | None = None,
        source: str = "",
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        # bos_token / eos_token / ... strings handed to the chat template, as transformers does.
        self.template_tokens = dict(template_tokens or {})
        self.source = source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_texts = frozenset(t.content for t in added.values())
        self._compiled_template: jinja2.Template | None = None
        # How the model writes tool calls: chosen from the template unless set (`tool_formats`).
        self.tool_format: ToolFormat = tool_formats.detect(chat_template)(self)
        # How a reasoning model's thinking is told from its answer (`reasoning_formats`); None:
        # its text is all content (a parser is named, never guessed, as in vLLM).
        self.reasoning_format: ReasoningFormat | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelError(
                "no tokenizer.json in the model directory (only fast tokenizers are supported)",
                tok_file,
            )
        try:
            backend = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise ModelError(f"cannot read tokenizer: {e}", tok_file) from e
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen_config = _read_json(os.path.join(path, "generation_config.json"))

        template = _pick_template(config.get("chat_template"))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):  # newer transformers save the template on its own
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        elif template is None:
            template = _pick_template(
                _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
            )

        names = {
            k: _token_content(config.get(k))
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        bos_id = backend.token_to_id(names["bos_token"]) if names["bos_token"] else None
        eos = [backend.token_to_id(names["eos_token"])] if names["eos_token"] else []
        gen_eos = gen_config.get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        if bos_id is None and isinstance(gen_config.get("bos_token_id"), int):
            bos_id = gen_config["bos_token_id"]
        eos_ids = [i for i in eos if isinstance(i, int)] + _end_of_generation_ids(backend)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=template,
            template_tokens=names,
            source=path,
        )

    @classmethod
    def from_gguf(cls, reader: Any, path: str | None = None) -> Tokenizer:
        """Build the tokenizer from a GGUF file's metadata (`loader.gguf_file.GGUFFile`, or a
        `gguf.GGUFReader`)."""
        return cls.from_gguf_metadata(reader.fields, path=path or str(getattr(reader, "path", "")))

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any], path: str | None = None) -> Tokenizer:
        """Same as `from_gguf`, from `reader.fields` or from a dict of already-decoded values."""
        meta = _GGUFMeta(fields, path or "gguf")
        kind = meta.get("tokenizer.ggml.model")
        build = _GGUF_TOKENIZER_MODELS.get(kind)
        if build is None:
            raise ModelError(
                f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece BPE)",
                "tokenizer.ggml.model",
            )
        tokens: list[str] = meta.require("tokenizer.ggml.tokens")
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = build(meta, tokens, token_types)

        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        _set_post_processor(
            backend,
            tokens,
            bos_id if meta.get("tokenizer.ggml.add_bos_token") else None,
            eos_id if meta.get("tokenizer.ggml.add_eos_token") else None,
        )
        eos_ids = [
            eos_id,
            meta.get("tokenizer.ggml.eot_token_id"),
            meta.get("tokenizer.ggml.eom_token_id"),
        ]
        eos_ids = [i for i in eos_ids if i is not None and 0 <= i < len(tokens)]

        def name(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids + _end_of_generation_ids(backend),
            chat_template=meta.get("tokenizer.chat_template"),
            template_tokens={
                "bos_token": name("bos_token_id"),
                "eos_token": name("eos_token_id"),
                "unk_token": name("unknown_token_id"),
                "pad_token": name("padding_token_id"),
            },
            source=path or "gguf",
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. <|im_start|>) are
        recognised."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_added_token(self, text: str) -> bool:
        """Whether `text` is one of the vocabulary's added tokens (matched whole in text)."""
        return text in self._added_texts

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @functools.cached_property
    def token_bytes(self) -> tuple[bytes, ...]:
        """Raw bytes of every token id, such that joining them and decoding UTF-8 (with replacement)
        gives `decode(ids, skip_special_tokens=False)` (modulo `strips_leading_space`)."""
        return tuple(_token_bytes_table(self.backend))

    @functools.cached_property
    def strips_leading_space(self) -> bool:
        """True when decode drops the space a sentencepiece tokenizer put before the first word."""
        return _decoder_strips_leading_space(json.loads(self.backend.to_str()).get("decoder"))

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render the conversation with the model's jinja chat template (sandboxed, as transformers
        does)."""
        if not self.chat_template:
            raise EngineError(
                "the model has no chat template; send a plain prompt instead", "chat_template"
            )
        chat = _normalize_messages(messages)
        if template_kwargs.get("tools") is not None or any(
            m.get("tool_calls") or m["role"] == "tool" for m in chat
        ):
            chat, template_kwargs["tools"] = tool_formats.template_inputs(
                self.tool_format,
                tool_formats.template_renders_tools(self.chat_template),
                chat,
                template_kwargs.get("tools"),
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        context = {**self.template_tokens, "tools": None, "documents": None, **template_kwargs}
        try:
            return self._compiled_template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:  # includes raise_exception() from the template
            raise EngineError(f"chat template rejected the conversation: {e}", "messages") from e

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation. The template writes its own BOS, so none is
        added."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"eos={self.eos_token_ids})"
        )


# ---------------------------------------------------------------------- helpers


def _byte_level_pre_tokenizer(split: str) -> pre_tokenizers.PreTokenizer:
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_bpe_from_gguf(
    meta: _GGUFMeta, tokens: list[str], token_types: list[int]
) -> tokenizers.Tokenizer:
    """GPT-2-style byte-level BPE (tokenizer.ggml.model "gpt2"): vocabulary and merges from the
    file, the word split named by tokenizer.ggml.pre."""
    merges: list[str] = meta.require("tokenizer.ggml.merges")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    split = _GGUF_PRE_TOKENIZERS.get(pre)
    if split is None:
        log.warning("GGUF pre-tokenizer %r unknown; using GPT-2's word split", pre)
        split = "gpt2"
    bpe = models.BPE(
        vocab=vocab,
        merges=[_merge_pair(m) for m in merges],
        ignore_merges=split in _IGNORE_MERGES,
    )
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) are matched whole in text and are "special" (skipped on
    # decode); user-defined ones are matched whole but kept. A control token spelled outside the
    # byte alphabet is a mislabel in the file; adding it would grow the vocabulary, so skip it.
    alphabet = set(_unicode_to_byte())
    kept = [
        (t, ty) for t, ty in zip(tokens, token_types) if ty != _GGUF_CONTROL or set(t) <= alphabet
    ]
    _add_gguf_added_tokens(backend, [t for t, _ in kept], [ty for _, ty in kept])
    return backend


def _sentencepiece_bpe_from_gguf(
    meta: _GGUFMeta, tokens: list[str], token_types: list[int]
) -> tokenizers.Tokenizer:
    """SentencePiece BPE (tokenizer.ggml.model "llama": Llama 2, Gemma, ...): spaces are "\u2581",
    text no piece covers falls back to byte tokens "<0xNN>", and no word split.

    Gemma files have no merges; they follow from the vocabulary (`_merges_from_vocab`). Gemma's
    pieces of two or more spaces are stored with real spaces, but its text is matched after spaces
    became "\u2581": they are spelled back so that they can be found. The decoder turns "\u2581"
    into spaces and byte pieces into bytes, so decoding gives the text back exactly."""
    gemma = str(meta.get("general.architecture") or "").startswith("gemma")
    if gemma:
        # (plain pieces then, found after spaces became "\u2581", not added tokens matched in the
        # raw text, where only a literal "\u2581\u2581" could match them)
        runs = {i for i, t in enumerate(tokens) if t and not t.strip(" ")}
        tokens = [_SPM_SPACE * len(t) if i in runs else t for i, t in enumerate(tokens)]
        token_types = [1 if i in runs else ty for i, ty in enumerate(token_types)]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [_merge_pair(m) for m in merges]
    else:
        # Gemma's scores do not follow its merge order, its piece order does (transformers' GGUF
        # loader ranks them so too); other SentencePiece models rank merges by score.
        scores = meta.get("tokenizer.ggml.scores")
        if gemma or scores is None:
            rank = [-float(i) for i in range(len(tokens))]
        else:
            rank = [float(x) for x in scores]
        pairs = _merges_from_vocab(vocab, rank)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab=vocab,
        merges=pairs,
        unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(bpe)
    # llama.cpp puts a "\u2581" before the text unless the file says not to (Gemma says not to).
    if meta.get("tokenizer.ggml.add_space_prefix") is False:
        backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
        backend.decoder = decoders.Sequence(
            [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPM_SPACE, prepend_scheme="first", split=False
        )
        backend.decoder = decoders.Sequence(
            [
                decoders.Replace(_SPM_SPACE, " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),  # the space put before the text
            ]
        )
    _add_gguf_added_tokens(backend, tokens, token_types)
    return backend


# tokenizer.ggml.model -> how to build the tokenizer from the file's vocabulary
_GGUF_TOKENIZER_MODELS = {
    "gpt2": _byte_level_bpe_from_gguf,
    "llama": _sentencepiece_bpe_from_gguf,
}


def _add_gguf_added_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]
) -> None:
    """Control tokens (<|im_start|>, <start_of_turn>, ...) are matched whole in text and are
    "special" (skipped on decode); user-defined ones are matched whole but kept."""
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, token_types)
        if ty == _GGUF_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, token_types)
        if ty == _GGUF_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _merges_from_vocab(vocab: Mapping[str, int], rank: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every way to cut a piece into two pieces
    of the vocabulary, best-ranked piece first; for one piece, the longer left part first."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece, i in vocab.items():
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-rank[i], i, -cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _set_post_processor(
    backend: tokenizers.Tokenizer, tokens: list[str], bos: int | None, eos: int | None
) -> None:
    """Add BOS/EOS around encoded text when the file asks for it
    (tokenizer.ggml.add_{bos,eos}_token)."""
    if bos is None and eos is None:
        return
    pre = [(tokens[bos], bos)] if bos is not None else []
    post = [(tokens[eos], eos)] if eos is not None else []
    a = " ".join([*(t for t, _ in pre), "$A", *(t for t, _ in post)])
    b = " ".join([*(t for t, _ in pre), "$B:1", *(t + ":1" for t, _ in post)])
    backend.post_processor = processors.TemplateProcessing(
        single=a, pair=f"{a} {b}", special_tokens=list(dict.fromkeys(pre + post))
    )


def _end_of_generation_ids(backend: tokenizers.Tokenizer) -> list[int]:
    added = backend.get_added_tokens_decoder()
    specials = {t.content: i for i, t in added.items() if t.special}
    return [specials[name] for name in _END_OF_GENERATION if name in specials]


def _token_bytes_table(backend: tokenizers.Tokenizer) -> list[bytes]:
    """Each token's bytes, read off the vocabulary according to the decoder the tokenizer uses."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = _decoder_kinds(decoder)
    size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    table: list[bytes] = []
    if "ByteLevel" in kinds:
        inverse = _unicode_to_byte()
        for i in range(size):
            if i in added:
                # Added tokens are plain text; the decoder maps their characters only when all of
                # them are in the byte alphabet (printable ASCII maps to itself).
                t = added[i].content
            else:
                t = backend.id_to_token(i) or ""
            try:
                table.append(bytes(inverse[c] for c in t))
            except KeyError:
                table.append(t.encode("utf-8"))
        return table
    spm = "Metaspace" in kinds or "Replace" in kinds
    byte_fallback = "ByteFallback" in kinds
    byte_token = re.compile(r"<0x([0-9A-Fa-f]{2})>")
    for i in range(size):
        # The decoder maps added tokens too (one may spell a space "▁").
        t = added[i].content if i in added else backend.id_to_token(i) or ""
        m = byte_token.fullmatch(t) if byte_fallback else None
        if m:
            table.append(bytes([int(m.group(1), 16)]))
        elif spm:
            table.append(t.replace("\u2581", " ").encode("utf-8"))
        else:  # an unfamiliar decoder: fall back to the token decoded on its own
            table.append(backend.decode([i], skip_special_tokens=False).encode("utf-8"))
    return table


def _decoder_kinds(decoder: Mapping | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in decoder.get("decoders", [])))
    return {decoder.get("type", "")}


def _decoder_strips_leading_space(decoder: Mapping | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "Sequence":
        return any(_decoder_strips_leading_space(d) for d in decoder.get("decoders", []))
    if decoder.get("type") == "Strip":
        return decoder.get("content") == " " and decoder.get("start", 0) >= 1
    if decoder.get("type") == "Metaspace":
        scheme = decoder.get(
            "prepend_scheme", "always" if decoder.get("add_prefix_space", True) else "never"
        )
        return scheme != "never"
    return False


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read JSON: {e}", path) from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens either as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """A chat_template entry is a string, or a list of named templates of which we use "default"."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Check the shape templates rely on; flatten OpenAI-style lists of text parts into a string."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise EngineError("must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise EngineError(f"message {i} needs a string 'role'", f"messages[{i}].role")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (
                    isinstance(part, Mapping)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise EngineError("only text parts are supported", f"messages[{i}].content")
                texts.append(part["text"])
            m["content"] = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise EngineError("must be a string or a list of text parts", f"messages[{i}].content")
        out.append(m)
    return out


class _TemplateRaised(jinja2.TemplateError):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys=False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates want plain JSON, as transformers
    # gives.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ModelError(f"invalid jinja template: {e}", "chat_template") from e


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge rule "left right" as the pair BPE takes."""
    left, _, right = merge.partition(" ")
    return left, right


class _GGUFMeta:
    """Typed access to GGUF metadata, from GGUFReader fields or from plain decoded values."""

    def __init__(self, fields: Mapping[str, Any], source: str):
        self.fields = fields
        self.source = source

    def get(self, key: str) -> Any:
        field = self.fields.get(key)
        if field is None:
            return None
        if not hasattr(field, "parts"):  # already a plain value
            return field
        return _gguf_field_value(field)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelError(f"GGUF file lacks tokenizer metadata {key!r}", key)
        return value


def _gguf_field_value(field: Any) -> Any:
    """Decode a gguf.ReaderField. Newer gguf versions have `.contents()`; older ones only
    `.parts`."""
    if hasattr(field, "contents"):
        return field.contents()
    import gguf  # only reached with old gguf versions

    types = list(field.types)
    if not types:
        return None

    def one(idx: int, ty: Any) -> Any:
        part = field.parts[idx]
        if ty == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    if types[0] == gguf.GGUFValueType.ARRAY:
        return [one(i, types[-1]) for i in field.data]
    return one(field.data[0], types[0])
