"""Extra proxy processes sharing the listening port (``--workers N``, ``SO_REUSEPORT``).

One Python process translates roughly 10-20k streamed tokens per second per core
(``benchmarks/RESULTS.md``); vLLM on one H200 streams more than that. With
``--workers N`` the kernel spreads incoming connections over N processes bound to
the same port, each with its own event loop and upstream pool. The process that
runs the supervisors is worker 0; the others read each model's
:class:`~vllama_proxy.supervisor.status.StatusBoard` from shared memory, so every
worker gates, reports readiness and answers ``/api/ps`` the same way, and counts its
requests in flight in its own slot of each board.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import wait as mp_wait
from multiprocessing.process import BaseProcess
from typing import Any

from vllama_proxy.api.admission import AdmissionBound
from vllama_proxy.logs import configure_logging, get_logger
from vllama_proxy.models.vllm_servers import BackendSpec
from vllama_proxy.models.resolved import ResolvedModels
from vllama_proxy.models.state_file import StoreChanges
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.lifeline import die_with_parent
from vllama_proxy.supervisor.sizing import Plan

log = get_logger("vllama.workers")

_CTX = multiprocessing.get_context("spawn")


def _worker_main(index: int, parent: int, settings: Settings, resolved: ResolvedModels, backends: list[BackendSpec],
                 front: Plan, bound: AdmissionBound, slots: Any = None, changes: StoreChanges | None = None) -> None:
    # A worker left behind would keep serving on the shared port (SO_REUSEPORT) with a dead
    # supervisor's view of vLLM: it stops (draining) when the main process dies, however it dies.
    die_with_parent(signal.SIGTERM, parent)
    configure_logging(settings.log_level, settings.log_format)
    from .site import run_loop

    run_loop(_serve(index, settings, resolved, backends, front, bound, slots, changes))


async def _serve(index: int, settings: Settings, resolved: ResolvedModels, backends: list[BackendSpec], front: Plan,
                 bound: AdmissionBound, slots: Any = None, changes: StoreChanges | None = None) -> None:
    from vllama_proxy.api.app import build_app
    from .site import catch_stop_signals, connection_caps, raise_nofile_limit, start_site

    nofile = raise_nofile_limit()
    app = build_app(settings, resolved, backends, worker=index, front=front, bound=bound, slots=slots, changes=changes)
    stopped = catch_stop_signals(reload=_key_reloader(app, settings))  # before it listens
    runner = await start_site(app, settings.host, settings.port, settings.drain_timeout, reuse_port=True,
                             idle_timeout=settings.idle_timeout, **connection_caps(settings.max_connections_per_address, settings.max_connections, nofile))
    log.info("worker_listening", worker=index, port=settings.port)
    try:
        await stopped
    finally:
        await runner.cleanup()  # stop accepting, drain in-flight requests


def _key_reloader(app: Any, settings: Settings) -> Any:
    """SIGHUP's action with an ``--api-key-file``: read the keys again (``api/api_keys.py``); else ``None``
    (SIGHUP stops, as before). The main process forwards SIGHUP to each worker (:meth:`WorkerPool.hup`)."""
    if settings.api_key_file is None:
        return None
    from vllama_proxy.api.app_state import KEYS

    return app[KEYS].reload


class WorkerPool:
    """Workers 1..N-1 (the calling process is worker 0); respawned if one dies.

    Args:
        settings: the settings every worker serves with.
        resolved: the library and the launched models, resolved once at start (pickled to each worker).
        backends: the vLLM servers (with their status boards in shared memory), as ``build_app`` takes them.
        front: the front end's plan (shown in ``/readyz``).
        bound: the server-wide admission count in shared memory.
        slots: the on-demand slots (shared memory), or ``None``.
        changes: the state files' change counts (shared memory), as ``build_app`` takes them.
    """

    def __init__(self, settings: Settings, resolved: ResolvedModels, backends: list[BackendSpec], front: Plan,
                 bound: AdmissionBound, slots: Any = None, changes: StoreChanges | None = None) -> None:
        self._args = (settings, resolved, backends, front, bound, slots, changes)
        self._bound = bound
        self._boards = [spec.board for spec in backends if spec.board is not None]
        self._procs: dict[int, BaseProcess] = {}
        self._stopping = False
        self._monitor: asyncio.Task[None] | None = None

    def _spawn(self, index: int) -> None:
        p = _CTX.Process(target=_worker_main, args=(index, os.getpid(), *self._args), name=f"vllama-worker-{index}", daemon=False)
        p.start()
        self._procs[index] = p
        log.info("worker_started", worker=index, pid=p.pid)

    async def start(self, count: int) -> None:
        """Start ``count`` extra workers at once and watch them.

        ``Process.start`` of the spawn context blocks until the child has imported enough to read
        its pickled arguments (about a second each): the spawns run in threads, side by side, so
        that the event loop (and the vLLM child it is launching) is not held up.
        """
        await asyncio.gather(*(asyncio.to_thread(self._spawn, i) for i in range(1, count + 1)))
        self._monitor = asyncio.create_task(self._watch())

    # Exits are read from each process's sentinel pipe, not waitpid(): the event loop's
    # child watcher (uvloop, for the vLLM subprocess) may reap our workers first, after
    # which Process.is_alive() would report a dead worker alive forever.
    def _exited(self, timeout: float = 0) -> list[int]:
        by_fd = {p.sentinel: i for i, p in self._procs.items()}
        return [by_fd[fd] for fd in mp_wait(list(by_fd), timeout)]

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(1.0)
            for i in self._exited():
                if self._stopping:
                    return
                p = self._procs[i]
                log.warning("worker_died", worker=i, pid=p.pid, exitcode=p.exitcode)
                if "PROMETHEUS_MULTIPROC_DIR" in os.environ and p.pid:
                    from prometheus_client import multiprocess

                    multiprocess.mark_process_dead(p.pid)  # its in-flight gauge no longer counts
                for board in self._boards:
                    board.reset_slot(i)  # its requests died with it: no model stays "busy" forever
                self._bound.reset_slot(i)  # and their places in the admission bound
                self._spawn(i)

    def hup(self) -> None:
        """Forward SIGHUP to every worker (each reads the keys file again)."""
        for p in self._procs.values():
            _signal(p.pid, signal.SIGHUP)

    async def stop(self, timeout: float) -> None:
        """SIGTERM every worker (each drains its requests), wait up to ``timeout``, then SIGKILL."""
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for p in self._procs.values():
            _signal(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self._procs:
            for i in self._exited(0):
                del self._procs[i]
            if not self._procs:
                break
            if time.monotonic() > deadline:
                for p in self._procs.values():
                    _signal(p.pid, signal.SIGKILL)
                await asyncio.to_thread(mp_wait, [p.sentinel for p in self._procs.values()], 5)
                break
            await asyncio.sleep(0.05)


def _signal(pid: int | None, sig: signal.Signals) -> None:
    try:
        if pid:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
