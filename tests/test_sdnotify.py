"""systemd notifications (``vllama_proxy/front/sdnotify.py``), tested against real Unix datagram sockets.

The unit tests bind a socket where systemd would (a path, or an abstract name) and read
what :class:`Notifier` sends, with the sender's credentials as systemd sees them. The
last test runs ``vllama serve --model M`` as a real process under a fake
``NOTIFY_SOCKET``/``WATCHDOG_USEC`` against the stand-in vLLM (``tests/bin/vllm``) and
checks the whole conversation: STATUS=starting, WATCHDOG=1 pings, READY=1 only once
``/readyz`` is 200, STOPPING=1 after SIGTERM, nothing from vLLM itself.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from conftest import free_port
from vllama_proxy.front.sdnotify import Notifier, attach, describe, run_watchdog
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.lifecycle import Supervisor
from vllama_proxy.supervisor.states import State
from vllama_proxy.supervisor.status import StatusBoard

KNOWN_KEYS = {"READY", "STATUS", "STOPPING", "WATCHDOG"}
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _bind(address: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # as systemd does, to check the sender
    s.bind(address)
    s.settimeout(2)
    return s


def _recv(s: socket.socket) -> tuple[str, int | None]:
    """One datagram and the sender's pid (from SCM_CREDENTIALS)."""
    data, anc, _flags, _addr = s.recvmsg(4096, socket.CMSG_SPACE(_CRED.size))
    pid = None
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = _CRED.unpack(payload[: _CRED.size])[0]
    return data.decode(), pid


def _collect(s: socket.socket, quiet: float = 0.5) -> list[str]:
    """Every datagram until none came for ``quiet`` seconds."""
    got = []
    s.settimeout(quiet)
    while True:
        try:
            got.append(_recv(s)[0])
        except TimeoutError:
            return got


def _short_dir(tmp_path: Path) -> Path:
    # sockaddr_un paths are limited to 107 bytes; pytest's tmp_path can be longer
    return tmp_path if len(str(tmp_path)) < 80 else Path(tempfile.mkdtemp(prefix="vn", dir="/tmp"))


@pytest.fixture
def sock_path(tmp_path) -> Path:
    return _short_dir(tmp_path) / "notify.sock"


# --- the Notifier on its own -----------------------------------------------------------


def test_noop_without_notify_socket():
    n = Notifier(environ={})
    assert not n.enabled
    assert n.ready() is False and n.status("x") is False and n.watchdog() is False and n.stopping() is False
    assert n.watchdog_interval() is None


def test_sends_to_a_path_socket_with_our_credentials(sock_path):
    server = _bind(str(sock_path))
    n = Notifier(environ={"NOTIFY_SOCKET": str(sock_path)})
    assert n.enabled
    assert n.status("starting: loading tiny")
    assert n.ready()
    assert n.watchdog()
    assert n.stopping("stopping: SIGTERM")
    assert n.stopping("stopping: later") and n.stopping() is False  # STOPPING=1 only once
    got = [_recv(server) for _ in range(5)]
    assert [m for m, _ in got] == [
        "STATUS=starting: loading tiny",
        "READY=1",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=stopping: SIGTERM",
        "STATUS=stopping: later",
    ]
    assert {pid for _, pid in got} == {os.getpid()}  # what NotifyAccess=main checks
    n.close()
    server.close()


def test_sends_to_an_abstract_socket():
    name = f"vllama-test-{uuid.uuid4().hex}"
    server = _bind(b"\0" + name.encode())
    n = Notifier(environ={"NOTIFY_SOCKET": "@" + name})
    assert n.ready() and n.watchdog_trigger()
    assert [_recv(server)[0] for _ in range(2)] == ["READY=1", "WATCHDOG=trigger"]
    n.close()
    server.close()


def test_status_is_one_line():
    name = f"vllama-test-{uuid.uuid4().hex}"
    server = _bind(b"\0" + name.encode())
    n = Notifier(environ={"NOTIFY_SOCKET": "@" + name})
    n.status("failed: vLLM exited\nREADY=1\n  Traceback ...")  # a newline must not inject an assignment
    assert _recv(server)[0] == "STATUS=failed: vLLM exited READY=1 Traceback ..."
    n.status("x" * 5000)
    assert len(_recv(server)[0]) == len("STATUS=") + 1024
    server.close()


def test_environment_is_unset_for_children(sock_path):
    env = {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid()), "OTHER": "1"}
    n = Notifier(environ=env)
    assert env == {"OTHER": "1"}  # vLLM and the --workers processes must not inherit them
    assert n.enabled and n.watchdog_interval() == 1.0
    kept = {"NOTIFY_SOCKET": str(sock_path)}
    Notifier(environ=kept, unset_environment=False)
    assert kept == {"NOTIFY_SOCKET": str(sock_path)}


def test_reads_os_environ_by_default(monkeypatch, sock_path):
    monkeypatch.setenv("NOTIFY_SOCKET", str(sock_path))
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    n = Notifier()
    assert n.enabled and n.watchdog_interval() == 3.0
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "1000000"}, 1.0),
        ({"WATCHDOG_USEC": "250000", "WATCHDOG_PID": str(os.getpid())}, 0.25),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),  # meant for another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env, expected):
    assert Notifier(environ={"NOTIFY_SOCKET": "@x", **env}).watchdog_interval() == expected
    assert Notifier(environ=dict(env)).watchdog_interval() is None  # no socket, no watchdog


def test_unusable_addresses_never_raise(tmp_path):
    relative = Notifier(environ={"NOTIFY_SOCKET": "notify.sock"})  # sd_notify(3): absolute or @abstract only
    assert not relative.enabled and relative.ready() is False
    missing = Notifier(environ={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert missing.enabled
    assert missing.ready() is False and missing.watchdog() is False  # logged, not raised


# --- attached to the real Supervisor ------------------------------------------------------


def test_attach_follows_supervisor_transitions(sock_path):
    server = _bind(str(sock_path))
    settings = Settings(model="/models/tiny", served_model_name="tiny", gpu_check=False)
    sup = Supervisor(settings, settings.configured_models()[0], port=free_port(), board=StatusBoard("tiny"))
    n = Notifier(environ={"NOTIFY_SOCKET": str(sock_path)})
    attach(sup, n)
    for state, reason in [
        (State.READY, None),
        (State.UNHEALTHY, "vLLM exited with code -9"),
        (State.RESTARTING, "vLLM exited with code -9"),
        (State.STARTING, None),
        (State.READY, None),
        (State.STOPPING, None),
        (State.STOPPED, None),
    ]:
        sup._set(state, reason)  # the supervisor's one transition path, listeners included
    got = _collect(server)
    assert got == [
        "STATUS=starting: loading tiny",
        "STATUS=ready: serving tiny",
        "READY=1",  # the first time only
        "STATUS=unhealthy: vLLM exited with code -9",
        "STATUS=restarting: vLLM exited with code -9",
        "STATUS=starting: loading tiny",
        "STATUS=ready: serving tiny",
        "STOPPING=1\nSTATUS=stopping: shutting down vLLM",
        "STATUS=stopped: vLLM stopped",
    ]
    server.close()


def test_attach_to_a_pool_is_ready_once_every_preload_settled(sock_path):
    from vllama_proxy.models.launch_spec import ModelConfig
    from vllama_proxy.supervisor.pool import ModelPool

    server = _bind(str(sock_path))
    specs = [ModelConfig(model="/a", name="a"), ModelConfig(model="/b", name="b"), ModelConfig(model="/c", name="c", preload=False),
             ModelConfig(model="/d", name="d")]
    pool = ModelPool(Settings(workers=1, gpu_check=False), specs, [free_port() for _ in specs])
    a, b, c, d = pool.supervisors
    n = Notifier(environ={"NOTIFY_SOCKET": str(sock_path)})
    attach(pool, n)
    d._set(State.FAILED, "vLLM exited with code 1 during startup")  # does not hold the others back
    a._set(State.READY)
    b._set(State.UNLOADED, "no room: needs 0.9 of GPU 0, held by a (0.9, ready)")  # left to load on demand
    c._set(State.STARTING, "requested")
    c._set(State.READY)
    got = _collect(server)
    assert got == [
        "STATUS=a: starting: loading a",
        "STATUS=b: starting: loading b",
        "STATUS=c: unloaded",
        "STATUS=d: starting: loading d",
        "STATUS=d: failed: vLLM exited with code 1 during startup",
        "STATUS=a: ready: serving a",
        "STATUS=b: unloaded: no room: needs 0.9 of GPU 0, held by a (0.9, ready)",
        "READY=1",  # a ready, b settled unloaded, c loads on demand, d failed: nothing left starting
        "STATUS=c: starting: requested",
        "STATUS=c: ready: serving c",
    ]
    server.close()


def test_describe():
    assert describe(State.FAILED, "vLLM exited with code 1 during startup", "m") == "failed: vLLM exited with code 1 during startup"
    assert describe(State.STARTING, None, "m", restarts=2) == "starting: loading m (restart 2)"


class _FakeSupervisor:
    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None


async def test_watchdog_pings_while_the_supervisor_runs_and_stops_quietly(sock_path):
    server = _bind(str(sock_path))
    server.setblocking(False)
    sup = _FakeSupervisor()
    sup._task = asyncio.create_task(sup._stop.wait())
    n = Notifier(environ={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"})
    dog = asyncio.create_task(run_watchdog(sup, n))
    await asyncio.sleep(0.45)  # pings at 0, 0.1, 0.2, 0.3, 0.4
    sup._stop.set()  # a requested stop: the supervisor's task ends normally
    await asyncio.wait_for(dog, 1)
    got = _collect(server)
    assert 4 <= got.count("WATCHDOG=1") <= 6 and set(got) == {"WATCHDOG=1"}
    server.close()


async def test_watchdog_stops_and_triggers_when_the_supervisor_dies(sock_path):
    server = _bind(str(sock_path))
    server.setblocking(False)
    sup = _FakeSupervisor()

    async def crash() -> None:
        await asyncio.sleep(0.25)
        raise RuntimeError("boom")

    sup._task = asyncio.create_task(crash())
    n = Notifier(environ={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"})
    await asyncio.wait_for(run_watchdog(sup, n), 2)  # returns by itself: no more pings
    got = _collect(server)
    assert got[-2:] == ["STATUS=failed: supervisor died: RuntimeError('boom')", "WATCHDOG=trigger"]
    assert set(got[:-2]) == {"WATCHDOG=1"} and len(got[:-2]) >= 2
    server.close()


async def test_watchdog_without_supervisor_pings_until_cancelled(sock_path):
    server = _bind(str(sock_path))
    server.setblocking(False)
    n = Notifier(environ={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"})
    dog = asyncio.create_task(run_watchdog(None, n))  # vllama serve --upstream: no supervisor
    await asyncio.sleep(0.35)
    assert not dog.done()
    dog.cancel()
    got = _collect(server)
    assert set(got) == {"WATCHDOG=1"} and len(got) >= 3
    server.close()


async def test_no_watchdog_configured_returns_at_once(sock_path):
    sup = _FakeSupervisor()
    await asyncio.wait_for(run_watchdog(sup, Notifier(environ={"NOTIFY_SOCKET": str(sock_path)})), 0.5)
    await asyncio.wait_for(run_watchdog(sup, Notifier(environ={"WATCHDOG_USEC": "1000000"})), 0.5)


def _drain(server: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(server.recv(4096).decode())
        except BlockingIOError:
            return out


# --- vllama serve as systemd runs it -------------------------------------------------------


class _Collector(threading.Thread):
    """Reads datagrams from the fake NOTIFY_SOCKET as they come: (arrival index, message, sender pid)."""

    def __init__(self, server: socket.socket) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.server.settimeout(0.1)
        self.messages: list[tuple[str, int | None]] = []
        self.lock = threading.Lock()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                msg = _recv(self.server)
            except (TimeoutError, socket.timeout):
                continue
            with self.lock:
                self.messages.append(msg)

    def snapshot(self) -> list[str]:
        with self.lock:
            return [m for m, _ in self.messages]


def test_serve_notifies_systemd(tmp_path, vllama):
    sock = _short_dir(tmp_path) / "n.sock"
    collector = _Collector(_bind(str(sock)))
    collector.start()
    env = {
        "FAKE_VLLM_START_DELAY": "2",  # a loading window in which /readyz is 503
        "NOTIFY_SOCKET": str(sock),
        "WATCHDOG_USEC": "1000000",  # WatchdogSec=1: a ping every 0.5 s
    }
    try:
        v = vllama(env=env, flags=["--drain-timeout", "5"])
        proc = v.proc
        # READY=1 must never be seen while /readyz still says no: look at what was sent, then ask
        saw_loading = False
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, f"no READY=1; got {collector.snapshot()}\n{v.log.read_text()[-3000:]}"
            sent = collector.snapshot()
            ready = httpx.get(v.url + "/readyz")
            if "READY=1" in sent:
                assert ready.status_code == 200, ready.text
                break
            if ready.status_code == 503 and ready.json()["state"] == "starting":
                saw_loading = True
            time.sleep(0.05)
        assert saw_loading, "the stand-in vLLM should take 2 s to load"
        time.sleep(1.2)  # watchdog pings go on while ready

        # systemd's variables are for vllama alone: vLLM (and any worker) must not inherit them
        vllm_env = Path(f"/proc/{v.server_pid()}/environ").read_bytes().split(b"\0")
        assert not [e for e in vllm_env if e.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_USEC=", b"WATCHDOG_PID="))]

        before_term = len(collector.snapshot())
        assert v.stop() == 0
    finally:
        time.sleep(0.3)  # let the reader take the last datagrams
        collector.done.set()
        collector.join(2)
        collector.server.close()

    datagrams = [m for m, _ in collector.messages]
    assert {pid for _, pid in collector.messages} == {proc.pid}, "every message comes from the main process (NotifyAccess=main)"
    lines = [(i, line) for i, d in enumerate(datagrams) for line in d.split("\n")]
    assert all(line.split("=", 1)[0] in KNOWN_KEYS for _, line in lines), datagrams
    at = [i for i, _ in lines]
    text = [line for _, line in lines]

    assert text[0].startswith("STATUS=starting: "), datagrams
    assert text.count("READY=1") == 1
    ready_at = at[text.index("READY=1")]
    assert any(t.startswith("STATUS=ready") for t in text[: text.index("READY=1")]), datagrams

    pings = [i for i, t in lines if t == "WATCHDOG=1"]
    assert any(i < ready_at for i in pings), "pings start while vLLM loads"
    assert sum(i > ready_at for i in pings) >= 2, "pings go on while ready"

    assert text.count("STOPPING=1") == 1
    stopping_at = at[text.index("STOPPING=1")]
    assert stopping_at >= before_term > ready_at, "STOPPING=1 comes after SIGTERM"
    statuses = [t for t in text if t.startswith("STATUS=")]
    assert statuses[-1].startswith("STATUS=stopped"), statuses
    stopped_at = at[text.index(statuses[-1])]
    assert not [i for i in pings if i > stopped_at], "no ping once the supervisor has stopped"
