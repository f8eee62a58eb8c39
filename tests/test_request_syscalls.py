"""What a request costs in system calls on vllama's request path (issue 42, item 4: the lone request).

On the c=1 path every system call is paid once per request (and on the 2-core VM several µs each):
``strace -c`` of a worker counted 36.5 per request with ``--workers 1`` and 57 with ``--workers 2``
before these fixes (26.9 and 26.3 after). Each test pins one of the calls cut:

* the shared-memory lock asked ``os.getpid()`` on every section (two sections per request);
* prometheus-client's multiprocess values (``--workers N``) asked ``os.getpid()`` on every
  ``inc``/``observe`` (22 per request);
* the log's ``PrintLogger`` wrote a line and its newline in two writes (the access log, every request);
* the created models' file was stat'ed three times per request, the capabilities worked out again on
  every request, and the body read twice (the second time under its own timeout).

``sys.setprofile`` sees every call of a C function, so a test counts the calls of ``os.getpid`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _count_getpid(fn) -> int:
    calls = 0
    getpid = os.getpid

    def prof(_frame, event, arg):
        nonlocal calls
        if event == "c_call" and arg is getpid:
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_the_shared_lock_asks_no_pid_per_section():
    from vllama_proxy.ipc.lock import SharedLock

    lock = SharedLock()
    with lock.held():  # the first section opens the file
        pass

    def sections():
        for _ in range(10):
            with lock.held():
                pass

    assert _count_getpid(sections) == 0


def test_multiprocess_metrics_ask_no_pid_per_observation(tmp_path):
    """With ``--workers N`` (PROMETHEUS_MULTIPROC_DIR set before prometheus-client is imported, as the CLI does)."""
    code = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, sys.argv[1])
        from test_request_syscalls import _count_getpid
        from vllama_proxy.api import metrics

        def observe():
            for _ in range(10):
                metrics.REQUESTS.labels("/api/generate", "200").inc()
                metrics.TTFT.labels("/api/generate").observe(0.01)
                metrics.IN_FLIGHT.inc()
                metrics.IN_FLIGHT.dec()

        observe()  # the first observations create the values
        print(_count_getpid(observe))
        print(metrics.REQUESTS.labels("/api/generate", "200")._value.get())
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests")], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out == ["0", "20.0"]  # no getpid, and the values still count


def test_a_log_line_is_one_write(monkeypatch):
    from vllama_proxy import logs

    class Stderr(io.StringIO):
        writes = 0

        def write(self, s):  # type: ignore[override]
            Stderr.writes += 1
            return super().write(s)

    err = Stderr()
    monkeypatch.setattr(sys, "stderr", err)
    try:
        logs.configure_logging("info", "json")
        logs.get_logger("vllama.test").info("request", route="/api/generate", status=200)
    finally:
        monkeypatch.undo()
        logs.configure_logging("info", "json")
    assert err.getvalue().count("\n") == 1 and '"event":"request"' in err.getvalue()
    assert Stderr.writes == 1


def test_capabilities_are_worked_out_once_per_model(monkeypatch, tmp_path):
    from vllama_proxy.models import catalog as catalog_mod
    from vllama_proxy.models.vllm_servers import Backend, BackendSpec, ServedModel
    from vllama_proxy.upstream import Upstream

    worked = []
    real = catalog_mod.capabilities
    monkeypatch.setattr(catalog_mod, "capabilities", lambda m, f: worked.append(m.name) or real(m, f))
    model = ServedModel("m", str(tmp_path), 4096, 0, ("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    cat = catalog_mod.Catalog([Backend(BackendSpec("http://127.0.0.1:1", model=model), Upstream("http://127.0.0.1:1"))])

    async def ask():
        return [await cat.capabilities(model) for _ in range(5)]

    answers = asyncio.run(ask())
    assert answers == [["completion", "tools"]] * 5
    answers[0].append("mutated")  # each caller gets its own list
    assert asyncio.run(ask())[0] == ["completion", "tools"]
    assert worked == ["m"]


def test_the_created_models_file_is_looked_at_once_per_request(monkeypatch, tmp_path):
    """model_use.choose resolves the model, checks the key and reads the created model in one look."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from vllama_proxy.api.app_state import CATALOG
    from vllama_proxy.api.request.call import Call
    from vllama_proxy.api.routes.model_use import choose
    from vllama_proxy.models import state_file
    from vllama_proxy.models.vllm_servers import Backend, BackendSpec, ServedModel
    from vllama_proxy.models.catalog import Catalog
    from vllama_proxy.models.created import CreatedStore
    from vllama_proxy.upstream import Upstream

    looks = []
    real = state_file.FileView.get
    monkeypatch.setattr(state_file.FileView, "get", lambda self: looks.append(self.path) or real(self))
    model = ServedModel("m", str(tmp_path), 4096, 0)
    app = web.Application()
    app[CATALOG] = Catalog([Backend(BackendSpec("http://127.0.0.1:1", model=model), Upstream("http://127.0.0.1:1"))],
                           created=CreatedStore(tmp_path / "created.json"))
    request = make_mocked_request("POST", "/api/generate", app=app)

    async def one():
        use = await choose(request, Call(), "m", load=False)
        return use.model, use.made

    assert asyncio.run(one()) == (model, None)
    assert looks == [tmp_path / "created.json"]


def test_a_body_that_arrived_is_read_without_a_timer_and_once(monkeypatch):
    """Admission reads the body, then the route: the second read is the first's bytes, and a body that
    came whole with the headers (the usual small one) needs no --body-timeout timer."""
    from unittest import mock

    from aiohttp import web
    from aiohttp.streams import StreamReader
    from aiohttp.test_utils import make_mocked_request

    from vllama_proxy.api.request import body_reader as request_body
    from vllama_proxy.api.app_state import SETTINGS
    from vllama_proxy.settings import Settings

    def no_timer(_s):
        raise AssertionError("a timer for a body that already arrived")

    monkeypatch.setattr(request_body.asyncio, "timeout", no_timer)

    async def reads():
        app = web.Application()
        app[SETTINGS] = Settings()
        body = b'{"model": "m", "prompt": "hi"}'
        payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
        payload.feed_data(body)
        payload.feed_eof()
        request = make_mocked_request("POST", "/api/generate", headers={"Content-Length": str(len(body))},
                                      app=app, payload=payload)
        return await request_body.read_body(request), await request_body.read_body(request)

    first, second = asyncio.run(reads())
    assert first == second == b'{"model": "m", "prompt": "hi"}'


def test_a_ready_model_is_held_in_two_lock_sections(monkeypatch, tmp_path):
    """A request to a model that serves now takes the shared lock once to begin and once to end (the wait
    for a loading model took three sections to begin: begin waiting, ready, stop waiting; issue 42)."""
    import time

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from vllama_proxy.api.app_state import SETTINGS, WORKER
    from vllama_proxy.api.routes.model_use import model_in_use
    from vllama_proxy.models.vllm_servers import Backend, BackendSpec, ServedModel
    from vllama_proxy.settings import Settings
    from vllama_proxy.ipc import lock as shared_lock
    from vllama_proxy.supervisor.states import State
    from vllama_proxy.supervisor.status import StatusBoard
    from vllama_proxy.upstream import Upstream

    board = StatusBoard("m", workers=1, keep_alive=-1)
    board.publish(State.READY, since=time.time(), restarts=0, pid=None, last_error=None, last_output="")
    rings = []
    monkeypatch.setattr(board.inbox_bell, "ring", lambda kind: rings.append(kind))
    model = ServedModel("m", str(tmp_path), 4096, 0)
    backend = Backend(BackendSpec("http://127.0.0.1:1", board=board, model=model), Upstream("http://127.0.0.1:1"))
    app = web.Application()
    app[SETTINGS], app[WORKER] = Settings(), 0
    request = make_mocked_request("POST", "/api/generate", app=app)
    sections = []
    real = shared_lock.SharedLock.held
    monkeypatch.setattr(shared_lock.SharedLock, "held", lambda self: sections.append(1) or real(self))

    async def one():
        async with model_in_use(request, backend, None):
            assert board.in_flight == 1
        return board.in_flight

    assert asyncio.run(one()) == 0
    assert len(sections) == 2
    assert rings == []  # nobody waits for its end: no IDLE wakes the owner loop (issue 42.4)
    with board.hearing_idle():  # a neighbour waits for room, a drain, a restart waiting for idle
        assert asyncio.run(one()) == 0
    assert [k.name for k in rings] == ["IDLE"]  # then the last request's end, nothing else


@contextlib.contextmanager
def _exceptions_raised():
    """Counts the exceptions raised (and caught or not) in the ``with`` block's frames: yields a one-item
    list, the count once the block ends (``sys.settrace``'s "exception" events)."""
    count = [0]

    def trace(frame, event, _arg):
        if event == "exception":
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        yield count
    finally:
        sys.settrace(None)


def test_a_request_key_is_read_without_a_miss():
    """On an open server every read of a request's key (``key_of``, ~9 per request) found it: a key absent
    from the request raised a KeyError inside ``Mapping.get`` each time (issue 42)."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from vllama_proxy.api.policy import keys as api_keys

    ring = api_keys.KeyRing([], None)
    seen = []

    async def handler(request):
        with _exceptions_raised() as misses:
            keys = [api_keys.key_of(request) for _ in range(9)]
        misses = misses[0]
        seen.append((keys, misses))
        return web.Response()

    async def one():
        request = make_mocked_request("POST", "/api/generate")
        await api_keys.middleware(ring)(request, handler)

    asyncio.run(one())
    keys, misses = seen[0]
    assert keys == [api_keys.OPEN] * 9
    assert misses == 0


def test_a_request_id_builds_no_uuid(monkeypatch):
    """vllama's request id is 16 hex digits of os.urandom, as ``uuid4().hex[:16]`` was, without a UUID object
    per request (issue 42)."""
    import re
    import uuid

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from vllama_proxy.api import app as app_mod
    from vllama_proxy.api.app_state import SETTINGS
    from vllama_proxy.settings import Settings

    def no_uuid():
        raise AssertionError("a UUID built for a request id")

    monkeypatch.setattr(uuid, "uuid4", no_uuid)

    async def handler(request):
        return web.Response()

    async def one():
        app = web.Application()
        app[SETTINGS] = Settings(access_log=False)
        request = make_mocked_request("GET", "/api/version", app=app)
        await app_mod.errors_and_access_log(request, handler)
        return request["vllama.request_id"]

    assert re.fullmatch(r"[0-9a-f]{16}", asyncio.run(one()))


def test_the_cors_hook_finds_its_entry_without_an_origin():
    """``add_cors_headers`` runs as every response is prepared (a stream's: with its first line); a request
    without ``Origin`` had no entry, and the hook's look-up raised a KeyError inside ``Mapping.get`` (issue 42)."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from vllama_proxy.api.policy import access

    seen = []

    async def handler(request):
        response = web.StreamResponse()
        with _exceptions_raised() as misses:
            await access.add_cors_headers(request, response)
        misses = misses[0]
        seen.append((misses, "Access-Control-Allow-Origin" in response.headers))
        return web.Response()

    asyncio.run(access.cors([])(make_mocked_request("POST", "/api/generate"), handler))
    assert seen == [(0, False)]


def test_the_created_models_file_is_looked_at_only_when_a_write_moved_its_count(monkeypatch, tmp_path):
    """Issue 42.4: every request stat'ed ``created.json`` (and, with no model created, raised and caught a
    ``FileNotFoundError``). With the server's change count (``state_file.Changes``, in shared memory) a
    lookup looks at the file only when a write of any of its processes moved the count, and sees that
    write at once; a writer outside the server (another vllama on the state directory) within ``RECHECK``."""
    from vllama_proxy.models import state_file
    from vllama_proxy.models.created import CreatedModel, CreatedStore

    monkeypatch.setattr(state_file, "RECHECK", 3600.0)  # no test waits on a clock: the bound is checked below
    path = tmp_path / "created.json"
    changes = state_file.Changes()
    reader, writer = CreatedStore(path, changes), CreatedStore(path, changes)  # two workers' stores
    looks = []
    real = Path.stat
    monkeypatch.setattr(Path, "stat", lambda self, **kw: (looks.append(self) if self == path else None) or real(self, **kw))
    assert [reader.lookup("mario") for _ in range(5)] == [None] * 5
    assert len(looks) == 1  # the first lookup only
    writer.put(CreatedModel(name="mario", base="m0", parent="m0"))
    assert reader.lookup("mario").base == "m0"  # another process's write, seen at the next lookup
    seen = len(looks)
    assert all(reader.lookup("mario") is not None for _ in range(5)) and len(looks) == seen
    CreatedStore(path).put(CreatedModel(name="luigi", base="m0", parent="m0"))  # outside the server: no count
    assert reader.lookup("luigi") is None and len(looks) == seen
    later = state_file.monotonic() + 3600.0
    monkeypatch.setattr(state_file, "monotonic", lambda: later)
    assert reader.lookup("luigi") is not None  # looked at again once RECHECK passed
