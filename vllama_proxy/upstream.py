"""The one client of vLLM's OpenAI-compatible server: a shared pool, errors mapped at this boundary.

One ``aiohttp.ClientSession`` per app, with an unlimited connection pool and no
total timeout: vLLM batches continuously, so a request may legitimately queue
for minutes under load, and aiohttp's defaults (100 connections, 300 s total)
would cap concurrency and kill queued requests (``docs/wire.md``,
"The upstream"). Instead a connect timeout and an idle-read timeout apply.

Idle pooled connections retire after :func:`idle_lifetime` seconds, before vLLM's
uvicorn closes them (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s): otherwise a request can be
written into a connection the server is closing. That race remains at the edge, so a
request that fails on a reused connection before any byte of the answer arrived is sent
once more on a fresh connection (RFC 9112 section 9.3.1 allows retrying a request on a
connection closed before its answer began; aiohttp does it only for idempotent methods,
and every vLLM generation is a POST). A 4,096-request run lost 2 this way before.

A router's control calls (:meth:`Upstream.answer`: vllm-router's ``/finish_session`` after each request
under ``--request-sessions``, ``/add_worker``, ``/remove_worker``) go on a few kept-alive connections of
their own (:data:`CONTROL_CONNECTIONS`), not the requests' pool: at a wave of answers ending together each
release found no idle connection (the answers' own were still waiting for their body's end) and opened one:
a burst of connects at a router whose listen queue holds 128, and a pool a quarter larger (81 against 65
connections per 512 requests of 64 streams on the 2-core VM).

New connections open a bounded number at a time (``connect_concurrency`` per process, chosen by
``supervisor/sizing.py`` from vLLM's API servers and logged as ``front_end``): a burst's requests beyond
that wait here, in this process, for their turn to connect (or for a pooled connection another request
gave back), not as SYNs in the kernel's listen queue. A request waiting for its turn has no deadline but
its own (the client leaving cancels it). 5,000 connects at once beside a CPU hog overflowed the stand-in's
listen queue and kept the proxy's loop too busy to see its own connects complete within a try: 4,996 of
5,000 requests failed their connect budget in 22 s (``benchmarks/RESULTS.md``).

A connect not answered within :data:`CONNECT_TRY_S` is tried again on a new socket, each try allowed twice
the last one's time: a server whose listen queue is full drops the SYN, and Linux sends it again only after
1 s, then 3 s (vllm-router 0.1.17 listens with a backlog of 128; a front opening ~1,000 connections to it at
once had 430-917 of its first 1,024 requests wait 1-3 s). A slow link costs a few short tries: a
0.3 s round trip connects on the second. A connect fails when ``connect_timeout`` passed both since it began
and since this process last connected to that server: vLLM that accepts no connection at all for that long
is gone or hung, while one that accepts slowly (its listen queue full of others' connections) is still
working, and a request is never failed because others were connecting. Once one connect gave up, the next
ones to that server get one try each until a connect succeeds again (a dead server fails its queue fast).

A streamed body's idle-read timeout is :class:`BodyWatch`'s, not aiohttp's ``sock_read``: aiohttp
re-arms a timer on every read (a few µs of each streamed token's CPU); the watch looks
at the bytes received a few times per timeout instead.

Every aiohttp exception is turned into the ``errors.UpstreamError`` tree here,
so handlers never see aiohttp's exception types.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import aiohttp
import orjson

from . import error_message, error_text
from .logs import get_logger
from .errors import (
    BadRequest,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)

_JSON = {"Content-Type": "application/json"}
log = get_logger("vllama.upstream")


def idle_lifetime() -> float:
    """Seconds an idle pooled connection to vLLM is kept: 60 % of vLLM's keep-alive
    (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default, read from the environment vLLM inherits)."""
    try:
        keep_alive = float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))
    except ValueError:
        keep_alive = 5.0
    return max(0.6 * keep_alive, 0.1)


#: Whether the connection the running request got came from the pool: set by :class:`_Connector` in the
#: request's own task (aiohttp awaits the connector there), read by ``Upstream._send`` after a failure.
_REUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("vllama_upstream_reused", default=False)


class _Connector(aiohttp.TCPConnector):
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


def encode_json(obj: Any) -> bytes:
    """``orjson.dumps`` for bodies built from client input.

    orjson reads JSON nested up to 1024 levels but writes at most 254, so a body that
    parsed can still fail here; that is the client's nesting, answered as a 400.

    Raises:
        BadRequest: the structure is nested too deeply (or not serialisable) to forward.
    """
    try:
        return orjson.dumps(obj)
    except TypeError as e:
        raise BadRequest(f"request is nested too deeply to forward: {e}") from None
_DONE = b"[DONE]"

#: Seconds the first try of a TCP connect is given (then 2x, 4x ...: the module's docstring).
CONNECT_TRY_S = 0.2

#: Connections a client opens at once unless told (:class:`Upstream`'s ``connect_concurrency``).
CONNECT_CONCURRENCY = 16

#: Kept-alive connections per process for :meth:`Upstream.answer`'s control calls; more wait for one
#: (vllm-router answers ``/finish_session`` in about a millisecond: 16 carry thousands a second).
CONTROL_CONNECTIONS = 16


class Upstream:
    """Client of one vLLM server at ``base_url`` (``http://127.0.0.1:8000``, no ``/v1``).

    Args:
        base_url: where vLLM listens.
        connect_timeout: seconds a TCP connect may take, and go on without any connect to that server
            succeeding (the module's docstring); waiting for a turn to connect is not counted.
        read_timeout: seconds without any byte from vLLM before the request fails.
        api_key: vLLM's ``--api-key``, sent as ``Authorization: Bearer``.
        connect_concurrency: connections opened at once (``supervisor/sizing.py``: ``connect_concurrency``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        api_key: str | None = None,
        connect_concurrency: int = CONNECT_CONCURRENCY,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.connect_timeout = connect_timeout
        self.connect_concurrency = connect_concurrency
        # no connect timeout of aiohttp's: it would count the wait for a turn to connect (_Connector's budget)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=CONNECT_TRY_S, sock_read=read_timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # one connection per request: the retry's
        self._control: aiohttp.ClientSession | None = None  # answer()'s few kept-alive connections
        self._pool: Upstream | None = None  # set by at(): whose session this client uses
        self._ending: set[asyncio.Task[None]] = set()  # connections waiting for their body's end

    def at(self, base_url: str) -> Upstream:
        """A client of another server (another model's vLLM) that uses this one's session and
        connection pool: one pool per process, however many models (started and closed with this one)."""
        other = Upstream.__new__(Upstream)
        other.base_url = base_url.rstrip("/")
        other._timeout = self._timeout
        other.connect_timeout = self.connect_timeout
        other.connect_concurrency = self.connect_concurrency
        other._headers = self._headers
        other._session = None
        other._fresh = None
        other._control = None
        other._pool = self
        other._ending = self._ending
        return other

    async def start(self) -> None:
        """Open the shared session (call once, inside the running loop)."""
        common: dict[str, Any] = dict(
            timeout=self._timeout,
            headers=self._headers,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        budget = self.connect_timeout
        # limit=0: the connections held are bounded by admission (api/request/admission.py), the ones opening here
        self._session = aiohttp.ClientSession(
            connector=_Connector(opening=self.connect_concurrency, connect_budget=budget, limit=0, limit_per_host=0,
                                 keepalive_timeout=idle_lifetime(), enable_cleanup_closed=True),
            **common,
        )
        self._fresh = aiohttp.ClientSession(
            connector=_Connector(opening=self.connect_concurrency, connect_budget=budget, limit=0, force_close=True), **common)
        self._control = aiohttp.ClientSession(
            connector=_Connector(connect_budget=budget, limit=CONTROL_CONNECTIONS, keepalive_timeout=idle_lifetime()), **common)

    async def close(self) -> None:
        """Close the sessions and every pooled connection."""
        for task in list(self._ending):
            task.cancel()
        for session in (self._session, self._fresh, self._control):
            if session is not None:
                await session.close()
        self._session = self._fresh = self._control = None

    @property
    def session(self) -> aiohttp.ClientSession:
        session = self._pool._session if self._pool is not None else self._session
        assert session is not None, "Upstream.start() was not called"
        return session

    @property
    def _control_session(self) -> aiohttp.ClientSession:
        session = self._pool._control if self._pool is not None else self._control
        assert session is not None, "Upstream.start() was not called"
        return session

    async def _send(self, method: str, url: str, control: bool = False, **kwargs: Any) -> aiohttp.ClientResponse:
        """One request (``control``: on :meth:`answer`'s own connections); once more on a fresh connection if
        a pooled one was closed before the answer began."""
        _REUSED.set(False)  # set again by _Connector when the pool hands it a connection it handed out before
        sent = time.monotonic()
        try:
            session = self._control_session if control else self.session
            return await session.request(method, url, **kwargs)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if not _REUSED.get() or isinstance(e, aiohttp.ClientConnectorError) or time.monotonic() - sent > _STALE_WITHIN_S:
                raise
            log.info("upstream_retry", url=url, error=type(e).__name__, why="a pooled connection was closed before the answer began")
        owner = self._pool or self
        assert owner._fresh is not None
        return await owner._fresh.request(method, url, **kwargs)

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        check: bool = True,
        control: bool = False,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send one request and yield the open response (its body not read yet).

        Leaving the block early (client disconnect cancels the handler) closes the
        connection instead of returning it to the pool, which makes vLLM abort the request.
        Leaving it normally before the body's end (a reader that stopped at ``[DONE]``) pools
        the connection once the end arrives, without waiting for it here. ``control``: on the few
        connections of :meth:`answer` (:data:`CONTROL_CONNECTIONS`), waiting for one while all are busy.

        Raises:
            UpstreamRejected: ``check`` and vLLM answered 4xx/5xx (its message and status).
            UpstreamUnavailable: connection refused, reset or closed.
            UpstreamTimeout: connect or idle-read timeout.
        """
        with mapped_errors(self.base_url):
            resp = await self._send(method, self.base_url + path, control, data=body, headers=headers or _JSON, params=params)
            if check and resp.status >= 400:
                try:
                    raise UpstreamRejected(error_message(await resp.read(), f"vLLM answered HTTP {resp.status}"), resp.status)
                finally:
                    resp.release()
        # Errors raised by the caller's block (e.g. writing to a client that left) are
        # not upstream errors: they pass through unmapped.
        try:
            yield resp
        except BaseException:
            resp.close()  # drop the connection so vLLM sees the disconnect and aborts
            raise
        else:
            if resp.content.is_eof():
                resp.release()
            else:
                task = asyncio.ensure_future(_release_at_end(resp))
                self._ending.add(task)
                task.add_done_callback(self._ending.discard)

    def watch_body(self, resp: aiohttp.ClientResponse) -> BodyWatch:
        """The idle-read timeout of ``resp``'s streamed body, kept by a :class:`BodyWatch`: use it
        as ``with upstream.watch_body(resp):`` around the loop that reads the body."""
        return BodyWatch(resp, self._timeout.sock_read)

    async def get_json(self, path: str) -> Any:
        """``GET path`` and decode the JSON answer (errors as :meth:`request`)."""
        async with self.request("GET", path) as resp:
            return await read_json(resp)

    async def answer(self, method: str, path: str, params: Mapping[str, str]) -> tuple[int, str]:
        """``(status, the answer's text)`` of ``method path?params``, whatever the status (a router's
        ``/add_worker``, ``/remove_worker``, ``/finish_session``: the caller reads its refusal), on this
        process's :data:`CONTROL_CONNECTIONS` kept-alive connections of their own, so that a burst of them
        neither opens a connection each nor takes the requests'.

        Raises:
            UpstreamUnavailable, UpstreamTimeout: as :meth:`request`.
        """
        async with self.request(method, path, params=params, check=False, control=True) as resp:
            return resp.status, (await read_response(resp)).decode("utf-8", "replace")

    async def post_json(self, path: str, payload: Any) -> Any:
        """``POST path`` with a JSON body and decode the JSON answer (errors as :meth:`request`)."""
        async with self.request("POST", path, body=orjson.dumps(payload)) as resp:
            return await read_json(resp)


class BodyWatch:
    """A streamed body's idle-read timeout without a timer per read.

    aiohttp's ``sock_read`` timeout cancels and re-arms a loop timer on every read from the
    socket (``ResponseHandler._reschedule_timeout``): ~2.5 µs of CPU per streamed token on
    uvloop, each token being one read. While the watch is on, the connection's
    ``read_timeout`` is off (the public setter aiohttp itself uses for websockets) and one timer
    per stream fires every quarter of ``timeout``, comparing the body's ``total_bytes`` with the
    last look: four looks in a row with no new byte fail the body with aiohttp's own
    ``ServerTimeoutError`` (``StreamReader.set_exception``), which the readers map to
    ``UpstreamTimeout`` as before. So a body fails between ``timeout`` and 1.25 x ``timeout``
    after its last byte (aiohttp's: at ``timeout``). Waiting for the response headers is still
    ``sock_read``'s (the watch starts once they came); the connection's next request sets its
    ``read_timeout`` again (aiohttp's ``set_response_params``). One difference: a client that stops
    reading stops the relay reading vLLM, and once no byte came for the timeout the body's next read
    fails too (aiohttp held its timer while its own buffer was full).

    Args:
        resp: the open response, its headers read.
        timeout: seconds without a byte before the body fails; ``None`` or 0 watches nothing.
    """

    __slots__ = ("_content", "_handle", "_looks", "_period", "_seen")

    #: looks per timeout: the timeout's precision (it fires within 1 + 1/_LOOKS of it)
    _LOOKS = 4

    def __init__(self, resp: aiohttp.ClientResponse, timeout: float | None) -> None:
        self._content = resp.content
        self._handle: asyncio.TimerHandle | None = None
        self._looks = 0
        self._seen = 0
        self._period = 0.0
        conn = resp.connection
        if timeout and conn is not None and conn.protocol is not None:
            # The timer aiohttp armed at the last read still runs: it fires at that read + timeout
            # if nothing else comes, and the next read cancels it without arming another.
            conn.protocol.read_timeout = None
            self._period = timeout / self._LOOKS
            self._seen = self._content.total_bytes
            self._handle = asyncio.get_running_loop().call_later(self._period, self._look)

    def _look(self) -> None:
        total = self._content.total_bytes
        if total != self._seen:
            self._seen, self._looks = total, 0
        else:
            self._looks += 1
            if self._looks >= self._LOOKS:
                self._handle = None
                self._content.set_exception(aiohttp.ServerTimeoutError("Timeout on reading data from socket"))
                return
        self._handle = asyncio.get_running_loop().call_later(self._period, self._look)

    def close(self) -> None:
        """Stop watching (the body ended, or its reader left)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def __enter__(self) -> BodyWatch:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@contextmanager
def mapped_errors(where: str) -> Iterator[None]:
    """Re-raise aiohttp/asyncio client errors inside the block as the upstream error tree.

    Upstream errors pass unchanged; anything that is not about the upstream
    (cancellation, a generator being closed) is re-raised as it is.
    """
    try:
        yield
    except UpstreamError:
        raise
    except BaseException as e:  # noqa: BLE001 - mapped or re-raised
        mapped = map_client_error(e, where)
        if mapped is None:
            raise
        raise mapped from e


def map_client_error(e: BaseException, where: str) -> UpstreamError | None:
    """Translate an aiohttp/asyncio client exception into the upstream error tree.

    Returns ``None`` for exceptions that are not about the upstream (e.g. cancellation),
    which the caller re-raises unchanged.
    """
    if isinstance(e, (aiohttp.ServerTimeoutError, asyncio.TimeoutError, TimeoutError)):
        return UpstreamTimeout(f"vLLM at {where} did not answer in time")
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamUnavailable(f"vLLM is not reachable at {where}: {e.os_error.strerror or e}")
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError, ConnectionError)):
        return UpstreamUnavailable(f"vLLM closed the connection before the answer was complete ({type(e).__name__})")
    if isinstance(e, aiohttp.ClientResponseError):
        return UpstreamProtocolError(f"vLLM sent an invalid HTTP answer: {e.message}")
    if isinstance(e, aiohttp.ClientError):
        return UpstreamUnavailable(f"vLLM request failed: {e}")
    return None


async def read_response(resp: aiohttp.ClientResponse) -> bytes:
    """Read a whole body, with client errors mapped (a reset mid-body is ``UpstreamUnavailable``)."""
    with mapped_errors(str(resp.url.origin())):
        return await resp.read()


async def read_json(resp: aiohttp.ClientResponse) -> Any:
    """Read and decode a whole JSON body.

    Raises:
        UpstreamProtocolError: the body is not JSON.
    """
    raw = await read_response(resp)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamProtocolError(f"vLLM sent a body that is not JSON: {raw[:200]!r}") from None


class SSEDecoder:
    """Incremental decoder of vLLM's server-sent events: bytes in, chunk dicts out.

    vLLM frames every event as one ``data: <json>`` line plus a blank line and ends with
    ``data: [DONE]``; an error raised after streaming began arrives as a
    ``data: {"error": {...}}`` event. :meth:`feed` returns the chunks of every complete
    event in ``data`` (an event cut between reads is kept for the next call). Afterwards
    :attr:`done` tells that ``[DONE]`` came, and :attr:`failure` holds the error to raise
    once the chunks before it were used (``UpstreamRejected`` for an error event,
    ``UpstreamProtocolError`` for a ``data:`` line that is not a JSON object).

    Synchronous and allocation-light on purpose: it runs once per token on the hot path.
    """

    __slots__ = ("_tail", "done", "failure")

    def __init__(self) -> None:
        self._tail = b""
        self.done = False
        self.failure: UpstreamError | None = None

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        if self._tail:
            data = self._tail + data
        lines = data.split(b"\n")
        self._tail = lines.pop()  # b"" when data ended on a line break
        batch = []
        for line in lines:
            if line[:5] != b"data:":
                continue  # blank separators, comments, event:/id: lines
            payload = line[5:].strip()
            if payload == _DONE:
                self.done = True
                break
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                self.failure = UpstreamProtocolError(f"vLLM sent an event that is not JSON: {payload[:200]!r}")
                break
            if type(chunk) is not dict:
                self.failure = UpstreamProtocolError(f"vLLM sent an event that is not a JSON object: {payload[:200]!r}")
                break
            if "error" in chunk:
                err = chunk["error"]
                code = err.get("code") if isinstance(err, dict) else None
                self.failure = UpstreamRejected(error_text(chunk) or "vLLM reported an error",
                                                code if isinstance(code, int) and code >= 400 else 500)
                break
            batch.append(chunk)
        return batch


async def read_some(resp: aiohttp.ClientResponse) -> bytes:
    """The next bytes of a streamed body, with client errors mapped (see :func:`mapped_errors`).

    Raises:
        UpstreamUnavailable: the stream ended (or broke) here.
        UpstreamTimeout: no byte within the idle-read timeout.
    """
    try:
        data = await resp.content.readany()
    except Exception as e:  # noqa: BLE001 - mapped or re-raised
        mapped = map_client_error(e, str(resp.url.origin()))
        if mapped is None:
            raise
        raise mapped from e
    if not data:
        raise UpstreamUnavailable("vLLM closed the stream before it finished")
    return data


async def read_raw(resp: aiohttp.ClientResponse) -> bytes:
    """The next bytes of a body as they arrive, ``b""`` at its end, with client errors mapped
    (see :func:`mapped_errors`): a plain coroutine per read, where an async generator over
    aiohttp's ``iter_any`` was two more frames resumed per streamed token.

    Raises:
        UpstreamUnavailable: the body broke (reset, cut chunked encoding).
        UpstreamTimeout: no byte within the idle-read timeout.
    """
    try:
        return await resp.content.readany()
    except Exception as e:  # noqa: BLE001 - mapped or re-raised
        mapped = map_client_error(e, str(resp.url.origin()))
        if mapped is None:
            raise
        raise mapped from e


async def iter_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[list[dict[str, Any]]]:
    """Decode vLLM's server-sent events (:class:`SSEDecoder`) into batches of chunk dicts, up to ``[DONE]``.

    Each batch holds every complete event that had arrived when the proxy read: one
    at light load, several when the proxy falls behind. Reading and, downstream,
    writing a whole batch at once keeps the per-token cost from growing with load.
    What came before a failure is yielded before the failure is raised.

    Raises:
        UpstreamRejected: vLLM streamed an error event (its message and code).
        UpstreamProtocolError: a ``data:`` line is not JSON.
        UpstreamUnavailable: the stream ended or broke before ``[DONE]``.
        UpstreamTimeout: no byte within the idle-read timeout.
    """
    decoder = SSEDecoder()
    while not decoder.done:
        batch = decoder.feed(await read_some(resp))
        if batch:
            yield batch
        if decoder.failure is not None:
            raise decoder.failure
