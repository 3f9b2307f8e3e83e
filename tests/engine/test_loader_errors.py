"""Loader errors name the file and the field (or tensor) at fault."""

from __future__ import annotations

import json

import pytest
import torch
from _hf_models import build
from safetensors.torch import load_file, save_file

from sluice.engine.errors import EngineError
from sluice.engine.loader import load_model


@pytest.fixture
def tiny_dir(tmp_path):
    build("llama").save_pretrained(tmp_path)
    return tmp_path


def _rewrite(path, edit):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return f


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(EngineError) as e:
        load_model(str(missing))
    assert str(missing) in str(e.value) and e.value.field == "model"


def test_unknown_architecture(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError) as e:
        load_model(tiny_dir, load_tokenizer=False)
    msg = str(e.value)
    assert (
        str(tiny_dir / "config.json") in msg
        and "GPT2LMHeadModel" in msg
        and e.value.field == "architectures"
    )


def test_missing_tensor(tiny_dir):
    _rewrite(tiny_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(EngineError) as e:
        load_model(tiny_dir, load_tokenizer=False)
    msg = str(e.value)
    assert str(tiny_dir) in msg and "model.layers.1.mlp.up_proj.weight" in msg and "[96, 64]" in msg
    assert e.value.field == "model.layers.1.mlp.up_proj.weight"


def test_wrong_shape(tiny_dir):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    f = _rewrite(tiny_dir, edit)
    with pytest.raises(EngineError) as e:
        load_model(tiny_dir, load_tokenizer=False)
    msg = str(e.value)
    assert str(f) in msg and "model.layers.0.self_attn.k_proj.weight" in msg
    assert "[16, 64]" in msg and "[32, 64]" in msg


def test_missing_shard(tmp_path):
    build("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(EngineError) as e:
        load_model(tmp_path, load_tokenizer=False)
    assert "model.safetensors.index.json" in str(e.value) and shard.name in str(e.value)


def test_no_weights_and_bad_config(tiny_dir):
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(EngineError, match="model.safetensors"):
        load_model(tiny_dir, load_tokenizer=False)
    (tiny_dir / "config.json").write_text("{not json")
    with pytest.raises(EngineError) as e:
        load_model(tiny_dir, load_tokenizer=False)
    assert str(tiny_dir / "config.json") in str(e.value)


def test_unsupported_config_values(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    for key, value in [
        ("hidden_act", "gelu"),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}),
    ]:
        (tiny_dir / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(EngineError) as e:
            load_model(tiny_dir, load_tokenizer=False)
        assert str(tiny_dir / "config.json") in str(e.value)


def test_not_a_model(tmp_path):
    (tmp_path / "junk.bin").write_bytes(b"hello world")
    with pytest.raises(EngineError, match="GGUF"):
        load_model(tmp_path / "junk.bin")
    with pytest.raises(EngineError, match="config.json"):
        load_model(tmp_path)


def test_hf_dir_loads_tokenizer(tiny_dir):
    """A directory with tokenizer.json gets TEXT's tokenizer; one without says which file is
    missing."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    with pytest.raises(EngineError, match="tokenizer.json"):
        load_model(tiny_dir)
    vocab = {f"t{i}": i for i in range(101)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tiny_dir / "tokenizer.json"))
    loaded = load_model(tiny_dir)
    assert loaded.tokenizer.encode("t5 t7", add_special_tokens=False) == [5, 7]
