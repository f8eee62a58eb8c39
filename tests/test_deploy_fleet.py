"""The fleet's deployment files (docs/fleet.md): systemd units, the Compose file, the Kubernetes manifests.

Each is read by what reads it in production where that tool is here: ``systemd-analyze verify``
(and ``security``) for the units, vllm-router's own argument parser for every router command line,
vllama's settings for every node's and front's environment; and the wiring is checked: the front
names the router's address, the nodes register with it (or the router's discovery selects them), at
the port they listen on. The fleet itself runs in tests/test_fleet.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import ROOT, parse_env_file, settings_from, systemd_seconds, unit_entries

pytest.importorskip("vllm_router")
from vllm_router.launch_router import parse_router_args  # noqa: E402

SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = {"vllama-router.service": "vllama-router.service", "vllama-node@.service": "vllama-node@0.service",
         "vllama-front.service": "vllama-front.service"}
COMPOSE = ROOT / "deploy" / "container" / "fleet.compose.yaml"
K8S = ROOT / "deploy" / "kubernetes" / "fleet"
DRAIN_AND_STOP = 30 + 30 + 5 + 60  # as tests/test_deploy.py's STOP_BUDGET with default settings


def router_args(argv: list[str]):
    """vllm-router's own parser on a command line (``vllm-router`` or ``tini -- vllm-router`` first)."""
    (at,) = [i for i, a in enumerate(argv) if Path(a).name == "vllm-router"]
    return parse_router_args(argv[at + 1:])


def values(unit: str, key: str) -> list[str]:
    return [v for s, k, v in unit_entries(SYSTEMD / unit) if s == "Service" and k == key]


def unit_env(unit: str, instance: str = "0") -> dict[str, str]:
    """The environment systemd gives the unit's process: EnvironmentFile=, then Environment= (these win)."""
    env = {}
    for path in values(unit, "EnvironmentFile"):
        env.update(parse_env_file(ROOT / "deploy" / "systemd" / Path(path.lstrip("-")).name))
    for line in values(unit, "Environment"):
        key, value = line.replace("%i", instance).split("=", 1)
        env[key] = value
    return env


def exec_start(unit: str) -> list[str]:
    """ExecStart= with continuation lines joined."""
    text = (SYSTEMD / unit).read_text().replace("\\\n", " ")
    (line,) = re.findall(r"^ExecStart=(.*)$", text, flags=re.M)
    return shlex.split(line)


# --- systemd ----------------------------------------------------------------------------------


def test_units_pass_systemd_analyze(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    root = tmp_path / "root"
    for d in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(d).is_dir() and not (root / d.lstrip("/")).exists():
            shutil.copytree(d, root / d.lstrip("/"), symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/vllama").mkdir(parents=True)
    shutil.copy(SYSTEMD / "vllama.env", root / "etc/vllama/vllama.env")
    shutil.copy(SYSTEMD / "fleet.env", root / "etc/vllama/fleet.env")
    for unit in UNITS:
        shutil.copy(SYSTEMD / unit, root / "etc/systemd/system" / unit)
        exe = root / exec_start(unit)[0].lstrip("/")
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    r = subprocess.run(["systemd-analyze", "verify", f"--root={root}", *UNITS.values()], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    for unit in UNITS.values():
        sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--threshold=50", unit],
                             capture_output=True, text=True)
        if "nrecognized option" not in sec.stderr and "nknown option" not in sec.stderr:
            assert sec.returncode == 0, unit + sec.stdout[-1500:] + sec.stderr


def test_units_are_wired(monkeypatch, tmp_path):
    router = router_args(exec_start("vllama-router.service"))
    router_url = f"http://{router.host}:{router.port}"
    assert not router.worker_urls, "the nodes join the router themselves"
    # every node: the model of vllama.env on its own GPU and port, registered at the router, at its own URL
    for i in ("0", "1"):
        env = unit_env("vllama-node@.service", i)
        s = settings_from(env, monkeypatch, tmp_path)
        monkeypatch.undo()
        assert s.model and s.register_with == router_url and env["CUDA_VISIBLE_DEVICES"] == i
        assert s.advertise_url == f"http://127.0.0.1:{s.port}" and s.port == int(f"1150{i}")
    assert systemd_seconds(values("vllama-node@.service", "TimeoutStopSec")[0]) > DRAIN_AND_STOP + 5  # + leaving the router
    # the front: --upstream the router, on vllama's port
    argv = exec_start("vllama-front.service")
    assert argv[1:3] == ["serve", "--upstream"] and argv[3] == router_url
    front = parse_env_file(SYSTEMD / "vllama.env")  # not read by the front: it serves no model of its own
    assert "vllama.env" not in " ".join(values("vllama-front.service", "EnvironmentFile")) and front


# --- Compose --------------------------------------------------------------------------------------


SECRET = "the-fleet-secret"


def resolved(env: dict) -> dict[str, str]:
    """Compose's ``${VAR:-default}`` as its default, ``${VAR:?error}`` (a required variable) as :data:`SECRET`."""
    return {k: re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", SECRET, re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)))
            for k, v in env.items()}


def test_compose_fleet(monkeypatch, tmp_path):
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    router = router_args(services["router"]["entrypoint"])
    router_url = f"http://router:{router.port}"
    nodes = {name: svc for name, svc in services.items() if name.startswith("node-")}
    assert len(nodes) == 2
    gpus = []
    for name, svc in nodes.items():
        s = settings_from(resolved(svc["environment"]), monkeypatch, tmp_path)
        monkeypatch.undo()
        assert s.model and s.register_with == router_url and s.advertise_url == f"http://{name}:{s.port}"
        assert s.client_keys == [SECRET], "a node takes the fleet secret only"
        assert "ports" not in svc, "only the front is published"
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        gpus += dev["device_ids"]
        assert systemd_seconds(svc["stop_grace_period"]) > DRAIN_AND_STOP + 5
    assert sorted(gpus) == ["0", "1"]
    front = settings_from(resolved(services["front"]["environment"]), monkeypatch, tmp_path)
    assert front.upstream_url == router_url and not front.model and front.upstream_bearer == SECRET
    assert "ports" not in services["router"]
    (port,) = services["front"]["ports"]
    assert int(port.rsplit(":", 1)[1]) == front.port
    assert services["node-1"]["depends_on"]["node-0"]["condition"] == "service_healthy", "engines start one after the other"


# --- Kubernetes ----------------------------------------------------------------------------------


def k8s() -> dict[str, list[dict]]:
    docs: dict[str, list[dict]] = {}
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / res).read_text()):
            if doc:
                docs.setdefault(doc["kind"], []).append(doc)
    return docs


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_kubernetes_fleet(monkeypatch, tmp_path):
    docs = k8s()
    deployments = {d["metadata"]["name"]: d for d in docs["Deployment"]}
    services = {s["metadata"]["name"]: s for s in docs["Service"]}
    (nodes,) = docs["StatefulSet"]
    (router_c,) = deployments["vllm-router"]["spec"]["template"]["spec"]["containers"]
    router = router_args([*router_c["command"], *router_c["args"]])
    # the router's discovery selects the node pods, at the port they listen on, and may list and watch pods
    node_labels = nodes["spec"]["template"]["metadata"]["labels"]
    (node_c,) = nodes["spec"]["template"]["spec"]["containers"]
    assert router.service_discovery and router.selector.items() <= node_labels.items()
    node_settings = settings_from(env_of(node_c), monkeypatch, tmp_path)
    monkeypatch.undo()
    assert router.service_discovery_port == node_settings.port == node_c["ports"][0]["containerPort"]
    assert node_settings.model and not node_settings.register_with, "discovery, not registration"
    (role,) = docs["Role"]
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and "pods" in role["rules"][0]["resources"]
    (binding,) = docs["RoleBinding"]
    assert binding["subjects"][0]["name"] == deployments["vllm-router"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert node_c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert nodes["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > DRAIN_AND_STOP
    # the front: no GPU, --upstream the router's Service, scaled on CPU
    (front_c,) = deployments["vllama-front"]["spec"]["template"]["spec"]["containers"]
    front = settings_from(env_of(front_c), monkeypatch, tmp_path)
    upstream = httpx.URL(front.upstream)
    router_svc = services[upstream.host]
    assert router_svc["spec"]["selector"].items() <= deployments["vllm-router"]["spec"]["template"]["metadata"]["labels"].items()
    (http,) = [p for p in router_svc["spec"]["ports"] if p["port"] == upstream.port]
    assert {p["name"]: p["containerPort"] for p in router_c["ports"]}[http["targetPort"]] == router.port
    assert "nvidia.com/gpu" not in front_c["resources"].get("limits", {}) and front_c["resources"]["requests"]["cpu"]
    (hpa,) = docs["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "vllama-front"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    # the fleet secret: the front sends what every node requires, from one Secret
    def secret_ref(c: dict) -> dict:
        (e,) = [e for e in c["env"] if e["name"] == "VLLAMA_FLEET_SECRET"]
        return e["valueFrom"]["secretKeyRef"]
    assert secret_ref(node_c) == secret_ref(front_c) and not secret_ref(node_c).get("optional")
    # only the router reaches a node, only the fronts reach the router's API and Redis
    policies = {p["metadata"]["name"]: p for p in docs["NetworkPolicy"]}
    for target, source in (("vllama-node", nodes), ("vllm-router", deployments["vllm-router"]),
                           ("vllama-redis", deployments["vllama-redis"])):
        policy = policies[target]["spec"]
        assert policy["podSelector"]["matchLabels"].items() <= source["spec"]["template"]["metadata"]["labels"].items()
    (from_router,) = policies["vllama-node"]["spec"]["ingress"]
    assert from_router["from"][0]["podSelector"]["matchLabels"].items() <= deployments["vllm-router"]["spec"]["template"]["metadata"]["labels"].items()
    # several front replicas share their per-key counts in the recipe's Redis
    assert deployments["vllama-front"]["spec"]["replicas"] > 1 and front.state_url
    redis_svc = services[httpx.URL(front.state_url).host]
    assert redis_svc["spec"]["selector"].items() <= deployments["vllama-redis"]["spec"]["template"]["metadata"]["labels"].items()
    # an upgrade replaces one node at a time, each draining on SIGTERM
    assert nodes["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    ollama_svc = services["vllama"]
    assert ollama_svc["spec"]["selector"].items() <= deployments["vllama-front"]["spec"]["template"]["metadata"]["labels"].items()
