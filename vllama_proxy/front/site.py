"""Serve one aiohttp app in this process: the event loop, the listening site, the stop signal, the open-file limit.

Both ``vllama serve`` (``server.py``, ``cli.py``) and each ``--workers`` process (``workers.py``) import
these from here, below both, so that neither imports the other back."""

from __future__ import annotations

import asyncio
import collections
import errno
import ipaddress
import resource
import signal
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from vllama_proxy.logs import get_logger
from .write_stall import WriteStall

log = get_logger("vllama.server")


def run_loop(coro) -> None:
    """Run ``coro`` to completion on uvloop (asyncio's loop where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def raise_nofile_limit() -> int:
    """Raise ``RLIMIT_NOFILE``'s soft limit to the hard limit (each stream holds two sockets).

    Returns the soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("nofile_limit_not_raised", soft=soft, hard=hard, error=str(e))
    return soft


def client_of(addr: str) -> str:
    """The unit one client's connections count in: an IPv4 address as is (an IPv4-mapped IPv6
    one too), an IPv6 address by its /64 (one host holds a whole /64, and walking its
    addresses must not multiply its share)."""
    if ":" not in addr:
        return addr
    try:
        ip = ipaddress.IPv6Address(addr.partition("%")[0])
    except ValueError:
        return addr
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))


class _CappedHandler(RequestHandler):
    """aiohttp's connection handler, counting open connections per client (:func:`client_of`) and
    in all: one over :data:`_CAP` for its client, or over :data:`_TOTAL_CAP` in this process, is
    closed as soon as it is made (~20,000 idle connections from one client exhausted the
    process's open files and everyone else got read errors: an IPv6 /64, or a few IPv4
    addresses, could still do it together).

    Its writes to a client are bounded too (``--client-write-timeout``): while the transport is
    paused above its high-water mark, a :class:`~vllama_proxy.front.write_stall.WriteStall` aborts
    a connection whose client read nothing for the timeout."""

    __slots__ = ("_vllama_addr", "_vllama_finishing", "_vllama_stall")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._vllama_addr = None
        self._vllama_stall: WriteStall | None = None
        self._vllama_finishing = None
        peer = transport.get_extra_info("peername")
        addr = peer[0] if isinstance(peer, tuple) and peer else None
        if addr is None or (_CAP[0] <= 0 and _TOTAL_CAP[0] <= 0):
            return
        client = client_of(addr)
        if 0 < _TOTAL_CAP[0] <= _TOTAL[0]:
            if not _WARNED_TOTAL[0]:
                _WARNED_TOTAL[0] = True
                log.warning("connections_refused", client=client, open=_TOTAL[0], limit=_TOTAL_CAP[0],
                            detail="--max-connections reached: new connections are closed")
            self.force_close()
            return
        if 0 < _CAP[0] <= _OPEN[client]:
            if client not in _WARNED:
                _WARNED.add(client)
                log.warning("connections_refused", client=client, open=_OPEN[client], limit=_CAP[0],
                            detail="--max-connections-per-address reached: new connections are closed")
            self.force_close()
            return
        _OPEN[client] += 1
        _TOTAL[0] += 1
        self._vllama_addr = client

    def pause_writing(self) -> None:
        super().pause_writing()
        if _WRITE_TIMEOUT[0] > 0 and self.transport is not None:  # once per crossing of the high-water mark, never per write
            self._vllama_stall = WriteStall(self.transport, _WRITE_TIMEOUT[0], self._answering)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._end_stall_watch()

    def _end_stall_watch(self) -> None:
        stall = getattr(self, "_vllama_stall", None)
        if stall is not None:
            self._vllama_stall = None
            stall.close()

    def _answering(self) -> BaseRequest | None:
        """The request this connection answers now: its handler's (aiohttp's ``_current_request``, set
        while the handler runs), else the one whose response aiohttp writes after its handler returned."""
        return getattr(self, "_current_request", None) or getattr(self, "_vllama_finishing", None)

    async def finish_response(self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None) -> tuple[web.StreamResponse, bool]:
        self._vllama_finishing = request  # a non-streamed body is written here, after its handler returned
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._vllama_finishing = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._end_stall_watch()
        client = getattr(self, "_vllama_addr", None)
        if client is not None:
            self._vllama_addr = None
            _TOTAL[0] -= 1
            if _TOTAL[0] < _TOTAL_CAP[0]:
                _WARNED_TOTAL[0] = False
            _OPEN[client] -= 1
            if _OPEN[client] <= 0:
                del _OPEN[client]
                _WARNED.discard(client)
        super().connection_lost(exc)


class _CappedServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _CappedHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _CappedServer  # the same object, whose handlers count connections
        return server


#: Open connections per client (:func:`client_of`) in this process, and the cap (0: none).
_OPEN: collections.Counter[str] = collections.Counter()
_WARNED: set[str] = set()
_CAP = [0]
#: Open connections in all in this process, and the cap (0: none).
_TOTAL = [0]
_TOTAL_CAP = [0]
_WARNED_TOTAL = [False]
#: Seconds a write may wait for its client to read (--client-write-timeout; 0: no bound).
_WRITE_TIMEOUT = [0.0]


async def start_site(app: web.Application, host: str, port: int, drain_timeout: float = 5.0, reuse_port: bool = False,
                     *, idle_timeout: float | None = None, per_address: int = 0, total: int = 0,
                     write_timeout: float = 0.0) -> web.AppRunner:
    """Start serving ``app`` on ``host:port``; returns the runner to clean up.

    ``idle_timeout``: seconds a connection may wait for its first or next request (aiohttp's
    ``keepalive_timeout``); ``per_address``: open connections one client (an IPv4 address, an IPv6
    /64: :func:`client_of`) may hold here; ``total``: open connections in all here (0: no cap);
    ``write_timeout``: seconds a write may wait with no byte read by its client before the
    connection is aborted (``write_stall.py``; 0: no bound).

    Raises:
        SystemExit: the address cannot be bound (in use, not this host's): one line naming
            the port and how to choose another, exit status 1.

    ``handler_cancellation=True``: a client that disconnects cancels its handler, which
    closes the upstream connection, which makes vLLM abort the request.
    ``runner.cleanup()`` stops listening, then lets in-flight requests finish for
    ``drain_timeout`` seconds before cancelling them.
    """
    _CAP[0] = per_address
    _TOTAL_CAP[0] = total
    _WRITE_TIMEOUT[0] = write_timeout
    extra = {"keepalive_timeout": idle_timeout} if idle_timeout is not None else {}
    runner = _Runner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_timeout, **extra)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True, reuse_port=reuse_port or None)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()  # the app's upstream session too: no "Unclosed client session" at exit
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"vllama serve: port {port} on {host} is already in use (Ollama or another vllama?): "
                             "choose another with --port PORT or OLLAMA_HOST=HOST:PORT") from None
        raise SystemExit(f"vllama serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return runner


#: The signals that stop vllama: systemd's and Kubernetes' SIGTERM, Ctrl-C, a closed terminal.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def catch_stop_signals(hurry: asyncio.Event | None = None, reload: Callable[[], None] | None = None) -> asyncio.Future[str]:
    """Install the handlers of SIGTERM, SIGINT and SIGHUP now; the future resolves with the first
    stop signal's name. Called before the process listens: a signal that arrives while it starts
    (spawning workers takes seconds, more on busy cores) is then a stop like any other, not the
    default action, which ended the process at once with vLLM's tree left running, or, for SIGHUP,
    a keys reload that killed it (found by the suite under load).

    With ``reload`` (an ``--api-key-file`` is configured), SIGHUP calls it instead of stopping:
    the keys file is read again, as daemons reload their configuration.

    The handlers stay installed for the rest of the process: a repeated signal sets
    ``hurry`` (cut the drain short) and is logged, never the default action, which killed
    the main process in the middle of its stop and left vLLM's whole tree running (
    a second SIGTERM 0.5 s into the drain did it every time).
    """
    loop = asyncio.get_running_loop()
    got: asyncio.Future[str] = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if not got.done():
            got.set_result(sig.name)
            return
        log.warning("stop_signal_repeated", signal=sig.name, detail="no longer waiting for requests in flight; vLLM is still stopped cleanly")
        if hurry is not None:
            hurry.set()

    for sig in STOP_SIGNALS:
        if sig is signal.SIGHUP and reload is not None:
            loop.add_signal_handler(sig, reload)
        else:
            loop.add_signal_handler(sig, on_signal, sig)
    return got


def per_address_cap(given: int | None, nofile: int, total: int | None = None) -> int:
    """``--max-connections-per-address``, else three quarters of the process's connection cap
    (``total``, :func:`total_cap` of ``nofile`` when not given): one client may never take every
    connection of a process, and others always keep a quarter of them. A lone client (a load
    balancer, a front end, a batch job) is not refused while three quarters are free: a quarter of
    the open-file limit, the cap before, closed 80 of a 20,000-request burst from one address on a
    host whose limit was 20,000 (``docs/decisions.md``)."""
    if given is not None:
        return given
    return max((total if total is not None else total_cap(None, nofile)) * 3 // 4, 64)


def total_cap(given: int | None, nofile: int) -> int:
    """``--max-connections``, else half the open-file limit less 256 (each stream holds two
    sockets, its client's and vLLM's; the rest is for vLLM's pool, logs, model files): the
    clients together never take every file of a process."""
    return given if given is not None else max(nofile // 2 - 256, 64)


def connection_caps(settings_per_address: int | None, settings_total: int | None, nofile: int) -> dict[str, int]:
    """``per_address`` and ``total`` for :func:`start_site`, chosen from the open-file limit unless
    given, and logged once with where each came from."""
    total = total_cap(settings_total, nofile)
    caps = {"per_address": per_address_cap(settings_per_address, nofile, total), "total": total}
    log.info("connection_caps", open_files=nofile, **caps,
             per_address_from="--max-connections-per-address" if settings_per_address is not None else "3/4 of the total cap",
             total_from="--max-connections" if settings_total is not None else "open-file limit / 2 - 256")
    return caps
