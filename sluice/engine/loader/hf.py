"""HF model directories: config.json + model.safetensors (or shards listed in
model.safetensors.index.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, torch_dtype
from ..errors import ModelError
from .tensor_names import (
    canonical_name,
    check_tensors,
    expected_shapes,
    fused_parts,
    layer_tensor,
    split_fused,
)


def read_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    try:
        d = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{cfg_file}: cannot read: {e}", field="config.json") from e
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # generation_config may add end-of-turn ids to config.json's eos
        try:
            gen = json.loads(gen_file.read_text())
        except (OSError, json.JSONDecodeError):
            gen = {}
        ids = [x for x in (d.get("eos_token_id"), gen.get("eos_token_id")) if x is not None]
        merged = []
        for x in ids:
            merged += x if isinstance(x, list) else [x]
        if merged:
            d = {**d, "eos_token_id": list(dict.fromkeys(merged))}
    return ModelConfig.from_hf_dict(d, source=str(cfg_file))


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelError(f"{index}: cannot read weight_map: {e}", field="weight_map") from e
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelError(
                    f"{index}: shard {f.name!r} listed in weight_map does not exist",
                    field="weight_map",
                )
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    hint = (
        " (pytorch_model.bin is not supported; convert to safetensors)"
        if (path / "pytorch_model.bin").exists()
        else ""
    )
    raise ModelError(
        f"{path}: no model.safetensors or model.safetensors.index.json{hint}",
        field="model.safetensors",
    )


def load_tensors(
    path: Path, config: ModelConfig, dtype: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """HF-named tensors the model needs (others skipped) and the file each came from."""
    from safetensors import safe_open

    fused = fused_parts(config)
    wanted = set(expected_shapes(config))
    target = torch.float32 if dtype is None else dtype
    tensors, origin = {}, {}
    for f in _weight_files(path):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for stored in sf.keys():
                    name = canonical_name(config, stored)
                    layer = layer_tensor(name)
                    if name in wanted or (layer is not None and layer[1] in fused):
                        read = sf.get_tensor(stored).to(target)
                        for part, t in split_fused(config, name, read, str(f)).items():
                            tensors[part] = t
                            origin[part] = str(f)
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelError(f"{f}: cannot read safetensors: {e}", field=f.name) from e
    return tensors, origin


def load_hf_dir(path: Path, dtype: Any = None, load_tokenizer: bool = True):
    from .loaded import LoadedModel

    config = read_config(path)
    tensors, origin = load_tensors(path, config, None if dtype is None else torch_dtype(dtype))
    check_tensors(config, tensors, str(path), origin)
    tokenizer = None
    if load_tokenizer:
        from ..tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(config=config, tensors=tensors, tokenizer=tokenizer, source=str(path))
