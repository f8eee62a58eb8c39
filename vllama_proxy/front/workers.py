"""Extra proxy processes sharing the listening port (``--workers N``, ``SO_REUSEPORT``).

One Python process translates fewer streamed tokens per second than one GPU's vLLM
streams (``docs/decisions.md``). With
``--workers N`` the kernel spreads incoming connections over N processes bound to
the same port, each with its own event loop and upstream pool. The process that
runs the supervisors is worker 0; the others read each model's
:class:`~vllama_proxy.supervisor.status.StatusBoard` from shared memory, so every
worker gates, reports readiness and answers ``/api/ps`` the same way, and counts its
requests in flight in its own slot of each board.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing import popen_spawn_posix, reduction, spawn, util
from multiprocessing.process import BaseProcess
from typing import Any

from vllama_proxy.api.request.admission import AdmissionBound
from vllama_proxy.logs import configure_logging, get_logger
from vllama_proxy.models.boards import SlotBoard
from vllama_proxy.models.resolved import ResolvedModels
from vllama_proxy.models.state_file import StoreChanges
from vllama_proxy.models.vllm_servers import BackendSpec
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.lifeline import die_with_parent
from vllama_proxy.supervisor.sizing import Plan

log = get_logger("vllama.workers")

_CTX = multiprocessing.get_context("spawn")


class _Popen(popen_spawn_posix.Popen):
    """The spawn start method's ``Popen`` (CPython 3.11-3.13 ``multiprocessing/popen_spawn_posix.py``,
    ``_launch``), but the parent closes its copy of the child's end of the pipe *before* writing the
    child's pickled arguments, not after: a child that dies before reading them all (its imports
    failed, it was killed) then ends the write with ``BrokenPipeError`` at once. In CPython's order the
    parent itself held the read end open, so its write of more than a pipe's 64 KiB blocked forever
    (``Process.start`` never returned: vllama neither started nor stopped on SIGTERM).

    Raises:
        WorkerSpawnFailed: the child ended before it had read its arguments (its pid, exit status).
    """

    def _launch(self, process_obj: BaseProcess) -> None:
        from multiprocessing import resource_tracker

        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        fp = io.BytesIO()
        popen_spawn_posix.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            reduction.dump(process_obj, fp)
        finally:
            popen_spawn_posix.set_spawning_popen(None)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)
            self.sentinel = parent_r
        except BaseException:
            for fd in (parent_r, parent_w):
                os.close(fd)
            raise
        finally:
            os.close(child_r)  # the child has its own copies now: its end alone keeps the pipe open
            os.close(child_w)
        self.finalizer = util.Finalize(self, util.close_fds, [parent_r, parent_w])
        try:
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        except BrokenPipeError:
            try:
                _, status = os.waitpid(self.pid, 0)  # its end is closed: it has exited
                self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # reaped by the event loop's child watcher first: status unknown
                pass
            raise WorkerSpawnFailed(process_obj.name, self.pid, self.returncode) from None


class _SpawnProcess(_CTX.Process):  # type: ignore[name-defined,misc]
    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _Popen:
        return _Popen(process_obj)


class WorkerSpawnFailed(RuntimeError):
    """A worker process ended while it was being spawned, before it had read its arguments: its
    imports failed (its traceback is in the log above) or it was killed.

    Attributes:
        name: the process's name (``vllama-worker-N``).
        pid: its pid.
        exitcode: its exit status, minus the signal that ended it, or ``None`` (not known).
    """

    def __init__(self, name: str, pid: int, exitcode: int | None) -> None:
        self.name, self.pid, self.exitcode = name, pid, exitcode
        how = ("exit status unknown" if exitcode is None else f"killed by signal {-exitcode}" if exitcode < 0
               else f"exit status {exitcode}: its traceback is above")
        super().__init__(f"{name} (pid {pid}) died while it started, before it read its arguments ({how})")


def _worker_main(index: int, parent: int, settings: Settings, resolved: ResolvedModels, backends: list[BackendSpec],
                 front: Plan, bound: AdmissionBound, slots: SlotBoard | None = None, changes: StoreChanges | None = None) -> None:
    # A worker left behind would keep serving on the shared port (SO_REUSEPORT) with a dead
    # supervisor's view of vLLM: it stops (draining) when the main process dies, however it dies.
    die_with_parent(signal.SIGTERM, parent)
    configure_logging(settings.log_level, settings.log_format)
    from .site import run_loop

    run_loop(_serve(index, settings, resolved, backends, front, bound, slots, changes))


async def _serve(index: int, settings: Settings, resolved: ResolvedModels, backends: list[BackendSpec], front: Plan,
                 bound: AdmissionBound, slots: SlotBoard | None = None, changes: StoreChanges | None = None) -> None:
    from vllama_proxy.api.app import build_app

    from .site import (
        catch_stop_signals,
        connection_caps,
        raise_nofile_limit,
        start_site,
    )

    nofile = raise_nofile_limit()
    app = build_app(settings, resolved, backends, worker=index, front=front, bound=bound, slots=slots, changes=changes)
    stopped = catch_stop_signals(reload=_key_reloader(app, settings))  # before it listens
    runner = await start_site(app, settings.host, settings.port, settings.drain_timeout, reuse_port=True,
                             idle_timeout=settings.idle_timeout, write_timeout=settings.client_write_timeout,
                             **connection_caps(settings.max_connections_per_address, settings.max_connections, nofile))
    log.info("worker_listening", worker=index, port=settings.port)
    try:
        await stopped
    finally:
        await runner.cleanup()  # stop accepting, drain in-flight requests


def _key_reloader(app: Any, settings: Settings) -> Any:
    """SIGHUP's action with an ``--api-key-file``: read the keys again (``api/policy/keys.py``); else ``None``
    (SIGHUP stops, as before). The main process forwards SIGHUP to each worker (:meth:`WorkerPool.hup`)."""
    if settings.api_key_file is None:
        return None
    from vllama_proxy.api.app_state import KEYS

    return app[KEYS].reload


class WorkerPool:
    """Workers 1..N-1 (the calling process is worker 0); respawned if one dies.

    A worker's exit is told, not looked for: each process's sentinel (a pipe its end closes) is
    watched by the event loop (``loop.add_reader``), so a death is handled as it happens and a stop
    returns when the last one has gone, with no timer between (docs/architecture.md, "the house").
    Exits are read from the sentinels, not waitpid(): the event loop's child watcher (uvloop, for
    the vLLM subprocess) may reap our workers first, after which ``Process.is_alive()`` would
    report a dead worker alive forever.

    Args:
        settings: the settings every worker serves with.
        resolved: the library and the launched models, resolved once at start (pickled to each worker).
        backends: the vLLM servers (with their status boards in shared memory), as ``build_app`` takes them.
        front: the front end's plan (shown in ``/readyz``).
        bound: the server-wide admission count in shared memory.
        slots: the on-demand slots (shared memory), or ``None``.
        changes: the state files' change counts (shared memory), as ``build_app`` takes them.
        target: what each worker process runs (``_worker_main``; a test gives a lighter one).
    """

    def __init__(self, settings: Settings, resolved: ResolvedModels, backends: list[BackendSpec], front: Plan,
                 bound: AdmissionBound, slots: SlotBoard | None = None, changes: StoreChanges | None = None,
                 target: Callable[..., None] = _worker_main) -> None:
        self._args = (settings, resolved, backends, front, bound, slots, changes)
        self._target = target
        self._bound = bound
        self._boards = [spec.board for spec in backends if spec.board is not None]
        self._procs: dict[int, BaseProcess] = {}
        self._respawning: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._all_gone = asyncio.Event()
        self._stop_asked = asyncio.Event()  # ends a respawn's wait before its next try

    def _spawn(self, index: int) -> BaseProcess:
        p = _SpawnProcess(target=self._target, args=(index, os.getpid(), *self._args), name=f"vllama-worker-{index}", daemon=False)
        p.start()
        log.info("worker_started", worker=index, pid=p.pid)
        return p

    def _watch(self, index: int, p: BaseProcess) -> None:
        """Keep ``p`` as worker ``index`` and be told when it exits (event loop thread only)."""
        assert self._loop is not None
        self._procs[index] = p
        self._loop.add_reader(p.sentinel, self._exited, index, p)

    async def start(self, count: int) -> None:
        """Start ``count`` extra workers at once and watch them.

        ``Process.start`` of the spawn context blocks until the child has imported enough to read
        its pickled arguments (about a second each): the spawns run in threads, side by side, so
        that the event loop (and the vLLM child it is launching) is not held up.

        Raises:
            WorkerSpawnFailed: a worker died while it was spawned (logged ``worker_failed_to_start``);
                those that started are watched, and stopped by :meth:`stop`. Serving without it
                would hide a broken installation, so the caller stops (``front/server.py``).
        """
        self._loop = asyncio.get_running_loop()
        spawned = await asyncio.gather(*(asyncio.to_thread(self._spawn, i) for i in range(1, count + 1)),
                                       return_exceptions=True)
        procs = [(i, p) for i, p in enumerate(spawned, start=1) if isinstance(p, BaseProcess)]
        failed = [e for e in spawned if isinstance(e, BaseException)]
        for e in failed:
            if isinstance(e, WorkerSpawnFailed):
                log.error("worker_failed_to_start", worker=e.name, pid=e.pid, exitcode=e.exitcode, error=str(e))
        for i, p in procs:
            self._watch(i, p)
            if self._stopping:  # a stop came while they started
                _signal(p.pid, signal.SIGTERM)
        if failed:
            raise failed[0]

    def _exited(self, index: int, p: BaseProcess) -> None:
        """Worker ``index``'s sentinel became readable: it has ended. While serving: its places in the
        boards and the admission bound are given back and a new worker takes its index."""
        assert self._loop is not None
        self._loop.remove_reader(p.sentinel)
        p.join(1)  # its end closed the pipe: reaped at once (or already, by the loop's child watcher)
        if self._procs.get(index) is not p:
            return
        del self._procs[index]
        if self._stopping:
            self._note_gone()
            return
        log.warning("worker_died", worker=index, pid=p.pid, exitcode=p.exitcode)
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ and p.pid:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(p.pid)  # its in-flight gauge no longer counts
        for board in self._boards:
            board.reset_worker(index)  # its requests died with it: no model stays "busy" forever
        self._bound.reset_worker(index)  # and their places in the admission bound
        task = self._loop.create_task(self._respawn(index), name=f"respawn-worker-{index}")
        self._respawning.add(task)
        task.add_done_callback(self._respawning.discard)
        task.add_done_callback(lambda _t: self._note_gone())

    async def _respawn(self, index: int) -> None:
        # in a thread, as at start: the spawn's second must not hold this process's own requests.
        # One that dies while spawned (killed, or its imports now fail: an upgrade under a running
        # server) is tried again, 1 s later doubling to 60 s, as a worker that dies later is replaced.
        delay = 1.0
        while True:
            try:
                p = await asyncio.to_thread(self._spawn, index)
                break
            except WorkerSpawnFailed as e:
                log.error("worker_failed_to_start", worker=e.name, pid=e.pid, exitcode=e.exitcode, error=str(e),
                          retry_in_s=delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop_asked.wait(), delay)
                if self._stopping:
                    return
                delay = min(delay * 2, 60.0)
        self._watch(index, p)
        if self._stopping:  # the stop began while it started: it stops too
            _signal(p.pid, signal.SIGTERM)

    def _note_gone(self) -> None:
        if self._stopping and not self._procs and not self._respawning:
            self._all_gone.set()

    def hup(self) -> None:
        """Forward SIGHUP to every worker (each reads the keys file again)."""
        for p in self._procs.values():
            _signal(p.pid, signal.SIGHUP)

    async def stop(self, timeout: float) -> None:
        """SIGTERM every worker (each drains its requests), wait up to ``timeout`` s for the last to
        exit, then SIGKILL those left and wait up to 5 s more for them."""
        self._stopping = True
        self._stop_asked.set()
        self._note_gone()
        for p in self._procs.values():
            _signal(p.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self._all_gone.wait(), timeout)
        except asyncio.TimeoutError:
            for p in self._procs.values():
                _signal(p.pid, signal.SIGKILL)
            try:
                await asyncio.wait_for(self._all_gone.wait(), 5)
            except asyncio.TimeoutError:
                log.warning("workers_left", pids=[p.pid for p in self._procs.values()])


def _signal(pid: int | None, sig: signal.Signals) -> None:
    try:
        if pid:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
