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

from kvtier._version import __version__

REPO = Path(__file__).resolve().parents[2]


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
    assert wheel.name.startswith(f"kvtier-{__version__}-py3-none-any")

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for needed in ("kvtier/__init__.py", "kvtier/py.typed", "kvtier/static/app.js",
                       "kvtier/static/index.html", "kvtier/static/style.css",
                       "kvtier/server/views.py"):  # fmt: skip
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
            assert kvtier.__file__.startswith({str(venv)!r}), kvtier.__file__
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
