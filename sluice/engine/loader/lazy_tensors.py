"""A model file's tensors, read when asked for (`LazyTensors`): a GGUF file's quantized matrices
stay in its memory map until the model builder asks for one, and a matrix the engine multiplies
as the file stored it is never dequantized at all. Each read gives a new tensor (nothing is kept),
so the float copy of a matrix lives only while the builder turns it into what the model keeps.

    tensors = LazyTensors()
    tensors.add("model.norm.weight", (576,), torch.float32, lambda: read_norm())
    tensors.shape_of("model.norm.weight")   # (576,), without reading it
    w = tensors["model.norm.weight"]        # read now
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

V = TypeVar("V")


class LazyMapping(MutableMapping[str, V], Generic[V]):
    """Values made by a function each time they are read; a value set directly is kept as is."""

    def __init__(self) -> None:
        self._makers: dict[str, Callable[[], V]] = {}

    def add(self, name: str, make: Callable[[], V]) -> None:
        self._makers[name] = make

    def __getitem__(self, name: str) -> V:
        return self._makers[name]()

    def __setitem__(self, name: str, value: V) -> None:
        self._makers[name] = lambda: value

    def __delitem__(self, name: str) -> None:
        del self._makers[name]

    # (MutableMapping's own would read the value to answer these)
    def __contains__(self, name: object) -> bool:
        return name in self._makers

    def pop(self, name: str, *default: V) -> V:  # type: ignore[override]
        """The value, read, and the name removed."""
        if name not in self._makers and default:
            return default[0]
        value = self[name]
        del self[name]
        return value

    def discard(self, name: str) -> None:
        """The name removed, if present, without reading its value."""
        if name in self._makers:
            del self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


class SharedRead(Generic[V]):
    """One read shared by the `uses` parts of a fused matrix: made at the first part's call and
    let go after the last's, so the whole is held only while its parts are taken."""

    def __init__(self, read: Callable[[], V], uses: int) -> None:
        self._read, self._uses, self._left = read, uses, uses
        self._value: V | None = None

    def __call__(self) -> V:
        value = self._value if self._value is not None else self._read()
        self._left -= 1
        if self._left == 0:
            self._value, self._left = None, self._uses
        else:
            self._value = value
        return value


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


class LazyTensors(LazyMapping[torch.Tensor]):
    """HF-named tensors whose shapes and dtypes are known before they are read."""

    def __init__(self) -> None:
        super().__init__()
        self._info: dict[str, TensorInfo] = {}

    def add_tensor(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        make: Callable[[], torch.Tensor],
    ) -> None:
        self.add(name, make)
        self._info[name] = TensorInfo(tuple(shape), dtype)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        super().__setitem__(name, value)
        self._info[name] = TensorInfo(tuple(value.shape), value.dtype)

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        del self._info[name]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._info[name].shape

    def dtype_of(self, name: str) -> torch.dtype:
        return self._info[name].dtype


def tensor_shape(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...] | None:
    """The shape of `tensors[name]` without reading a lazy one (None where it is missing)."""
    if name not in tensors:
        return None
    if isinstance(tensors, LazyTensors):
        return tensors.shape_of(name)
    return tuple(tensors[name].shape)


def tensor_dtypes(tensors: Mapping[str, torch.Tensor]) -> list[torch.dtype]:
    """The dtype of every tensor, without reading lazy ones."""
    if isinstance(tensors, LazyTensors):
        return [tensors.dtype_of(name) for name in tensors]
    return [t.dtype for t in tensors.values()]
