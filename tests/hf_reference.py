"""transformers' own reading of a GGUF file (the independent reference the engine's tests compare
against), kept on disk between runs.

Reading a GGUF costs transformers tens of seconds every time (Gemma 3's 262,144-piece tokenizer is
converted piece by piece, its tensors dequantized), and for one file and one transformers version it
gives the same tokenizer and weights every time. So the first reading is saved (the tokenizer with
`save_pretrained`, the model's config and dequantized weights with torch) under
``~/.cache/sluice/hf-reference/``, named by the file (name, size, modification time) and the
transformers version, and later runs load that. What is compared is still transformers' reading of
the file: only when it happens changes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import transformers

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sluice" / "hf-reference"


def _place(path: Path, what: str) -> Path:
    stat = path.stat()
    name = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return CACHE / f"{what}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def reference_tokenizer(path: str | Path) -> Any:
    """transformers' tokenizer of the GGUF file at `path`."""
    path = Path(path)
    kept = _place(path, "tokenizer")
    if (kept / "tokenizer_config.json").exists():
        return transformers.AutoTokenizer.from_pretrained(str(kept))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _save(kept, tokenizer.save_pretrained)
    return tokenizer


def reference_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' causal LM of the GGUF file at `path`, in `dtype`, in eval mode."""
    path = Path(path)
    kept = _place(path, f"model-{str(dtype).removeprefix('torch.')}")
    if (kept / "weights.pt").exists():
        config = transformers.AutoConfig.from_pretrained(str(kept))
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(torch.load(kept / "weights.pt", weights_only=True))
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(kept))
        return model.eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    )

    def save(into: str) -> None:
        model.config.save_pretrained(into)
        model.generation_config.save_pretrained(into)
        torch.save(model.state_dict(), Path(into) / "weights.pt")

    _save(kept, save)
    return model.eval()


def _save(kept: Path, write: Any) -> None:
    """Write into a fresh directory, then move it into place (a run stopped halfway leaves no
    half-written reference behind)."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    staging = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
    write(str(staging))
    try:
        staging.rename(kept)
    except OSError:  # (another run put it there first)
        pass
