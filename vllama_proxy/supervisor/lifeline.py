"""Children that die with vllama: the parent-death signal and the launch record.

Invariant: no ``vllm serve`` tree outlives vllama to hold its GPU memory, by three layers.
1. **Parent-death signal**: each launched child (vLLM's API server, ``--workers``) gets SIGTERM
   when its parent dies (``prctl(PR_SET_PDEATHSIG)``, ``man 2 prctl``; set between fork and exec).
2. **Launch records**: every vLLM tree carries ``VLLAMA_TREE=<id>`` in its environment (retitled
   processes are found by session and title) and a record ``<state_dir>/children/<id>.json`` with
   its process group and owner (pid, start time); a starting vllama stops the trees whose owner is
   gone (:func:`stop_stale`), what layer 1 could not stop.
3. **Every exit path**: the running process's records are swept at interpreter exit
   (:func:`stop_own`, ``atexit`` and ``cli.main``'s ``finally``). Why: ``docs/decisions.md``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import psutil

from ..logs import get_logger

log = get_logger("vllama.lifeline")

#: The environment variable that marks every process of one launched tree.
MARKER = "VLLAMA_TREE"
_PR_SET_PDEATHSIG = 1

_prctl = None
if sys.platform.startswith("linux"):
    try:  # resolved here, in the parent: the launch hook itself only calls it
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        _prctl = None


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; a no-op
    elsewhere). If ``parent`` (the pid this process was forked from) is already gone, the
    signal is sent at once: the parent died between fork and this call.

    Safe in a ``preexec_fn`` (async-signal-safe work only: one libc call, getppid, kill).
    """
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def launch_hook(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``asyncio.create_subprocess_exec``: the child gets ``sig`` when
    the calling process dies."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)


def new_marker() -> str:
    """A fresh id for one launched tree (the value of :data:`MARKER`)."""
    return uuid.uuid4().hex


def marked(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``VLLAMA_TREE=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def _records(state_dir: Path) -> Path:
    return state_dir / "children"


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def record(state_dir: Path, marker: str, pgid: int, model: str) -> Path | None:
    """Write the launch record of a tree (best effort: an unwritable state dir logs a warning).

    Returns the record's path, or ``None`` when it could not be written.
    """
    path = _records(state_dir) / f"{marker}.json"
    body = {"marker": marker, "pgid": pgid, "model": model, "owner_pid": os.getpid(),
            "owner_started": _started(os.getpid()), "launched": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(path)
    except OSError as e:
        log.warning("launch_record_not_written", path=str(path), error=str(e))
        return None
    return path


def forget(path: Path | None) -> None:
    """Remove a launch record once its tree is stopped."""
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _owner_alive(body: dict) -> bool:
    pid = body.get("owner_pid")
    return isinstance(pid, int) and pid != os.getpid() and _started(pid) == body.get("owner_started")


#: What vLLM's processes call themselves (``VLLM::EngineCore``, ``VLLM::APIServer_0``, ...).
_VLLM_TITLE = "VLLM::"


def _titled_members(sid: int, since: float) -> list[psutil.Process]:
    """Live processes of session ``sid`` started at or after ``since`` that carry a vLLM
    process title. vLLM retitles its processes (setproctitle), which overwrites their
    environment in ``/proc``, so these are found by session, not by the marker."""
    found = []
    for p in psutil.process_iter(["status", "name", "cmdline", "create_time"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or os.getsid(p.pid) != sid:
                continue
            title = " ".join(p.info["cmdline"] or []) or p.info["name"] or ""
            if _VLLM_TITLE in title and p.info["create_time"] >= since - 1:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def stop_tree(marker: str, pgid: int | None, grace: float, launched: float | None = None) -> list[int]:
    """SIGTERM a tree's process group and every process of it, wait up to ``grace`` seconds,
    SIGKILL what is left; returns the pids that were found.

    Only processes of the tree are ever signalled: those carrying the marker, and (with
    ``launched``, the time the tree was started) the vLLM-titled processes of its session
    started since, which lost the marker to their new title. A recycled process-group id
    is left alone."""
    procs = marked(marker)
    if pgid and launched is not None:
        seen = {p.pid for p in procs}
        procs += [p for p in _titled_members(pgid, launched) if p.pid not in seen]
    if not procs:
        return []
    pids = [p.pid for p in procs]
    if pgid and pgid in pids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except OSError:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=grace)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    return pids


def stop_stale(state_dir: Path, grace: float) -> list[dict]:
    """Stop every recorded tree whose owner is gone (a vllama killed or crashed earlier) and
    remove its record; returns the records of the trees that were still running, each with
    the ``pids`` that were stopped."""
    stopped = []
    folder = _records(state_dir)
    if not folder.is_dir():
        return stopped
    for path in sorted(folder.glob("*.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError):
            forget(path)
            continue
        if _owner_alive(body):
            continue  # another running vllama's (one state dir, several instances)
        pids = stop_tree(str(body.get("marker", "")), body.get("pgid"), grace, body.get("launched"))
        if pids:
            log.warning("stale_vllm_stopped", model=body.get("model"), pgid=body.get("pgid"), pids=pids,
                        owner_pid=body.get("owner_pid"), detail="left running by a vllama that did not stop it")
            stopped.append({**body, "pids": pids})
        forget(path)
    return stopped


def stop_own(state_dir: Path, grace: float = 5.0) -> list[dict]:
    """Stop the trees this process launched that are still recorded (the orderly stop
    removes each record): the last resort on every exit path of the main process."""
    stopped = []
    folder = _records(state_dir)
    if not folder.is_dir():
        return stopped
    for path in folder.glob("*.json"):
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if body.get("owner_pid") != os.getpid():
            continue
        if stop_tree(str(body.get("marker", "")), body.get("pgid"), grace, body.get("launched")):
            stopped.append(body)
        forget(path)
    return stopped
