"""A GGUF file's metadata and tensor table, read in one pass over its header.

gguf's `GGUFReader` reads the same header through a numpy memory map one element at a time: two
seconds for the default model's 49,152 tokens and as many merges, the better part of a start
(and about four times that for a vocabulary of 128k). Here the header is unpacked with `struct`
straight from a memory map of the file (~0.1 s); tensor data are read-only numpy views of the
same map, in the forms `GGUFReader` gives them and `gguf.quants.dequantize` takes: float32,
float16 and integer tensors typed, [..., N, K] in row-major order; every other type as its raw
bytes, [..., N, bytes of a row] uint8.

Format (little-endian; versions 2 and 3): magic "GGUF", version u32, tensor count u64, field
count u64; each field a string key, a u32 type and a value (arrays: an element type, a u64 count
and the elements; strings: a u64 length and UTF-8 bytes); each tensor a name, a u32 count of
dimensions, that many u64 dimensions (fastest first), a u32 type and a u64 offset from the start
of the data, which begins at the next multiple of `general.alignment` (default 32) after the
table.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> struct format of a scalar (8: string, 9: array are read apart)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8"}
_NUMPY.update({11: "<i8", 12: "<f8"})
_STRING, _ARRAY = 8, 9
# tensor types whose data are typed arrays; every other type is raw bytes
_TYPED = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands, or it is cut short."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # fastest dimension first, as the file lists them
    data: np.ndarray  # read-only view of the file (see the module's docstring)
    offset: int = 0  # where its data begin in the file


class GGUFFile:
    """`fields`: every metadata key with its decoded value (str, int, float, bool, or a list of
    them); `tensors`: the tensor table in file order."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise GGUFFormatError(f"not a GGUF file: {e}") from e
        self._offset = 0
        try:
            self.fields, self.tensors = self._read()
        except GGUFFormatError:
            raise
        except (struct.error, ValueError, IndexError, KeyError) as e:
            raise GGUFFormatError(f"damaged header at byte {self._offset}: {e}") from e

    def _read(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if self._map[:4] != MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        self._offset = 4
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise GGUFFormatError(
                f"GGUF version {version} is not read here (versions {VERSIONS}, little-endian)"
            )
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        fields = {}
        for _ in range(n_fields):
            key = self._string()
            fields[key] = self._value(self._scalar("<I"))
        table = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            raw_type, offset = self._scalar("<I"), self._scalar("<Q")
            table.append((name, dims, raw_type, offset))
        alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        return fields, [self._tensor(name, d, t, start + o) for name, d, t, o in table]

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        end = self._offset + n
        if end > len(self._map):
            raise GGUFFormatError(f"a string of {n} bytes runs past the end of the file")
        text = self._map[self._offset : end].decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item == _STRING:
            return [self._string() for _ in range(count)]
        if item in _NUMPY:
            values = np.frombuffer(self._map, _NUMPY[item], count, self._offset)
            self._offset += values.nbytes
            return values.tolist()
        return [self._value(item) for _ in range(count)]  # arrays of arrays

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, start: int) -> GGUFTensor:
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has an unknown type {raw_type}") from None
        rows = tuple(reversed(dims))
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if kind in _TYPED:
            dtype = np.dtype(_TYPED[kind])
            count, shape = elements, rows
        else:
            block, size = GGML_QUANT_SIZES[kind]
            if rows[-1] % block:
                raise GGUFFormatError(
                    f"tensor {name!r}: rows of {rows[-1]} are not whole {kind.name} blocks"
                )
            dtype = np.dtype(np.uint8)
            count, shape = elements // block * size, (*rows[:-1], rows[-1] // block * size)
        if start + count * dtype.itemsize > len(self._map):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._map, dtype, count, start).reshape(shape)
        return GGUFTensor(name, kind, dims, data, start)
