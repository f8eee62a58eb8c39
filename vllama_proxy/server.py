"""Run the proxy: bind, serve until SIGTERM/SIGINT, shut down cleanly."""

from __future__ import annotations

import asyncio
import resource
import signal

from aiohttp import web

from .app import build_app
from .logs import get_logger
from .settings import Settings

log = get_logger("vllama.server")


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


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start serving ``app`` on ``host:port``; returns the runner to clean up.

    ``handler_cancellation=True``: a client that disconnects cancels its handler, which
    closes the upstream connection, which makes vLLM abort the request.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    return runner


async def wait_for_signal() -> str:
    """Block until SIGTERM or SIGINT; returns the signal's name."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s.name))
    try:
        return await got
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def serve_upstream(settings: Settings) -> None:
    """``vllama serve --upstream URL``: proxy an already-running vLLM server until a signal."""
    assert settings.upstream is not None
    nofile = raise_nofile_limit()
    app = build_app(settings, settings.upstream)
    runner = await start_site(app, settings.host, settings.port)
    log.info("listening", host=settings.host, port=settings.port, upstream=settings.upstream, nofile=nofile)
    try:
        sig = await wait_for_signal()
        log.info("stopping", signal=sig)
    finally:
        await runner.cleanup()
    log.info("stopped")
