"""File helpers of the disk tier: atomic name swaps, full writes, and temp files it owns.

Temp files are named `.tmp.kvtier.<pid>.<random hex>`: the pid says whose a file is, so a tier
removes only temp files of disk tiers whose process is gone, never another program's (a shared
folder may hold anyone's `.tmp.*`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
from collections.abc import Callable

TEMP_PREFIX = ".tmp.kvtier."  # + "<pid>.<random hex>"


def temp_name() -> str:
    """A fresh temp file name of this process."""
    return f"{TEMP_PREFIX}{os.getpid()}.{secrets.token_hex(8)}"


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc older than glibc 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_renameat2 = _load_renameat2()


def exchange(a: str, b: str) -> bool:
    """Atomically swap the files named `a` and `b`; False when unsupported or `b` is gone."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def own_stale_temp(name: str) -> bool:
    """Whether `name` is a temp file of a disk tier whose process is gone (safe to remove)."""
    if not name.startswith(TEMP_PREFIX):
        return False
    pid_text = name[len(TEMP_PREFIX) :].partition(".")[0]
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def write_all(fd: int, parts: list[memoryview]) -> None:
    """os.writev until every byte of `parts` is written (writev may write less)."""
    while parts:
        done = os.writev(fd, parts)
        while parts and done >= len(parts[0]):
            done -= len(parts[0])
            parts.pop(0)
        if parts and done:
            parts[0] = parts[0][done:]
