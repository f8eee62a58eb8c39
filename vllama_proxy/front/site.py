"""Serve one aiohttp app in this process: the event loop, the listening site, the stop signal, the open-file limit.

Both ``vllama serve`` (``server.py``, ``cli.py``) and each ``--workers`` process (``workers.py``) import
these from here, below both, so that neither imports the other back (issue 20)."""

from __future__ import annotations

import asyncio
import collections
import errno
import resource
import signal
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from vllama_proxy.logs import get_logger

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


class _CappedHandler(RequestHandler):
    """aiohttp's connection handler, counting open connections per client address: one over
    :data:`_CAP` is closed as soon as it is made (issue 27: ~20,000 idle connections from one
    client exhausted the process's open files and everyone else got read errors)."""

    __slots__ = ("_vllama_addr",)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._vllama_addr = None
        peer = transport.get_extra_info("peername")
        addr = peer[0] if isinstance(peer, tuple) and peer else None
        if addr is None or _CAP[0] <= 0:
            return
        if _OPEN[addr] >= _CAP[0]:
            if addr not in _WARNED:
                _WARNED.add(addr)
                log.warning("connections_refused", client=addr, open=_OPEN[addr], limit=_CAP[0],
                            detail="--max-connections-per-address reached: new connections are closed")
            self.force_close()
            return
        _OPEN[addr] += 1
        self._vllama_addr = addr

    def connection_lost(self, exc: BaseException | None) -> None:
        addr = getattr(self, "_vllama_addr", None)
        if addr is not None:
            self._vllama_addr = None
            _OPEN[addr] -= 1
            if _OPEN[addr] <= 0:
                del _OPEN[addr]
                _WARNED.discard(addr)
        super().connection_lost(exc)


class _CappedServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _CappedHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _CappedServer  # the same object, whose handlers count connections
        return server


#: Open connections per client address in this process, and the cap (0: none).
_OPEN: collections.Counter[str] = collections.Counter()
_WARNED: set[str] = set()
_CAP = [0]


async def start_site(app: web.Application, host: str, port: int, drain_timeout: float = 5.0, reuse_port: bool = False,
                     *, idle_timeout: float | None = None, per_address: int = 0) -> web.AppRunner:
    """Start serving ``app`` on ``host:port``; returns the runner to clean up.

    ``idle_timeout``: seconds a connection may wait for its first or next request (aiohttp's
    ``keepalive_timeout``); ``per_address``: open connections one client address may hold here
    (0: no cap).

    Raises:
        SystemExit: the address cannot be bound (in use, not this host's): one line naming
            the port and how to choose another, exit status 1.

    ``handler_cancellation=True``: a client that disconnects cancels its handler, which
    closes the upstream connection, which makes vLLM abort the request.
    ``runner.cleanup()`` stops listening, then lets in-flight requests finish for
    ``drain_timeout`` seconds before cancelling them.
    """
    _CAP[0] = per_address
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


async def wait_for_signal(hurry: asyncio.Event | None = None, reload: Callable[[], None] | None = None) -> str:
    """Block until SIGTERM, SIGINT or SIGHUP; returns the signal's name.

    With ``reload`` (an ``--api-key-file`` is configured), SIGHUP calls it instead of stopping:
    the keys file is read again, as daemons reload their configuration (issue 27).

    The handlers stay installed for the rest of the process: a repeated signal sets
    ``hurry`` (cut the drain short) and is logged, never the default action, which killed
    the main process in the middle of its stop and left vLLM's whole tree running (issue 19:
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
    return await got


def per_address_cap(given: int | None, nofile: int) -> int:
    """``--max-connections-per-address``, else a quarter of the open-file limit: one client may
    never take every file of a process (each stream holds two sockets)."""
    return given if given is not None else max(nofile // 4, 64)
