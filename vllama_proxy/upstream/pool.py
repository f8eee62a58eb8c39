"""The shared pool of connections to vLLM (and a router): sessions, connector, limits, the bounded connects.

One ``aiohttp.ClientSession`` per app, with an unlimited pool and no total timeout (a request may queue in
vLLM for minutes: ``docs/wire.md`` "The upstream"), a connect timeout and an idle-read timeout instead. Idle
connections retire after :func:`idle_lifetime`, before vLLM's uvicorn closes them, and a request that fails
on a reused connection before any byte of the answer is sent once more on a fresh one (RFC 9112 9.3.1); a
router's control calls (:meth:`Upstream.answer`) have :data:`CONTROL_CONNECTIONS` of their own. Invariants:
new connections open ``connect_concurrency`` at a time (``supervisor/sizing.py``), the rest waiting here,
not as SYNs in the kernel's queue; a connect not answered within :data:`CONNECT_TRY_S` is retried on a new
socket with doubling time, and fails only when ``connect_timeout`` passed both since it began and since
this process last connected to that server. Why, with numbers: ``docs/decisions.md``.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
import weakref
from typing import Any

import aiohttp

from vllama_proxy.logs import get_logger

log = get_logger("vllama.upstream")

#: Seconds the first try of a TCP connect is given (then 2x, 4x ...: the module's docstring).
CONNECT_TRY_S = 0.2

#: Connections a client opens at once unless told (:class:`Pool`'s ``connect_concurrency``).
CONNECT_CONCURRENCY = 16

#: Kept-alive connections per process for ``Upstream.answer``'s control calls; more wait for one
#: (vllm-router answers ``/finish_session`` in about a millisecond: 16 carry thousands a second).
CONTROL_CONNECTIONS = 16


def idle_lifetime() -> float:
    """Seconds an idle pooled connection to vLLM is kept: 60 % of vLLM's keep-alive
    (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default, read from the environment vLLM inherits)."""
    try:
        keep_alive = float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))
    except ValueError:
        keep_alive = 5.0
    return max(0.6 * keep_alive, 0.1)


#: Whether the connection the running request got came from the pool: set by :class:`Connector` in the
#: request's own task (aiohttp awaits the connector there), read by :meth:`Pool.send` after a failure.
_REUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("vllama_upstream_reused", default=False)


class Connector(aiohttp.TCPConnector):
    """aiohttp's connector with three additions: it notes whether it handed the request a pooled connection
    (one it handed out before), bounds the connections being opened at once, and tries a connect again on a
    new socket within a connect budget (the module's docstring says why).

    The pooled-connection note is what the retry of a request whose pooled connection closed before the
    answer began asks; instead of a ``TraceConfig``'s ``on_connection_reuseconn``: with any trace config
    aiohttp builds a ``Trace`` per request and awaits its signals at each step (request start, headers
    sent, chunk sent, request end: ~5 awaits and their parameter objects on every request).
    ``connect`` is aiohttp's documented ``BaseConnector.connect``; the connections handed out are known by
    their protocol objects, held weakly (a closed one is forgotten with it).

    aiohttp's own ``limit`` bounds the connections held, not those being opened, and counts its wait in the
    request's ``connect`` timeout; so the opening bound is a semaphore around ``connect`` when no idle pooled
    connection waits (aiohttp's ``_conns``, the idle pool), and the tries are made in ``_create_connection``
    (aiohttp's private step that opens one socket, under ``sock_connect``), which only runs inside the bound.

    Args:
        opening: connections opened at once to one server (0: no bound).
        connect_budget: seconds a connect may go without any connect to that server succeeding
            (``None``: one try, aiohttp's own ``sock_connect``).
        kwargs: ``aiohttp.TCPConnector``'s.
    """

    def __init__(self, *, opening: int = 0, connect_budget: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._handed: weakref.WeakSet[Any] = weakref.WeakSet()
        self._opening = opening
        self._openers: dict[Any, asyncio.Semaphore] = {}  # connection key (one server) -> its turns to connect
        self._budget = connect_budget
        #: connection key -> monotonic time of the last connect that succeeded, and of the last that gave up
        self._connected: dict[Any, float] = {}
        self._gave_up: dict[Any, float] = {}

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        key = req.connection_key
        if not self._opening or self._conns.get(key):
            conn = await super().connect(req, traces, timeout)
        else:
            turns = self._openers.get(key)
            if turns is None:
                turns = self._openers[key] = asyncio.Semaphore(self._opening)
            async with turns:  # aiohttp looks in the pool again first: one may have come back meanwhile
                conn = await super().connect(req, traces, timeout)
        proto = conn.protocol
        if proto in self._handed:
            _REUSED.set(True)
        elif proto is not None:
            self._handed.add(proto)
        return conn

    async def _create_connection(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:
        if self._budget is None:
            return await super()._create_connection(req, traces, timeout)
        key = req.connection_key
        began = time.monotonic()
        wait = CONNECT_TRY_S
        while True:
            try_timeout = aiohttp.ClientTimeout(total=timeout.total, connect=timeout.connect, sock_read=timeout.sock_read,
                                                sock_connect=wait, ceil_threshold=timeout.ceil_threshold)
            try:
                proto = await super()._create_connection(req, traces, try_timeout)
            except asyncio.TimeoutError:
                now = time.monotonic()
                connected = self._connected.get(key, 0.0)
                left = self._budget - (now - max(began, connected))
                if left <= 0 or self._gave_up.get(key, -1.0) > connected:
                    self._gave_up[key] = now
                    raise
                wait = min(wait * 2, max(left, CONNECT_TRY_S))
                continue
            self._connected[key] = time.monotonic()
            return proto


#: A stale pooled connection fails as the request is written: a failure later than this is
#: vLLM dying mid-request, whose work is not silently done twice.
_STALE_WITHIN_S = 1.0
#: How long a connection whose reader stopped at ``data: [DONE]`` waits for the body's end
#: before it is closed instead of pooled (see :func:`_release_at_end`).
_END_WITHIN_S = 1.0


async def _release_at_end(resp: aiohttp.ClientResponse) -> None:
    """Return ``resp``'s connection to the pool once its body has ended.

    vLLM's uvicorn writes ``data: [DONE]`` and the chunked body's last chunk separately, and
    readers stop at ``[DONE]``; aiohttp closes a connection released before its body's end,
    so about every second request at low load paid a new connection to vLLM, landing on any
    of its API servers (item 10). Anything but the end within ``_END_WITHIN_S``
    closes it, as before (vLLM then sees a disconnect).
    """
    try:
        rest = await asyncio.wait_for(resp.content.readany(), _END_WITHIN_S)
    except asyncio.CancelledError:
        resp.close()
        raise
    except Exception:  # noqa: BLE001 - timeout or a broken connection: not poolable
        resp.close()
        return
    if rest:
        resp.close()
    else:
        resp.release()


class Pool:
    """The connections of one process to its vLLM servers (and router): one pool for every target
    (``client.Upstream`` per server, sharing it), started and closed once.

    Three sessions share the settings: the requests' (kept-alive, unbounded: admission bounds the
    requests, ``api/request/admission.py``), the fresh one a request is sent again on when its pooled connection
    was closed before the answer began (:meth:`send`), and the control calls' few kept-alive connections
    (:data:`CONTROL_CONNECTIONS`).

    Args:
        connect_timeout: seconds a TCP connect may take, and go on without any connect to that server
            succeeding (the module's docstring); waiting for a turn to connect is not counted.
        read_timeout: seconds without any byte from vLLM before the request fails.
        api_key: vLLM's ``--api-key``, sent as ``Authorization: Bearer``.
        connect_concurrency: connections opened at once (``supervisor/sizing.py``: ``connect_concurrency``).
    """

    def __init__(self, *, connect_timeout: float = 10.0, read_timeout: float = 600.0, api_key: str | None = None,
                 connect_concurrency: int = CONNECT_CONCURRENCY) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.connect_concurrency = connect_concurrency
        # no connect timeout of aiohttp's: it would count the wait for a turn to connect (Connector's budget)
        self.timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=CONNECT_TRY_S, sock_read=read_timeout)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self.fresh: aiohttp.ClientSession | None = None  # one connection per request: the retry's
        self._control: aiohttp.ClientSession | None = None  # control calls' few kept-alive connections
        self._ending: set[asyncio.Task[None]] = set()  # connections waiting for their body's end

    async def start(self) -> None:
        """Open the sessions (call once, inside the running loop)."""
        common: dict[str, Any] = dict(
            timeout=self.timeout,
            headers=self.headers,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        budget = self.connect_timeout
        # limit=0: the connections held are bounded by admission (api/request/admission.py), the ones opening here
        self._session = aiohttp.ClientSession(
            connector=Connector(opening=self.connect_concurrency, connect_budget=budget, limit=0, limit_per_host=0,
                                keepalive_timeout=idle_lifetime(), enable_cleanup_closed=True),
            **common,
        )
        self.fresh = aiohttp.ClientSession(
            connector=Connector(opening=self.connect_concurrency, connect_budget=budget, limit=0, force_close=True), **common)
        self._control = aiohttp.ClientSession(
            connector=Connector(connect_budget=budget, limit=CONTROL_CONNECTIONS, keepalive_timeout=idle_lifetime()), **common)

    async def close(self) -> None:
        """Close the sessions and every pooled connection."""
        for task in list(self._ending):
            task.cancel()
        for session in (self._session, self.fresh, self._control):
            if session is not None:
                await session.close()
        self._session = self.fresh = self._control = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The requests' session."""
        assert self._session is not None, "Upstream.start() was not called"
        return self._session

    async def send(self, method: str, url: str, control: bool = False, **kwargs: Any) -> aiohttp.ClientResponse:
        """One request (``control``: on the control calls' own connections); once more on a fresh
        connection if a pooled one was closed before the answer began. aiohttp's errors pass unmapped."""
        _REUSED.set(False)  # set again by Connector when the pool hands it a connection it handed out before
        sent = time.monotonic()
        try:
            session = self._control if control else self._session
            assert session is not None, "Upstream.start() was not called"
            return await session.request(method, url, **kwargs)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if not _REUSED.get() or isinstance(e, aiohttp.ClientConnectorError) or time.monotonic() - sent > _STALE_WITHIN_S:
                raise
            log.info("upstream_retry", url=url, error=type(e).__name__, why="a pooled connection was closed before the answer began")
        assert self.fresh is not None
        return await self.fresh.request(method, url, **kwargs)

    def release_at_end(self, resp: aiohttp.ClientResponse) -> None:
        """Give ``resp``'s connection back to the pool once its body has ended (:func:`_release_at_end`),
        without waiting for it here."""
        task = asyncio.ensure_future(_release_at_end(resp))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)
