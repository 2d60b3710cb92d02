"""Import SGLang's storage interface on a machine without SGLang's CUDA stack.

`import sglang` runs the package's `__init__`, which pulls in the whole serving stack (CUDA
kernels, orjson, psutil, ...). The HiCache storage interface (`hicache_storage`) and the backend
factory (`storage.backend_factory`) need only torch. Tests, benchmarks and CPU tooling call
`import_sglang_storage()` first: when the real package imports, nothing changes; when it does not,
a bare `sglang` package module (its `__path__` only) stands in for it, so those two submodules
import as they are. Inside an SGLang server none of this runs: sglang is already imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["SGLANG_INSTALL_HINT", "import_sglang_storage"]

SGLANG_INSTALL_HINT = (
    "SGLang is not installed: `pip install --no-deps sglang==0.5.23` "
    "(`make test` installs it; torch is needed too)"
)


def import_sglang_storage() -> None:
    """Make `sglang.srt.mem_cache.hicache_storage` and the backend factory importable.

    Raises ImportError with the install command when SGLang is not installed at all.
    """
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(SGLANG_INSTALL_HINT)
        try:
            importlib.import_module("sglang")
        except Exception:  # no CUDA stack here: drop what the failed import left, stand in
            for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
                del sys.modules[name]
            package = types.ModuleType("sglang")
            package.__path__ = list(spec.submodule_search_locations)
            package.__spec__ = spec
            sys.modules["sglang"] = package
    importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
