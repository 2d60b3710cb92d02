"""Build hook: compiles kvtier's optional native copy helper into the wheel (or, for an editable
install, beside its source in src/kvtier/client/native/).

Without a C compiler the build goes on with a warning and kvtier copies with ctypes.memmove
instead (kvtier.client.copying). With the helper, the wheel holds a shared library and is tagged
for this platform; the library uses no Python API, so the tag names no Python ABI.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NATIVE = Path("src", "kvtier", "client", "native")


class NativeCopyHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        spec = importlib.util.spec_from_file_location(
            "_kvtier_native_build", root / NATIVE / "build.py"
        )
        assert spec is not None and spec.loader is not None
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)
        try:
            library = builder.build(root / NATIVE)
        except Exception as exc:  # no compiler, or it failed: the pure-Python copies remain
            detail = getattr(exc, "stderr", "") or exc
            self.app.display_warning(f"kvtier: native copy helper not built ({detail})")
            return
        build_data["artifacts"].append(str(library.relative_to(root)))
        build_data["pure_python"] = False
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform}"
