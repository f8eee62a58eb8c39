"""Run the proxy: bind, serve until SIGTERM/SIGINT, shut down cleanly."""

from __future__ import annotations

import asyncio
import resource
import signal
import socket
import sys
import time

from aiohttp import web

from .app import build_app
from .catalog import ServedModel
from .logs import get_logger
from .sdnotify import Notifier, attach, run_watchdog
from .settings import Settings
from .supervisor import gpu
from .supervisor.core import Supervisor
from .supervisor.status import StatusBoard
from .workers import WorkerPool

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


async def start_site(app: web.Application, host: str, port: int, drain_timeout: float = 5.0, reuse_port: bool = False) -> web.AppRunner:
    """Start serving ``app`` on ``host:port``; returns the runner to clean up.

    ``handler_cancellation=True``: a client that disconnects cancels its handler, which
    closes the upstream connection, which makes vLLM abort the request.
    ``runner.cleanup()`` stops listening, then lets in-flight requests finish for
    ``drain_timeout`` seconds before cancelling them.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True, reuse_port=reuse_port or None)
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
    notifier = Notifier()
    nofile = raise_nofile_limit()
    app = build_app(settings, settings.upstream)
    runner = await start_site(app, settings.host, settings.port, settings.drain_timeout, reuse_port=settings.workers > 1)
    workers = WorkerPool(settings, settings.upstream, None, None)
    await workers.start(settings.workers - 1)
    log.info("listening", host=settings.host, port=settings.port, upstream=settings.upstream, nofile=nofile, workers=settings.workers)
    notifier.status(f"ready: proxying {settings.upstream}")
    notifier.ready()
    watchdog = asyncio.create_task(run_watchdog(None, notifier), name="sd-watchdog")
    try:
        sig = await wait_for_signal()
        notifier.stopping(f"stopping: {sig}, draining requests for up to {settings.drain_timeout:g} s")
        log.info("stopping", signal=sig)
    finally:
        await asyncio.gather(runner.cleanup(), workers.stop(settings.drain_timeout + 5))
        watchdog.cancel()
        notifier.close()
    log.info("stopped")


def gpu_memory_utilization(vllm_args: list[str]) -> float:
    """vLLM's ``--gpu-memory-utilization`` from its arguments (its default: 0.9)."""
    for i, a in enumerate(vllm_args):
        if a == "--gpu-memory-utilization" and i + 1 < len(vllm_args):
            return float(vllm_args[i + 1])
        if a.startswith("--gpu-memory-utilization="):
            return float(a.split("=", 1)[1])
    return 0.9


def max_model_len(vllm_args: list[str]) -> int | None:
    """``--max-model-len`` from vLLM's arguments, if given (a plain integer)."""
    for i, a in enumerate(vllm_args):
        value = vllm_args[i + 1] if a == "--max-model-len" and i + 1 < len(vllm_args) else a.split("=", 1)[1] if a.startswith("--max-model-len=") else None
        if value is not None and value.isdigit():
            return int(value)
    return None


def served_name_for(model: str) -> str:
    """Default served name: a hub id as it is (``Qwen/Qwen2.5-1.5B-Instruct``), a local
    directory by its last component (``/models/qwen`` -> ``qwen``), so Ollama names stay clean."""
    from pathlib import Path

    p = Path(model).expanduser()
    return p.name if p.is_dir() else model


def free_loopback_port() -> int:
    """A free TCP port on 127.0.0.1 for vLLM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve_supervised(settings: Settings) -> None:
    """``vllama serve --model M``: launch and keep ``vllm serve M`` healthy, serve the Ollama API.

    The proxy listens at once (503 "loading" until vLLM is ready). On SIGTERM/SIGINT:
    stop accepting, let in-flight requests finish for ``drain_timeout``, stop vLLM's
    whole process group, return (exit 0). Exits 1 with one line when there is no GPU.
    """
    assert settings.model is not None
    if settings.gpu_check:
        try:
            for warning in await asyncio.to_thread(gpu.preflight, gpu_memory_utilization(settings.vllm_args)):
                log.warning("gpu_memory_in_use", detail=warning)
        except gpu.GpuUnavailable as e:
            print(f"vllama: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    nofile = raise_nofile_limit()
    served = settings.served_model_name or served_name_for(settings.model)
    port = settings.vllm_port or free_loopback_port()
    upstream_url = f"http://127.0.0.1:{port}"
    vllm_args = {served: settings.vllm_args}
    board = StatusBoard(served)
    supervisor = Supervisor(settings, port=port, board=board)
    notifier = Notifier()  # reads NOTIFY_SOCKET/WATCHDOG_*, then unsets them: vLLM and workers must not inherit them
    attach(supervisor, notifier)  # STATUS= on transitions, READY=1 on the first ready, STOPPING=1
    known = ServedModel(name=served, root=settings.model, max_model_len=max_model_len(settings.vllm_args), created=int(time.time()), vllm_args=tuple(settings.vllm_args))
    app = build_app(settings, upstream_url, vllm_args=vllm_args, status=board, known=[known])
    runner = await start_site(app, settings.host, settings.port, settings.drain_timeout, reuse_port=settings.workers > 1)
    workers = WorkerPool(settings, upstream_url, vllm_args, board, [known])
    await workers.start(settings.workers - 1)
    log.info("listening", host=settings.host, port=settings.port, model=settings.model, vllm_port=port, nofile=nofile, workers=settings.workers)
    await supervisor.start()
    watchdog = asyncio.create_task(run_watchdog(supervisor, notifier), name="sd-watchdog")
    try:
        sig = await wait_for_signal()
        notifier.stopping(f"stopping: {sig}, draining requests for up to {settings.drain_timeout:g} s")
        log.info("stopping", signal=sig, drain_timeout_s=settings.drain_timeout)
    finally:
        # stop accepting and drain in-flight requests in every worker, then stop vLLM's group
        await asyncio.gather(runner.cleanup(), workers.stop(settings.drain_timeout + 5))
        await supervisor.stop()
        watchdog.cancel()
        notifier.close()
    log.info("stopped")
