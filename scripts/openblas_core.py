"""Print the kernel set ("core") numpy's OpenBLAS runs on this machine, as OPENBLAS_CORETYPE names
them (Haswell, SkylakeX, Zen, ...): the one it picked for the CPU, or the one the variable forces.
Prints nothing where numpy's OpenBLAS does not say."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy


def core_name() -> str | None:
    libs = Path(numpy.__file__).parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*")):
        lib = ctypes.CDLL(str(path))
        for symbol in ("scipy_openblas_get_corename64_", "openblas_get_corename"):
            function = getattr(lib, symbol, None)
            if function is not None:
                function.restype = ctypes.c_char_p
                return function().decode()
    return None


if __name__ == "__main__":
    print(core_name() or "")
