"""GGUF SentencePiece tokenizers (tokenizer.ggml.model "llama"): the same ids and text as
transformers' GGUF loader, on a tiny Gemma-style file written here and on Gemma 3 270M's own
file."""

from __future__ import annotations

import gguf
import pytest
import tokenizers
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import models, normalizers, trainers

from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.errors import EngineError
from sluice.engine.loader import catalog
from sluice.engine.loader.gguf_file import GGUFFile
from sluice.engine.tokenizer import Tokenizer
from tests.hf_reference import reference_tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing spaces   ",
    "  leading  and   multiple    spaces\t\ttabs\n\n\nnewlines  \r\n",
    "def f(x):\n    return x**2  # comment\n\nclass A:\n\tpass\n",
    "12345 + 678 = 7023, pi = 3.14159, 2024-11-30",
    "café naïve résumé Ørsted Ångström façade jalapeño",
    "日本語のテキスト 中文字符 한국어 텍스트",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ❤️",
    "byte fallback: \x00\x01\x7f \U0001d518\U0001d52b\U0001d526 \U000e0041 \ufffe",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "a<end_of_turn>b<eos>c<table><tr>",
    "\u2581literal\u2581lower\u2581blocks\u2581",
    " \u2581\u2581  mixed\u2581 ",
    "",
    " ",
    "\n",
]


def _check_same_as_transformers(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False
    )
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ours.encode(text, add_special_tokens=False), False) == _spm_text(ours, text)


def _spm_text(ours: Tokenizer, text: str) -> str:
    """The text back from its ids: exact, except that SentencePiece reads a "\u2581" written in
    the text as a space (transformers and SentencePiece itself give a space back too), and that
    the Llama 2 style (a space put before the text, stripped on decoding) puts none before text
    that starts with a space, as transformers does, so one is lost."""
    text = text.replace("\u2581", " ")
    return text.removeprefix(" ") if ours.strips_leading_space else text


def _check_streams_back(ours: Tokenizer, text: str) -> None:
    """token_bytes and the incremental detokenizer give the text back, one token at a time."""
    ids = ours.encode(text, add_special_tokens=False)
    joined = b"".join(ours.token_bytes[i] for i in ids).decode("utf-8")
    if ours.strips_leading_space:  # the space put before the text, as the detokenizer does
        joined = joined.removeprefix(" ")
    assert joined == _spm_text(ours, text)
    detok = IncrementalDetokenizer(ours, skip_special_tokens=False)
    streamed = "".join(detok.add([i])[0] for i in ids) + detok.flush()
    assert streamed == _spm_text(ours, text)


# ---------------------------------------------------------------------- a tiny Gemma-style file

_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "the theory of the thing, then there they were",
    "def f(x):\n    return x  # done",
] * 10


def _tiny_spm_gguf(path, arch: str = "gemma3") -> str:
    """A SentencePiece BPE vocabulary laid out as llama.cpp writes Gemma's: control tokens, "\\n"
    and runs of real spaces as user-defined tokens, 256 byte tokens, then pieces in merge order;
    no merges, scores that do not follow the merge order. With arch "llama", Llama 2's way: a
    space put before the text, merges ranked by score."""
    trainer_model = tokenizers.Tokenizer(models.BPE())
    trainer_model.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_model.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=200))
    trained = sorted(trainer_model.get_vocab().items(), key=lambda kv: kv[1])
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "  ", "   ", "<b>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    # (runs of spaces stand only as the user-defined tokens, as in Gemma's file)
    spelled = {t.replace(" ", "\u2581") for t in user}
    pieces = [t for t, _ in trained if t not in user and t not in spelled]
    tokens = control + user + byte_tokens + pieces
    types = [3] * len(control) + [4] * len(user) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [float(-(i % 7)) for i in range(len(pieces))]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(arch == "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _tiny_pair(tmp_path_factory, arch: str):
    path = _tiny_spm_gguf(tmp_path_factory.mktemp("spm") / f"tiny-{arch}.gguf", arch)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    parent, _, name = path.rpartition("/")
    theirs = transformers.AutoTokenizer.from_pretrained(parent, gguf_file=name)
    return ours, theirs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_pair(tmp_path_factory, "gemma3")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _tiny_pair(tmp_path_factory, "llama")


@pytest.mark.parametrize("text", TEXTS + _CORPUS[:3] + ["the  theory\n\n\nthen   there"])
@pytest.mark.parametrize("which", ["tiny", "tiny_llama"])
def test_tiny_sentencepiece_gguf_matches_transformers(request, which, text):
    ours, theirs = request.getfixturevalue(which)
    _check_same_as_transformers(ours, theirs, text)
    _check_streams_back(ours, text)


def test_tiny_sentencepiece_gguf_pieces(tiny):
    ours, _ = tiny
    assert ours.vocab_size == len(ours.token_bytes)
    assert ours.bos_token_id == 2 and ours.eos_token_ids == (1, ours.token_to_id("<end_of_turn>"))
    assert ours.encode("the") == [2, ours.token_to_id("the")]  # BOS; no space put before the text
    assert ours.encode("<start_of_turn>", add_special_tokens=False) == [4]  # matched whole
    # A character no piece covers falls back to its UTF-8 bytes, which decode back to it.
    e_acute = ours.encode("é", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in e_acute] == ["<0xC3>", "<0xA9>"]
    assert ours.decode(e_acute) == "é"
    assert ours.token_bytes[e_acute[0]] == b"\xc3"
    # Runs of spaces are stored with real spaces; they decode to spaces.
    assert ours.token_bytes[ours.token_to_id("\u2581\u2581")] == b"  "
    assert ours.decode(ours.encode(" a  b")) == " a  b"
    assert ours.strips_leading_space is False


def test_tiny_sentencepiece_gguf_from_decoded_metadata(tiny, tmp_path):
    """`from_gguf_metadata` takes plain values as well as reader fields."""
    ours, _ = tiny
    reader = gguf.GGUFReader(_tiny_spm_gguf(tmp_path / "again.gguf"))
    plain = {k: f.contents() for k, f in reader.fields.items()}
    again = Tokenizer.from_gguf_metadata(plain)
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)


# ---------------------------------------------------------------------- Gemma 3 270M's own file


@pytest.fixture(scope="module")
def gemma():
    try:
        path = catalog.locate("gemma3-270m")
    except EngineError as e:
        pytest.skip(f"the Gemma 3 270M file is not installed (sluice models pull gemma3-270m): {e}")
    ours = Tokenizer.from_gguf(GGUFFile(str(path)), str(path))  # (the engine's own reader)
    return ours, reference_tokenizer(path)


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(gemma):
    ours, theirs = gemma
    for text in TEXTS:
        _check_same_as_transformers(ours, theirs, text)
        _check_streams_back(ours, text)


# Any characters, mixed with runs of spaces, newlines, "\u2581" and control tokens
_random_text = st.lists(
    st.one_of(
        st.characters(exclude_categories=("Cs",)),
        st.sampled_from(["  ", "\n", "\t", "\u2581", "<start_of_turn>", "<end_of_turn>", "<b>"]),
    ),
    max_size=40,
).map("".join)


@pytest.mark.slow
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=_random_text)
def test_gemma3_random_text_matches_transformers(gemma, text):
    ours, theirs = gemma
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids, False) == _spm_text(ours, text) == theirs.decode(ids)


@pytest.mark.slow
def test_gemma3_special_tokens(gemma):
    ours, _ = gemma
    assert ours.vocab_size == 262144
    assert ours.bos_token_id == 2 == ours.token_to_id("<bos>")
    # <eos> from the file, <end_of_turn> (the file names no eot token) so that chat replies stop
    assert ours.eos_token_ids == (1, ours.token_to_id("<end_of_turn>")) == (1, 106)
    assert ours.encode("<start_of_turn>user\n", add_special_tokens=False) == [
        105,
        ours.token_to_id("user"),
        ours.token_to_id("\n"),
    ]
    # "<bos>The capital of France is", as llama.cpp tokenizes it (tests/engine/test_gguf_loader.py)
    assert ours.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]


@pytest.mark.slow
def test_gemma3_file_has_no_chat_template(gemma):
    """This (base model) file carries no tokenizer.chat_template: both refuse a conversation."""
    ours, theirs = gemma
    assert ours.chat_template is None and theirs.chat_template is None
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(EngineError, match="no chat template"):
        ours.apply_chat_template(chat)
    with pytest.raises(ValueError):
        theirs.apply_chat_template(chat, tokenize=False)


@pytest.mark.slow
def test_gemma3_270m_runs_whole_from_its_file():
    """The file loads with its tokenizer (catalog: served) and greedily goes on about France."""
    from sluice.engine.config import EngineConfig
    from sluice.engine.engine import LLMEngine
    from sluice.engine.sampling_params import SamplingParams

    try:
        path = catalog.locate("gemma3-270m")
    except EngineError as e:
        pytest.skip(f"the Gemma 3 270M file is not installed (sluice models pull gemma3-270m): {e}")
    assert catalog.MODELS["gemma3-270m"].served
    engine = LLMEngine(str(path), config=EngineConfig(kv_cache_bytes=64 << 20))
    params = SamplingParams(max_tokens=16, temperature=0)
    out = engine.generate(["The capital of France is"], params=params)[0]
    assert "France" in out.text, out.text
    assert out.text == engine.tokenizer.decode(out.token_ids)
