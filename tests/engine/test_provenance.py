"""Provenance as the engine reports it: the weights by the sha256 of the file they were read from,
the tokenizer and chat template by content, the settings and the hardware that decide the
numerics; and which fields differ from another run's."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.loader.default import default_model_path


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
