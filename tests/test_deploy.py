"""The deployment files in ``deploy/`` (systemd, container, Kubernetes) and the install scripts.

Each file is parsed by what reads it in production where that tool is here
(``systemd-analyze verify``, pydantic-settings, YAML), its numbers are checked against
vllama's own settings (drain and stop times, port), and every probe path and port it
names is asked of a real ``vllama serve --model`` process (against the stand-in vLLM).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import ROOT, parse_env_file, settings_from, systemd_seconds, unit_entries
from vllama_proxy.settings import Settings

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "vllama.service"
ENV_FILE = DEPLOY / "systemd" / "vllama.env"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
COMPOSE = DEPLOY / "container" / "compose.yaml"
K8S = DEPLOY / "kubernetes"
SCRIPTS = [ROOT / "scripts" / "install-systemd.sh", ROOT / "scripts" / "uninstall-systemd.sh"]

DEFAULTS = Settings.model_fields
DRAIN = DEFAULTS["drain_timeout"].default
STOP_GRACE = DEFAULTS["stop_grace"].default
GPU_RELEASE = DEFAULTS["gpu_release_timeout"].default
SWEEP = 5  # child.sweep_session's wait for SIGKILLed leftovers
#: the longest a clean stop takes with default settings: drain, vLLM's SIGTERM grace, sweep, GPU release
STOP_BUDGET = DRAIN + STOP_GRACE + SWEEP + GPU_RELEASE
PORT = DEFAULTS["port"].default


# --- helpers ------------------------------------------------------------------------------


def unit_value(key: str, section: str = "Service") -> str:
    values = [v for s, k, v in unit_entries(UNIT) if s == section and k == key]
    assert values, f"{key}= missing from [{section}]"
    return values[-1]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    out, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def docker(name: str) -> list[str]:
    return [rest for word, rest in dockerfile_instructions() if word == name]


def k8s_docs() -> dict[str, list[dict]]:
    docs: dict[str, list[dict]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.setdefault(doc["kind"], []).append(doc)
    return docs


def deployment() -> dict:
    (dep,) = k8s_docs()["Deployment"]
    return dep


def container() -> dict:
    (c,) = deployment()["spec"]["template"]["spec"]["containers"]
    return c


def k8s_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"] if "value" in e}


def compose_service() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]["vllama"]


def compose_env() -> dict[str, str]:
    """The service's environment with ``${VAR:-default}`` resolved to its default."""
    env = compose_service()["environment"]
    return {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def healthcheck_urls() -> list[str]:
    """URLs the image's HEALTHCHECK fetches, ``${VLLAMA_PORT:-11434}`` resolved."""
    (hc,) = docker("HEALTHCHECK")
    urls = re.findall(r"https?://[^\s\"']+", hc)
    return [re.sub(r"\$\{VLLAMA_PORT:-(\d+)\}", r"\1", u) for u in urls]


def probe_paths() -> dict[str, str]:
    """Every HTTP path the deployment files send to vllama -> where it is named."""
    paths: dict[str, str] = {}
    for url in healthcheck_urls():
        paths[httpx.URL(url).path] = "Dockerfile HEALTHCHECK"
    hc = compose_service().get("healthcheck")
    if hc:
        for url in re.findall(r"https?://[^\s\"',\]]+", json.dumps(hc["test"])):
            paths[httpx.URL(re.sub(r"\$\{?VLLAMA_PORT\S*?\}?(?=/)", str(PORT), url)).path] = "compose healthcheck"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        paths.setdefault(container()[probe]["httpGet"]["path"], f"Deployment {probe}")
    for sm in k8s_docs().get("ServiceMonitor", []):
        for ep in sm["spec"]["endpoints"]:
            paths.setdefault(ep.get("path", "/metrics"), "ServiceMonitor")
    for _, _, value in unit_entries(UNIT):
        for url in re.findall(r"https?://[^\s\"']+", value):
            if httpx.URL(url).host in ("127.0.0.1", "localhost", "::1"):
                paths.setdefault(httpx.URL(url).path, "vllama.service")
    return paths


# --- systemd ------------------------------------------------------------------------------


def test_unit_passes_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify checks that ExecStart's program exists: give it a root holding the installed layout
    root = tmp_path / "root"
    for d in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(d).is_dir() and not (root / d.lstrip("/")).exists():
            shutil.copytree(d, root / d.lstrip("/"), symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system/vllama.service")
    env_target = root / unit_value("EnvironmentFile").lstrip("-/")
    env_target.parent.mkdir(parents=True)
    shutil.copy(ENV_FILE, env_target)
    for command in ("ExecStart", "ExecReload"):
        exe = root / shlex.split(unit_value(command))[0].lstrip("/")
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    r = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "vllama.service"], capture_output=True, text=True)
    # verify exits 0 on unknown keys and unparsable values, only warning: any output is a failure
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--threshold=50", "vllama.service"],
                         capture_output=True, text=True)
    if "nrecognized option" not in sec.stderr and "nknown option" not in sec.stderr:  # systemd < 250
        assert sec.returncode == 0, sec.stdout[-2000:] + sec.stderr  # exposure at most 5.0 ("MEDIUM")


def test_unit_settings():
    assert unit_value("Type") == "notify" and unit_value("NotifyAccess") == "main"
    assert unit_value("ExecStart") == "/opt/vllama/venv/bin/vllama serve"
    assert unit_value("User") == "vllama"
    # SIGTERM to vllama alone (it drains, then stops vLLM), SIGKILL for the whole cgroup after
    assert unit_value("KillMode") == "mixed"
    assert systemd_seconds(unit_value("TimeoutStopSec")) > STOP_BUDGET
    assert systemd_seconds(unit_value("TimeoutStartSec")) >= DEFAULTS["startup_timeout"].default
    assert 0 < systemd_seconds(unit_value("WatchdogSec")) < 600
    assert int(unit_value("LimitNOFILE")) >= 65536
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes"}.items():
        assert unit_value(key) == value, key
    assert "PrivateDevices" not in {k for _, k, _ in unit_entries(UNIT)}, "would hide /dev/nvidia*"
    # writable: only the state and cache directories, and the model cache is one of them
    env = dict(v.split("=", 1) for s, k, v in unit_entries(UNIT) if k == "Environment")
    writable = [f"/var/lib/{unit_value('StateDirectory')}", f"/var/cache/{unit_value('CacheDirectory')}"]
    assert env["HF_HOME"].startswith(writable[1] + "/") and env["HOME"] in writable
    assert not [k for _, k, _ in unit_entries(UNIT) if k == "ReadWritePaths"]
    assert unit_value("WantedBy", "Install") == "multi-user.target"


def test_env_example_loads_into_settings(monkeypatch, tmp_path):
    env = parse_env_file(ENV_FILE)
    documented = {
        "model": "Qwen/Qwen2.5-1.5B-Instruct",
        "alias": {"qwen2.5:1.5b": "Qwen/Qwen2.5-1.5B-Instruct"},
        "vllm_args": ["--max-model-len", "8192", "--gpu-memory-utilization", "0.90"],
        "host": "127.0.0.1",
        "port": 11434,
    }
    as_systemd_reads_it = settings_from(env, monkeypatch, tmp_path)
    assert {k: getattr(as_systemd_reads_it, k) for k in documented} == documented
    monkeypatch.undo()
    settings_from({}, monkeypatch, tmp_path)  # a clean environment again
    as_dotenv = Settings(_env_file=ENV_FILE)  # pydantic-settings' own reader agrees
    assert {k: getattr(as_dotenv, k) for k in documented} == documented


def test_every_commented_example_is_a_valid_setting(monkeypatch, tmp_path):
    active = parse_env_file(ENV_FILE)
    examples = re.findall(r"^#(VLLAMA_[A-Z_]+=\S.*)$", ENV_FILE.read_text(), flags=re.M)
    assert len(examples) >= 10
    for line in examples:
        name = line.split("=", 1)[0]
        assert name.removeprefix("VLLAMA_").lower() in DEFAULTS, f"{name} is not a setting"
        one = tmp_path / "one.env"
        one.write_text(line + "\n")
        settings_from({**active, **parse_env_file(one)}, monkeypatch, tmp_path)  # raises if invalid
        monkeypatch.undo()


def test_install_scripts_match_the_unit():
    install = SCRIPTS[0].read_text()
    exe = shlex.split(unit_value("ExecStart"))[0]
    assert exe == "/opt/vllama/venv/bin/vllama" and "PREFIX:-/opt/vllama" in install and '"$PREFIX/venv"' in install
    assert unit_value("EnvironmentFile") == "/etc/vllama/vllama.env" and "CONF_DIR=/etc/vllama" in install
    assert "deploy/systemd/vllama.service" in install and "deploy/systemd/vllama.env" in install
    assert "useradd --system" in install and "daemon-reload" in install and "systemctl enable" in install


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_valid_bash(script):
    assert os.access(script, os.X_OK)
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


# --- container -----------------------------------------------------------------------------


def test_dockerfile():
    (arg,) = [a for a in docker("ARG") if a.startswith("VLLM_IMAGE=")]
    image = arg.split("=", 1)[1]
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", image), "a pinned vLLM release"
    assert docker("FROM") == ["${VLLM_IMAGE}"]
    (user,) = docker("USER")
    assert user not in ("root", "0")
    (entry,) = docker("ENTRYPOINT")
    assert json.loads(entry)[-2:] == ["vllama", "serve"]
    assert docker("EXPOSE") == [str(PORT)]
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(docker("ENV"))))
    assert env["VLLAMA_HOST"] == "0.0.0.0" and env["VLLAMA_PORT"] == str(PORT)
    assert [httpx.URL(u).port for u in healthcheck_urls()] == [PORT]
    # what the build copies exists, and the Dockerfile's own ignore file lets it through
    for copy in docker("COPY"):
        for src in copy.split()[:-1]:
            if not src.startswith("--"):
                assert (ROOT / src).exists(), src
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert "*" in ignore and {"!pyproject.toml", "!README.md", "!vllama_proxy/"} <= set(ignore)


def test_compose(monkeypatch, tmp_path):
    svc = compose_service()
    assert (COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DOCKERFILE
    env = compose_env()
    assert env["VLLAMA_HOST"] == "0.0.0.0"
    settings = settings_from(env, monkeypatch, tmp_path)
    assert settings.model and settings.port == PORT
    (port,) = svc["ports"]
    assert int(str(port).rsplit(":", 1)[1]) == settings.port
    (gpu,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"] and gpu["count"] == 1
    hf_home = dict(re.findall(r"(\w+)=(\S+)", " ".join(docker("ENV"))))["HF_HOME"]
    assert [v for v in svc["volumes"] if v.split(":")[1] == hf_home], "the Hugging Face cache is a volume"
    assert systemd_seconds(svc["stop_grace_period"]) > STOP_BUDGET


# --- Kubernetes -----------------------------------------------------------------------------


def test_kubernetes_manifests(monkeypatch, tmp_path):
    docs = k8s_docs()
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res
    assert {"Deployment", "Service", "PersistentVolumeClaim", "ServiceMonitor", "Kustomization"} <= set(docs)
    dep, c = deployment(), container()
    spec = dep["spec"]["template"]["spec"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()

    startup, ready, live = c["startupProbe"], c["readinessProbe"], c["livenessProbe"]
    assert startup["httpGet"]["path"] == "/readyz" and ready["httpGet"]["path"] == "/readyz" and live["httpGet"]["path"] == "/livez"
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 20 * 60, "model download and load"
    pre_stop = c["lifecycle"]["preStop"]
    sleep = int(pre_stop["exec"]["command"][-1]) if "exec" in pre_stop else pre_stop["sleep"]["seconds"]
    assert sleep > 0 and spec["terminationGracePeriodSeconds"] > sleep + STOP_BUDGET

    # one port, the one vllama listens on, reachable from the Service and the ServiceMonitor
    env = k8s_env()
    settings = settings_from(env, monkeypatch, tmp_path)
    assert env["VLLAMA_HOST"] == "0.0.0.0" and settings.model
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": settings.port} and settings.port == PORT
    for probe in (startup, ready, live):
        assert ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"]) == settings.port
    (svc,) = docs["Service"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (sp,) = svc["spec"]["ports"]
    assert ports.get(sp["targetPort"], sp["targetPort"]) == settings.port
    (sm,) = docs["ServiceMonitor"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {ep["port"] for ep in sm["spec"]["endpoints"]} == {sp["name"]}

    # the model cache is the PVC, mounted where HF_HOME points; runs as the image's user
    (pvc,) = docs["PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    cache = [path for path, name in mounts.items() if volumes[name].get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]]
    assert len(cache) == 1 and env["HF_HOME"].startswith(cache[0] + "/")
    uid = next(a for a in docker("ARG") if a.startswith("UID=")).split("=")[1]
    assert spec["securityContext"]["runAsUser"] == int(uid) and spec["securityContext"]["runAsNonRoot"]


# --- what the files name, asked of a running vllama -------------------------------------------


def test_probe_paths_are_answered_by_vllama_serve(vllama):
    paths = probe_paths()
    assert {"/readyz", "/livez", "/metrics"} <= set(paths)
    v = vllama(env={"FAKE_VLLM_START_DELAY": "1.5"}, flags=["--health-interval", "0.5", "--drain-timeout", "2"])
    # while vLLM loads: alive, not ready (so startup and readiness probes hold traffic back)
    assert httpx.get(v.url + "/livez").status_code == 200
    loading = httpx.get(v.url + "/readyz")
    assert loading.status_code == 503 and loading.json()["state"] == "starting"
    v.wait_state("ready", timeout=30)
    for path, where in sorted(paths.items()):
        r = httpx.get(v.url + path)
        assert r.status_code == 200, f"{path} (named in {where}) answered {r.status_code}: {r.text[:200]}"
        if path.endswith("metrics"):
            assert r.headers["content-type"].startswith("text/plain"), f"{path}: not Prometheus text"
    assert v.stop() == 0


def test_deploy_readme_paths_exist():
    text = (DEPLOY / "README.md").read_text()
    named = set(re.findall(r"(?<![\w/.-])((?:deploy|scripts)/[\w./-]*\w)", text))
    assert named
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, missing
