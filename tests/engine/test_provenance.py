"""Provenance as the engine reports it: the weights by the sha256 of the file they were read from,
the tokenizer and chat template by content, the settings and the hardware that decide the
numerics; and which fields differ from another run's."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from sluice.engine import provenance
from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.loader.default import default_model_path
from sluice.engine.provenance import weights_sha256


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(config=EngineConfig(kv_cache_bytes=64 << 20))


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def test_names_the_weights_tokenizer_and_template_by_content(engine):
    p = engine.provenance
    assert p.weights_sha256 == file_sha256(default_model_path())
    assert (
        p.tokenizer_sha256 == hashlib.sha256(engine.tokenizer.backend.to_str().encode()).hexdigest()
    )
    template = engine.tokenizer.chat_template
    assert p.chat_template_sha256 == hashlib.sha256(template.encode()).hexdigest()
    assert p.model == engine.model_id


def test_names_the_software_settings_and_hardware(engine):
    p = engine.provenance
    assert p.torch_version == torch.__version__
    assert (p.dtype, p.quantization, p.kv_cache_dtype) == ("float32", None, "float32")
    assert p.kernels == engine.kernels and p.deterministic is False
    assert p.device == "cpu"
    with open("/proc/cpuinfo") as f:
        info = f.read()
    flags = set(next(line for line in info.splitlines() if line.startswith("flags")).split())
    assert set(p.cpu_features) <= flags and p.cpu_features
    assert p.device_name in info
    if engine.kernels == "native":
        assert "-march=native" in p.native_build
    json.dumps(p.to_dict())  # goes on the wire as it is


def test_another_setting_is_named_among_the_differences(engine):
    other = LLMEngine(
        config=EngineConfig(kv_cache_bytes=64 << 20, dtype="bfloat16", deterministic=True)
    )
    recorded = other.provenance.to_dict()
    assert recorded["kernels"] == "deterministic" and recorded["deterministic"] is True
    assert set(engine.provenance.differences(recorded)) == {
        "dtype",
        "kv_cache_dtype",
        "kernels",
        "deterministic",
    }
    assert engine.provenance.differences(engine.provenance.to_dict()) == {}
    assert recorded["weights_sha256"] == engine.provenance.weights_sha256


def test_a_weights_digest_is_read_once_until_its_files_change(tmp_path, monkeypatch):
    reads = []
    hash_file = provenance._hash_file
    monkeypatch.setattr(
        provenance, "_hash_file", lambda digest, path: (reads.append(path), hash_file(digest, path))
    )
    cache = tmp_path / "cache"
    model = tmp_path / "model.gguf"
    model.write_bytes(b"a" * 1000)
    first = weights_sha256(str(model), {}, cache)
    assert first == hashlib.sha256(b"a" * 1000).hexdigest() and len(reads) == 1
    assert weights_sha256(str(model), {}, cache) == first and len(reads) == 1
    # rewritten in place with as many bytes: its time tells
    model.write_bytes(b"b" * 1000)
    later = model.stat().st_mtime_ns + 10**9
    os.utime(model, ns=(later, later))
    assert weights_sha256(str(model), {}, cache) == hashlib.sha256(b"b" * 1000).hexdigest()
    assert len(reads) == 2

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "b.safetensors").write_bytes(b"second")
    (folder / "a.safetensors").write_bytes(b"first")
    want = hashlib.sha256(b"a.safetensors\0first" + b"b.safetensors\0second").hexdigest()
    assert weights_sha256(str(folder), {}, cache) == want
    assert weights_sha256(str(folder), {}, cache) == want and len(reads) == 4
    (folder / "c.safetensors").write_bytes(b"third")  # a file more: hashed again
    assert (
        weights_sha256(str(folder), {}, cache)
        == hashlib.sha256(
            b"a.safetensors\0first" + b"b.safetensors\0second" + b"c.safetensors\0third"
        ).hexdigest()
    )
    assert len(reads) == 7


def test_names_the_tool_call_format_and_a_parser_chosen_over_the_templates(engine):
    from sluice.actors.pipeline import Pipeline, PipelineConfig

    assert engine.provenance.tool_format == engine.tokenizer.tool_format.name == "hermes"
    assert engine.provenance.reasoning_format is None  # (none unless named)
    was = engine.tokenizer.tool_format, engine.tokenizer.reasoning_format, engine.provenance
    try:
        config = PipelineConfig(tool_call_parser="llama3_json", reasoning_parser="deepseek_r1")
        Pipeline(config)._choose_formats(engine.tokenizer, engine)
        assert engine.provenance.tool_format == engine.tokenizer.tool_format.name == "llama3_json"
        assert engine.tokenizer.reasoning_format is not None
        assert engine.provenance.reasoning_format == engine.tokenizer.reasoning_format.name
        assert engine.provenance.reasoning_format == "deepseek_r1"
    finally:
        engine.tokenizer.tool_format, engine.tokenizer.reasoning_format, engine.provenance = was
