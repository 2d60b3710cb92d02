"""The optional native copy helper: batched page copies with streaming stores.

`copy_library()` loads libkvtier_copy.so (built from copy_runs.c at install by the build hook,
hatch_build.py) with ctypes, or returns None when it is not there, is stale, or
KVTIER_NATIVE_COPY=0: kvtier.client.copying then copies with ctypes.memmove, run by run.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from kvtier.client.native.build import LIBRARY

__all__ = ["ABI", "CopyLibrary", "copy_library"]

#: the library's kvtier_copy_abi() this module is written for
ABI = 1


class CopyLibrary:
    """The loaded library's entry points, typed."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.copy_runs = lib.kvtier_copy_runs
        # (runs: (dst, src, size) uint64 triples, count, streaming, next: size_t* or None)
        self.copy_runs.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.copy_runs.restype = None
        variant = lib.kvtier_copy_variant
        variant.argtypes = []
        variant.restype = ctypes.c_char_p
        #: the streaming stores in use: "avx512", "avx2", "sse2", or "" (memmove only)
        self.variant: str = variant().decode()


@functools.cache
def copy_library() -> CopyLibrary | None:
    """The native helper, or None (not built, another ABI, or switched off)."""
    if os.environ.get("KVTIER_NATIVE_COPY", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(Path(__file__).with_name(LIBRARY)))
        abi = lib.kvtier_copy_abi
    except (OSError, AttributeError):
        return None
    abi.argtypes, abi.restype = [], ctypes.c_int
    if abi() != ABI:
        return None
    return CopyLibrary(lib)
