"""A node joins a ``vllm-router`` (``--register-with``): the router lists it while it serves.

The router (vllm-project/router) forgets the workers added by ``POST /add_worker?url=U`` when it
restarts; its own health checks take a failing worker out of rotation and bring it back, so an engine
restarted by its supervisor rejoins by itself. This loop covers the rest (a router started after the
node, or restarted since): every ``register_interval`` s, and at once when a model becomes ready, it
reads ``GET /list_workers`` and, while this node can serve and is not listed, calls ``/add_worker``
(400 "already exists" counts as listed). On a clean stop it calls ``/remove_worker`` first, so the
router sends nothing more while the node drains.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import time
from collections.abc import Callable, Sequence

from vllama_proxy.errors import UpstreamError
from vllama_proxy.logs import get_logger
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.child import VllmProcess, find_executable
from vllama_proxy.supervisor.lifecycle import Supervisor
from vllama_proxy.supervisor.states import State
from vllama_proxy.upstream import Upstream, read_json

log = get_logger("vllama.fleet")


def advertise_url(settings: Settings) -> str:
    """``--advertise-url``, else ``http://<host name>:<--port>`` (``--host`` when it names one address)."""
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    host = settings.host if settings.host not in ("", "0.0.0.0", "::") else socket.gethostname()
    return f"http://{host}:{settings.port}"


class Registration:
    """Keeps this node listed by the router at ``settings.register_with`` while ``serving()``.

    Args:
        settings: ``register_with``, ``advertise_url``, ``register_interval``, ``api_key_upstream``
            (sent as the router's bearer token, if it has one).
        serving: whether the node can take requests now (some configured model ready or loadable).
    """

    def __init__(self, settings: Settings, serving: Callable[[], bool]) -> None:
        assert settings.register_with
        self.url = advertise_url(settings)
        self._router = Upstream(settings.register_with, connect_timeout=5.0, read_timeout=settings.startup_timeout,
                                api_key=settings.upstream_bearer)
        self._interval = settings.register_interval
        self._serving = serving
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.listed = False

    def watch(self, supervisors: Sequence[Supervisor]) -> None:
        """Check at once when one of ``supervisors`` becomes ready (call before they start)."""
        for sup in supervisors:
            sup.listeners.append(self._on_transition)

    def _on_transition(self, state: State, _reason: str | None) -> None:
        if state is State.READY:
            self._poke.set()

    async def start(self) -> None:
        await self._router.start()
        self._task = asyncio.create_task(self._run(), name="fleet-registration")

    async def stop(self) -> None:
        """Leave the router (best effort, a few seconds at most), then stop checking."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await asyncio.wait_for(self._call("/remove_worker"), 5.0)
            log.info("router_left", router=self._router.base_url, url=self.url)
        except (UpstreamError, asyncio.TimeoutError) as e:
            log.warning("router_leave_failed", router=self._router.base_url, url=self.url, error=str(e))
        await self._router.close()

    async def _run(self) -> None:
        while True:
            if self._serving():
                try:
                    await self.check()
                except UpstreamError as e:
                    log.warning("router_unreachable", router=self._router.base_url, error=e.message)
            try:
                await asyncio.wait_for(self._poke.wait(), self._interval)
            except asyncio.TimeoutError:
                pass
            self._poke.clear()

    async def check(self) -> None:
        """Add this node unless the router lists it.

        Raises:
            UpstreamError: the router could not be reached, or refused the node (its message).
        """
        data = await self._router.get_json("/list_workers")
        urls = {str(u).rstrip("/") for u in (data.get("urls") or [])} if isinstance(data, dict) else set()
        if self.url in urls:
            self.listed = True
            return
        status, text = await self._call("/add_worker")
        self.listed = status < 400 or "already exists" in text
        log.info("router_joined" if self.listed else "router_join_failed", router=self._router.base_url, url=self.url,
                 answer=text[:200])

    async def _call(self, path: str) -> tuple[int, str]:
        return await self._router.answer("POST", path, {"url": self.url})


#: vllm-router logs every session ``sticky_least_loaded`` opens and releases at info, two lines per
#: request with one-request sessions (``--request-sessions``): the router started by ``--router`` logs
#: that policy's lines from warning up, the rest at info (``RUST_LOG``, read by its tracing filter,
#: which replaces ``--log-level``: set only when neither is given).
ROUTER_RUST_LOG = "info,vllm_router_rs::policies::sticky_least_loaded=warn"

#: Seconds the front retries ``GET /list_workers`` at start while its ``--upstream`` cannot be reached.
ROUTER_PROBE_S = 5.0


async def resolve_request_sessions(settings: Settings) -> Settings:
    """``settings`` with ``--request-sessions auto`` decided, once at start, and logged.

    On with ``--router sticky_least_loaded`` (the front knows its router's policy); with
    ``--upstream``, on when the upstream answers ``GET /list_workers`` as vllm-router does
    (``{"urls": [...]}``; a node or a vLLM answers 404), retried for :data:`ROUTER_PROBE_S`
    while it cannot be reached. vllm-router does not tell its policy: under another policy the
    one-request keys are ignored (``round_robin``, ``cache_aware``, ``power_of_two``) or hashed
    (``consistent_hash``: such requests are then placed at random rather than by conversation),
    so give ``--request-sessions off`` to a front before a ``consistent_hash`` router.
    Off, ``on`` included, where no router can read the keys: without a session header
    (``--session-header ''``: nothing would be sent, only released) or an upstream (a node sends to
    its own vLLM, which answers each ``/finish_session`` 404); that override, and an upstream not
    reached at start, are logged at warning (the fleet then places these requests by count).
    """
    chosen = settings.request_sessions
    warn = False
    if not settings.upstream_url:
        on, source = False, "no --upstream: vllama sends to its own vLLM, no router reads the keys"
        warn = chosen == "on"
    elif not settings.session_header:
        on, source = False, "--session-header '' (no session header is sent)"
        warn = chosen == "on"
    elif chosen != "auto":
        on, source = chosen == "on", "--request-sessions"
    elif settings.router:
        on = settings.router == "sticky_least_loaded"
        source = f"--router {settings.router}"
    else:
        on, source, warn = await _is_router(settings)
    (log.warning if warn else log.info)(
        "request_sessions", on=on, source=source, header=settings.session_header or None, asked=chosen,
        effect="a request with no key to share goes under a key of its own, released at the router when it ends: "
               "sticky_least_loaded places it by requests in flight" if on else
               "requests without a key of their own go without one (the router's policy alone places them)")
    return settings.model_copy(update={"request_sessions": "on" if on else "off"})


async def _is_router(settings: Settings) -> tuple[bool, str, bool]:
    """``(whether the upstream is a vllm-router, why, whether it could not be reached)``."""
    assert settings.upstream_url
    probe = Upstream(settings.upstream_url, connect_timeout=2.0, read_timeout=5.0, api_key=settings.upstream_bearer)
    await probe.start()
    deadline = time.monotonic() + ROUTER_PROBE_S
    try:
        while True:
            try:
                async with probe.request("GET", "/list_workers", check=False) as resp:
                    status = resp.status
                    data = await read_json(resp) if status == 200 else None
                break
            except UpstreamError as e:
                if time.monotonic() > deadline:
                    return False, f"the upstream could not be reached at start ({e.message}): give --request-sessions on before a router", True
                await asyncio.sleep(0.5)
    finally:
        await probe.close()
    if isinstance(data, dict) and isinstance(data.get("urls"), list):
        return True, "the upstream answers GET /list_workers: a vllm-router", False
    return False, f"the upstream is no vllm-router (GET /list_workers: HTTP {status})", False


class RouterChild:
    """``vllama serve --router POLICY``: vLLM's router started by the front, as the front's upstream.

    Runs ``vllm-router --host HOST --port ROUTER_PORT --policy POLICY ROUTER_ARGS`` (the ``vllm-router``
    beside this Python, else on ``PATH``) with no workers: the nodes join it (``--register-with``, this
    module's :class:`Registration`), and again after it restarts. It listens on the front's ``--host``
    so that nodes on other hosts reach it; the front reaches it on loopback. Restarted one second after
    it exits on its own; stopped with its process group (SIGTERM, SIGKILL after 5 s: ``supervisor/child.py``,
    as vLLM is) after the front drained; it gets SIGTERM from the kernel if vllama dies first (the
    parent-death signal of ``supervisor/lifeline.py``).

    Raises (from :meth:`start`):
        RuntimeError: no ``vllm-router`` executable, or the router did not answer ``GET /liveness``
            within 30 s (its output is logged).
    """

    def __init__(self, settings: Settings) -> None:
        assert settings.router
        exe = find_executable("vllm-router")
        if exe is None:
            raise RuntimeError("--router: no vllm-router beside this Python or on PATH (pip install vllm-router)")
        host = settings.host or "0.0.0.0"
        self.argv = [exe, "--host", host, "--port", str(settings.router_port), "--policy", settings.router,
                     *shlex.split(settings.router_args)]
        self.url = f"http://127.0.0.1:{settings.router_port}"
        self.proc: VllmProcess | None = None
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        await self._launch()
        self._task = asyncio.create_task(self._watch(), name="router-child")

    async def _launch(self) -> None:
        # the same owner of a child's process group as vLLM's (supervisor/child.py): its output in
        # vllama's log, the parent-death signal, the whole group stopped
        quiet = "RUST_LOG" not in os.environ and "--log-level" not in " ".join(self.argv)
        self.proc = await VllmProcess.launch(self.argv, env={**os.environ, "RUST_LOG": ROUTER_RUST_LOG} if quiet else None,
                                             model="vllm-router")
        probe = Upstream(self.url, connect_timeout=1.0, read_timeout=5.0)
        await probe.start()
        try:
            for _ in range(300):
                if self.proc.returncode is not None:
                    break
                try:
                    async with probe.request("GET", "/liveness", check=False) as resp:
                        if resp.status == 200:
                            return
                except UpstreamError:
                    pass
                await asyncio.sleep(0.1)
        finally:
            await probe.close()
        raise RuntimeError(f"--router: vllm-router did not answer {self.url}/liveness (exit code {self.proc.returncode})")

    async def _watch(self) -> None:
        while True:
            assert self.proc is not None
            code = await self.proc.wait()
            if self._stopping:
                return
            log.warning("router_exited", pid=self.proc.pid, code=code, restart_in_s=1.0)
            await asyncio.sleep(1.0)
            try:
                await self._launch()
                self.restarts += 1
            except RuntimeError as e:
                log.error("router_restart_failed", error=str(e))

    async def stop(self) -> None:
        """SIGTERM the router's process group, SIGKILL after 5 s (``VllmProcess.stop``); waits for the group to exit."""
        self._stopping = True
        if self.proc is not None:
            await self.proc.stop(grace=5.0)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        log.info("router_stopped")
