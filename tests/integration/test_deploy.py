"""deploy/ and the launch lines of the README and its guides, as written.

No Docker engine can build the image here (its base image comes from a registry the test
machines cannot reach), so the image's ENTRYPOINT runs on the host with the image's ENV and the
`docker run` flags of docs/operations.md, its paths moved into a temporary folder. The compose
file is checked by `docker-compose config` (Debian's, which make test installs; or Docker's
`docker compose` plugin when that is what is installed), and
always against the parts of the compose schema it uses. The systemd unit is checked by
`systemd-analyze verify` in a root folder laid out as docs/operations.md says (user, venv, env
file). The vLLM lines are parsed by vLLM's own OpenAI-server parser; the SGLang line's flags are
checked against SGLang's ServerArgs.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.readme import DOCUMENTS, shell_blocks
from testkit.servers import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def readme_command(first_words: str) -> str:
    """The shell command that starts with `first_words` in the README or one of its guides (the
    first one, in that order), continuation lines joined (a trailing backslash, or a quote left
    open) as the shell joins them."""
    for document in DOCUMENTS:
        for _, block in shell_blocks(document.read_text(encoding="utf-8")):
            lines = block.splitlines()
            for i, line in enumerate(lines):
                if not line.startswith(first_words):
                    continue
                text = line
                while text.endswith("\\") or _open_quote(text):
                    i += 1
                    text = (text[:-1] if text.endswith("\\") else text + "\n") + lines[i]
                return text.split("  #")[0].rstrip()
    raise AssertionError(
        f"neither README.md nor its guides have a shell command starting with {first_words!r}"
    )


def _open_quote(text: str) -> bool:
    try:
        shlex.split(text)
    except ValueError:
        return True
    return False


# -- Docker ----------------------------------------------------------------------------------------


def dockerfile() -> tuple[dict[str, str], list[str]]:
    """The image's ENV (every ENV line) and its ENTRYPOINT."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    for line in text.splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                name, _, value = word.partition("=")
                env[name] = value
        elif line.startswith("ENTRYPOINT "):
            entrypoint = json.loads(line[len("ENTRYPOINT ") :])
    assert entrypoint == ["kvtier", "serve"], entrypoint
    return env, entrypoint


def run_line_env(command: str) -> dict[str, str]:
    """The `-e NAME=VALUE` settings of a `docker run` command line."""
    words = shlex.split(command)
    out = {}
    for i, word in enumerate(words):
        if word == "-e":
            name, _, value = words[i + 1].partition("=")
            out[name] = value
    return out


def _image_on_host(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    """The image's ENV with its folders (/run/kvtier, /var/lib/kvtier) moved under tmp_path and
    a free admin port, for a run on this machine."""
    moved = {}
    for name, value in env.items():
        for folder in ("/run/kvtier", "/var/lib/kvtier"):
            value = value.replace(folder, str(tmp_path / folder.strip("/")))
        moved[name] = value
    (tmp_path / "run" / "kvtier").mkdir(parents=True)
    (tmp_path / "var" / "lib" / "kvtier").mkdir(parents=True)
    moved["KVTIER_ADMIN_PORT"] = str(free_port())
    return moved


def _kvtier_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return {**env, **extra, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}


def test_the_dockerfile_run_line_starts_the_image_entrypoint(tmp_path: Path) -> None:
    image_env, entrypoint = dockerfile()
    header = (DEPLOY / "Dockerfile").read_text()
    docker_run = re.search(r"^#\s+(docker run .*?)$(?:\n#\s+(.*?)$)?", header, re.M)
    assert docker_run, "the Dockerfile's header has no `docker run` line"
    line = docker_run.group(1).rstrip("\\ ") + " " + (docker_run.group(2) or "")
    assert shlex.split(line) == shlex.split(readme_command("docker run ")), line
    flags = run_line_env(line)
    assert "KVTIER_ADMIN_TOKEN" in flags, line  # the admin API is on 0.0.0.0 in the image
    token = subprocess.run(
        ["sh", "-c", f"printf %s {flags['KVTIER_ADMIN_TOKEN']}"], capture_output=True, text=True
    ).stdout
    assert len(token) == 32, token  # "$(openssl rand -hex 16)"
    env = _image_on_host(tmp_path, {**image_env, "KVTIER_ADMIN_TOKEN": token})
    argv = [sys.executable, "-m", "kvtier.cli", *entrypoint[1:]]
    proc = subprocess.Popen(
        argv, env=_kvtier_env(env), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log: list[str] = []
    try:
        assert proc.stdout is not None
        for line_out in proc.stdout:
            log.append(line_out)
            if line_out.startswith("kvtier: ready"):
                break
        assert log and log[-1].startswith("kvtier: ready"), "".join(log)
        port = env["KVTIER_ADMIN_PORT"]
        assert env["KVTIER_ADMIN_HOST"] == "0.0.0.0"
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.json() == {"status": "ok"}  # the image's HEALTHCHECK asks this
        status = httpx.get(f"http://127.0.0.1:{port}/status", timeout=10)
        assert status.status_code == 401
        status = httpx.get(
            f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {token}"}
        )
        assert status.status_code == 200
        assert status.json()["config"]["admin_host"] == "0.0.0.0"
        assert (tmp_path / "run" / "kvtier" / "kvtier.sock").exists()
        assert (tmp_path / "var" / "lib" / "kvtier" / "l2").is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)  # the image's STOPSIGNAL
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, "".join(log) + out


def test_the_image_without_an_admin_token_exits_2_with_one_line(tmp_path: Path) -> None:
    image_env, entrypoint = dockerfile()
    env = _image_on_host(tmp_path, image_env)
    # A segment a killed server left behind: a refused start must not touch it (nor log it).
    # Another test's server starting meanwhile may reclaim it, as it should: so the check is
    # the refused start's own output, which would name a segment it removed.
    left = Path("/dev/shm") / f"kvtier-{os.getuid()}-deploy-test-{os.getpid()}"
    left.write_bytes(b"\0" * 4096)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", *entrypoint[1:]],
            env=_kvtier_env(env), cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        said = out.stdout + out.stderr
        assert left.name not in said and "removed shared-memory segment" not in said, said
    finally:
        left.unlink(missing_ok=True)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2, lines
    assert len(lines) == 1 and "--admin-token" in lines[0], lines


# -- compose ---------------------------------------------------------------------------------------

SERVICE_KEYS = {
    "image", "build", "command", "entrypoint", "environment", "ports", "volumes",
    "depends_on", "restart", "ipc", "shm_size", "hostname", "user", "profiles",
}  # fmt: skip


def test_the_compose_file_is_valid_and_engines_can_map_the_arena() -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    # Debian's docker-compose, the tool make test installs and runs below
    up = readme_command("KVTIER_ADMIN_TOKEN=$(openssl rand -hex 16) docker-compose")
    assert up.endswith("docker-compose -f deploy/compose.yaml up -d"), up
    assert up in text, "the compose file's header shows the command docs/operations.md gives"
    env = {**os.environ, "KVTIER_ADMIN_TOKEN": "0" * 32}
    compose = shutil.which("docker-compose")
    docker = shutil.which("docker")
    checked = False
    for argv in ([compose] if compose else [], [docker, "compose"] if docker else []):
        if not argv:
            continue
        probe = subprocess.run([*argv, "version"], capture_output=True, text=True)
        if probe.returncode != 0:
            continue  # docker without its compose plugin
        out = subprocess.run(
            [*argv, "-f", str(DEPLOY / "compose.yaml"), "config", "-q"],
            capture_output=True, text=True, env=env, cwd=REPO,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        missing = subprocess.run(
            [*argv, "-f", str(DEPLOY / "compose.yaml"), "config", "-q"],
            capture_output=True, text=True, cwd=REPO,
            env={k: v for k, v in os.environ.items() if k != "KVTIER_ADMIN_TOKEN"},
        )  # fmt: skip
        assert missing.returncode != 0 and "set KVTIER_ADMIN_TOKEN" in missing.stderr
        checked = True
        break
    # The schema's parts this file uses, checked whether or not a compose tool is installed.
    doc = yaml.safe_load(text)
    assert set(doc) <= {"services", "volumes"}, set(doc)
    for name, service in doc["services"].items():
        assert set(service) <= SERVICE_KEYS, (name, set(service) - SERVICE_KEYS)
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in doc["volumes"], (name, volume)
        for dep in service.get("depends_on", []):
            assert dep in doc["services"], (name, dep)
    server, engine = doc["services"]["kvtier"], doc["services"]["engine-example"]
    assert "${KVTIER_ADMIN_TOKEN:?" in server["environment"]["KVTIER_ADMIN_TOKEN"]
    assert server["ipc"] == "shareable" and engine["ipc"] == "service:kvtier"
    # a client maps the arena only with the server's host name and uid
    assert engine["hostname"] == server["hostname"]
    uid = re.search(r"--uid (\d+)", (DEPLOY / "Dockerfile").read_text())
    assert uid is not None
    assert engine["user"] == uid[1]
    assert "kvtier-sock:/run/kvtier" in engine["volumes"]
    assert checked, (
        "no compose tool answered `version`: make test installs Debian's docker-compose "
        "(as root: apt-get install -y docker-compose)"
    )


# -- systemd ---------------------------------------------------------------------------------------


def _install_layout(root: Path) -> None:
    """The systemd lines of docs/operations.md, run into `root` instead of `/`."""
    for sub in ("etc/systemd/system", "opt", "var/lib"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    for name in ("passwd", "group", "shadow", "gshadow", "login.defs"):
        # the shadow files are readable by root alone, and only useradd (root) needs them
        if Path("/etc", name).exists() and os.access(Path("/etc", name), os.R_OK):
            shutil.copy(Path("/etc", name), root / "etc" / name)
    useradd = readme_command("sudo useradd ").removeprefix("sudo ")
    if os.geteuid() == 0 and shutil.which("useradd"):
        argv = shlex.split(useradd)
        subprocess.run([argv[0], "--root", str(root), *argv[1:]], check=True)
    else:  # useradd --root needs root: the same entry, written as useradd would
        with open(root / "etc" / "passwd", "a") as f:
            f.write("kvtier:x:999:999::/var/lib/kvtier:/usr/sbin/nologin\n")
        with open(root / "etc" / "group", "a") as f:
            f.write("kvtier:x:999:\n")
    venv = readme_command("sudo python3 -m venv /opt/kvtier")
    assert venv == "sudo python3 -m venv /opt/kvtier && sudo /opt/kvtier/bin/pip install .", venv
    # The venv with kvtier from this checkout, its dependencies borrowed from this interpreter.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root / "opt/kvtier"], check=True)
    (root / "opt/kvtier/bin/kvtier").write_text(
        f"#!{root}/opt/kvtier/bin/python\nimport sys\nsys.path[:0] = [{str(REPO / 'src')!r}]\n"
        "from kvtier.cli import main\nmain()\n"
    )
    (root / "opt/kvtier/bin/kvtier").chmod(0o755)
    env_file = readme_command("sudo install -D")
    assert "/etc/kvtier/kvtier.env" in env_file
    (root / "etc/kvtier").mkdir()
    (root / "etc/kvtier/kvtier.env").write_text("")
    copy = readme_command("sudo cp deploy/kvtier.service")
    assert copy.startswith("sudo cp deploy/kvtier.service /etc/systemd/system/"), copy
    shutil.copy(DEPLOY / "kvtier.service", root / "etc/systemd/system/kvtier.service")


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (DEPLOY / "kvtier.service").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_the_systemd_unit_verifies_against_the_readme_layout(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd (make test does)")
    root = tmp_path / "root"
    _install_layout(root)
    unit = root / "etc/systemd/system/kvtier.service"
    out = subprocess.run([analyze, "verify", f"--root={root}", str(unit)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and not out.stderr.strip(), out.stdout + out.stderr
    settings = unit_settings()
    user = settings["User"][0]
    assert any(ln.startswith(f"{user}:") for ln in (root / "etc/passwd").read_text().splitlines())
    exe = settings["ExecStart"][0].split()[0]
    assert os.access(root / exe.lstrip("/"), os.X_OK), exe
    assert settings["RestartPreventExitStatus"] == ["2"]
    # Broken on purpose, the same check fails: it is not a check that cannot fail.
    (root / exe.lstrip("/")).unlink()
    broken = subprocess.run([analyze, "verify", f"--root={root}", str(unit)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert broken.returncode != 0 and "is not executable" in broken.stderr


def test_the_units_command_and_environment_serve_on_the_host(tmp_path: Path) -> None:
    """ExecStart with the unit's Environment= lines, its folders moved under tmp_path; a bad
    setting in the env file is one line and exit 2, which RestartPreventExitStatus keeps."""
    settings = unit_settings()
    env = dict(line.split("=", 1) for line in settings["Environment"])
    env = _image_on_host(tmp_path, env)
    argv = [sys.executable, "-m", "kvtier.cli", *settings["ExecStart"][0].split()[1:]]
    bad = subprocess.run(argv, env=_kvtier_env({**env, "KVTIER_L1_SIZE": "2"}), cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    proc = subprocess.Popen(argv, env=_kvtier_env({**env, "KVTIER_L1_SIZE": "64MiB"}),
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        assert proc.stdout is not None
        log = [proc.stdout.readline() for _ in range(1)]
        deadline = time.monotonic() + 60
        while not log[-1].startswith("kvtier: ready") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            log.append(line)
        assert log[-1].startswith("kvtier: ready"), "".join(log)
        assert (tmp_path / "run/kvtier/kvtier.sock").exists()
    finally:
        proc.send_signal(signal.SIGTERM)  # KillSignal=SIGTERM
        proc.communicate(timeout=30)
    assert proc.returncode == 0


# -- engines' launch lines -------------------------------------------------------------------------

_PARSE_VLLM = """
import json, sys
import vllm.envs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
args = parser.parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
kv = args.kv_transfer_config
print(json.dumps({"model": args.model, "model_tag": getattr(args, "model_tag", None),
                  "block_size": args.block_size, "connector": kv.kv_connector,
                  "module": kv.kv_connector_module_path, "role": kv.kv_role,
                  "policy": kv.kv_load_failure_policy, "extra": kv.kv_connector_extra_config,
                  "prompt_tokens_details": args.enable_prompt_tokens_details,
                  "cpu_kv_cache_gib": vllm.envs.VLLM_CPU_KVCACHE_SPACE}))
"""


def _vllm_args(command: str, prefix: str, env: dict[str, str] | None = None) -> dict[str, object]:
    words = shlex.split(command)
    n = len(shlex.split(prefix))
    assert words[:n] == shlex.split(prefix), words
    argv = words[n:]
    if prefix.startswith("vllm serve"):  # `vllm serve MODEL` passes MODEL as --model
        argv = ["--model", argv[0], *argv[1:]]
    out = subprocess.run([sys.executable, "-c", _PARSE_VLLM, json.dumps(argv)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {}),
                              "PYTHONPATH": str(REPO / "src")})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.vllm
def test_the_readme_vllm_lines_parse_with_vllms_own_server_parser() -> None:
    serve = readme_command("kvtier serve --address ipc:///tmp/kvtier.sock &")
    address = shlex.split(serve)[3]
    cpu = readme_command("python -m vllm.entrypoints.openai.api_server")
    gpu = readme_command("vllm serve MODEL")
    want = {"model": "MODEL", "block_size": 32, "connector": "KVTierConnector",
            "module": "kvtier.integrations.vllm", "role": "kv_both", "policy": "recompute",
            "extra": {"address": address}}  # fmt: skip
    # The CPU line runs after `export VLLM_CPU_KVCACHE_SPACE=N`: vLLM's CPU build then sizes
    # its KV cache from it (N GiB) instead of reserving a fraction of the machine's memory.
    export = readme_command("export VLLM_CPU_KVCACHE_SPACE=")
    name, _, gib = export.removeprefix("export ").partition("=")
    for command, prefix, env in ((cpu, "python -m vllm.entrypoints.openai.api_server", {name: gib}),
                                 (gpu, "vllm serve", {})):  # fmt: skip
        got = _vllm_args(command, prefix, env)
        got.pop("model_tag", None)
        if env:
            assert got.pop("cpu_kv_cache_gib") == int(gib) > 0, got
            assert got.pop("prompt_tokens_details") is True, "the guide reads cached_tokens"
        else:
            got.pop("cpu_kv_cache_gib")
            got.pop("prompt_tokens_details")
        assert got == want, (command, got)
    module = importlib.import_module(str(want["module"]))
    assert hasattr(module, str(want["connector"]))


@pytest.mark.vllm
def test_vllm_serve_stops_on_vllm_cpu_as_the_readme_says() -> None:
    """The reason docs/vllm.md gives the module form for vLLM's CPU build."""
    from importlib import metadata

    assert metadata.version("vllm-cpu")
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")
    vllm = Path(sys.executable).parent / "vllm"
    out = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "PackageNotFoundError" in out.stderr, out.stderr[-2000:]


def test_the_sglang_line_uses_flags_sglang_0523_has() -> None:
    """SGLang's parser needs its full dependency set, which the tests do not install: the flags
    are checked against the fields of its ServerArgs (`srt/arg_groups/fields`: its CLI flags
    are those names with dashes), and the extra config against the backend factory's `dynamic`
    loader and kvtier's backend class."""
    sglang_spec = importlib.util.find_spec("sglang")
    if sglang_spec is None or not sglang_spec.submodule_search_locations:
        pytest.fail("sglang 0.5.23 is missing: .venv/bin/pip install --no-deps sglang==0.5.23")
    root = Path(next(iter(sglang_spec.submodule_search_locations)))
    source = "\n".join(p.read_text() for p in (root / "srt/arg_groups/fields").glob("*.py"))
    command = readme_command("python -m sglang.launch_server")
    words = shlex.split(command)
    flags = [w for w in words if w.startswith("--")]
    assert flags
    for flag in flags:
        field = flag[2:].replace("-", "_")
        assert re.search(rf"^\s+{field}: A\[", source, re.M), f"ServerArgs has no {field}"
    extra = json.loads(words[words.index("--hicache-storage-backend-extra-config") + 1])
    assert words[words.index("--hicache-storage-backend") + 1] == "dynamic"
    backend = source[source.index("    hicache_storage_backend: A[") :]
    assert '"dynamic",' in backend[: backend.index("] = ")], "dynamic is one of its choices"
    factory = (root / "srt" / "mem_cache" / "storage" / "backend_factory.py").read_text()
    assert 'backend_name == "dynamic"' in factory
    from testkit.sglang_cpu import import_sglang_storage

    import_sglang_storage()  # SGLang's storage interface without its CUDA stack
    module = importlib.import_module(extra["module_path"])
    assert hasattr(module, extra["class_name"])
    serve = readme_command("kvtier serve --address ipc:///tmp/kvtier.sock --chunk-size 64")
    assert extra["address"] == shlex.split(serve)[3]


# -- make ------------------------------------------------------------------------------------------


def test_make_says_which_system_package_to_install_without_root(tmp_path: Path) -> None:
    make = shutil.which("make")
    assert make, "make is missing: apt-get install make"
    argv = [make, "-s", "-C", str(REPO), "system-packages",
            "SYSTEM_PACKAGES=kvtier-no-such-command:kvtier-no-such-package"]  # fmt: skip
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0
    assert "as root run: apt-get install -y kvtier-no-such-package" in out.stderr, out.stderr
    assert "Permission denied" not in out.stderr
