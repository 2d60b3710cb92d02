"""Builds copy_runs.c into the shared library that kvtier.client.native loads.

Standard library only: the install's build hook (hatch_build.py at the repository root) loads
this file by path before kvtier's dependencies exist. By hand, in a checkout:
`python src/kvtier/client/native/build.py`. The library has no Python headers or symbols, so
one build serves every Python version on the machine.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

LIBRARY = "libkvtier_copy.so"
SOURCE = "copy_runs.c"
HERE = Path(__file__).resolve().parent


def compiler() -> list[str]:
    """The C compiler: $CC, else the one Python was built with, else `cc`."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(str(cc))


def build(out_dir: Path = HERE) -> Path:
    """Compile the library into `out_dir`; raises OSError or CalledProcessError on failure."""
    out = out_dir / LIBRARY
    tmp = out_dir / f".{LIBRARY}.{os.getpid()}.tmp"
    argv = [*compiler(), "-O2", "-shared", "-fPIC", "-o", str(tmp), str(HERE / SOURCE)]
    try:
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)  # atomic: a process loading the old library keeps its mapping
    finally:
        tmp.unlink(missing_ok=True)
    return out


if __name__ == "__main__":
    print(build())
