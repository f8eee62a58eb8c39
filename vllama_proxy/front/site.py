"""Serve one aiohttp app in this process: the event loop, the listening site, the stop signal, the open-file limit.

Both ``vllama serve`` (``server.py``, ``cli.py``) and each ``--workers`` process (``workers.py``) import
these from here, below both, so that neither imports the other back (issue 20)."""

from __future__ import annotations

import asyncio
import errno
import resource
import signal
from collections.abc import Callable

from aiohttp import web

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


async def start_site(app: web.Application, host: str, port: int, drain_timeout: float = 5.0, reuse_port: bool = False) -> web.AppRunner:
    """Start serving ``app`` on ``host:port``; returns the runner to clean up.

    Raises:
        SystemExit: the address cannot be bound (in use, not this host's): one line naming
            the port and how to choose another, exit status 1.

    ``handler_cancellation=True``: a client that disconnects cancels its handler, which
    closes the upstream connection, which makes vLLM abort the request.
    ``runner.cleanup()`` stops listening, then lets in-flight requests finish for
    ``drain_timeout`` seconds before cancelling them.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_timeout)
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
