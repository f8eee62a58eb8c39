"""One ``vllm serve`` child: launched in its own session, its output logged, its whole tree stopped.

vLLM's API server spawns an engine-core process, which spawns GPU workers. A
SIGKILL to the API server alone leaves them holding GPU memory
(``docs/wire.md`` "The upstream: what vLLM's server does"), so the child starts a new session
(``start_new_session``: its pid is the process group and session id) and
stopping always signals the group, then sweeps anything left in the session
with psutil — even processes whose parent already died and were re-parented.
The child also dies with vllama (``lifeline.py``: parent-death signal, launch record).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from ..logs import get_logger
from . import lifeline

log = get_logger("vllm")

#: vLLM log lines that show loading is moving: downloads, weight shards, profiling,
#: KV cache sizing, torch.compile and CUDA graph capture, API server start-up.
PROGRESS = re.compile(
    r"download|Loading|loading|shard|weights|profil|KV cache|compil|graph|Capturing|warm|Starting vLLM|Init|init engine|Available routes",
)


def find_executable(name: str) -> str | None:
    """The executable ``name`` stands for: a name with a slash as given (if it can be run); a bare
    name beside this process's Python first, then on ``PATH``; ``None`` when there is none.

    Beside the Python comes first because that is where ``pip install 'vllama-proxy[vllm]'`` put
    ``vllm``: ``.venv/bin/vllama serve`` finds ``.venv/bin/vllm`` whether or not the venv is
    activated, and a ``vllm`` of another version on ``PATH`` does not win over it.
    ``sys.executable`` is not resolved: a venv's ``python`` is a link to the base interpreter.
    """
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


class VllmProcess:
    """A launched ``vllm serve`` (or stand-in) and the bookkeeping around it.

    Attributes:
        pid: the API server's pid (also its process group and session id).
        last_lines: the child's most recent output lines (stdout and stderr), for error reports.
        last_progress: monotonic time of the latest loading-progress line.
    """

    def __init__(self, proc: asyncio.subprocess.Process, keep_lines: int, model: str | None = None,
                 marker: str | None = None, record: Path | None = None) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.marker = marker
        self._record = record
        self._log = log.bind(model=model) if model else log
        self.last_lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.last_progress = time.monotonic()
        self._pumps = [asyncio.create_task(self._pump(s, name)) for s, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")) if s]

    @classmethod
    async def launch(cls, argv: Sequence[str], env: dict[str, str] | None = None, keep_lines: int = 40,
                     model: str | None = None, state_dir: Path | None = None) -> VllmProcess:
        """Start ``argv`` (no shell) in a new session with piped output; its log lines name ``model``.

        The child gets SIGTERM if this process dies (``lifeline.launch_hook``), its tree carries
        a fresh ``VLLAMA_TREE`` marker, and with ``state_dir`` a launch record is written there
        (removed by :meth:`stop`) so a later vllama can stop a tree this one could not.

        Raises:
            OSError: the executable cannot be run (not found, not executable).
        """
        marker = lifeline.new_marker()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lifeline.launch_hook(),
            env={**(os.environ if env is None else env), lifeline.MARKER: marker},
            limit=1 << 20,
        )
        record = lifeline.record(state_dir, marker, proc.pid, model or argv[0]) if state_dir is not None else None
        self = cls(proc, keep_lines, model, marker, record)
        self._log.info("launched", pid=proc.pid, argv=list(argv))
        return self

    async def _pump(self, stream: asyncio.StreamReader, name: str) -> None:
        # vLLM's output becomes our structured log lines, tagged component=vllm.
        while True:
            try:
                raw = await stream.readline()
            except (ValueError, asyncio.LimitOverrunError):
                continue  # an over-long line: skip it, keep draining
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            self.last_lines.append(line)
            if PROGRESS.search(line):
                self.last_progress = time.monotonic()
            self._log.info("output", stream=name, line=line)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        """Wait for the API server to exit; returns its exit code."""
        return await self.proc.wait()

    async def drained(self, timeout: float) -> None:
        """Until its output pipes reach their end (the last lines logged and kept), at most ``timeout``
        seconds (a grandchild may hold them open)."""
        if self._pumps:
            await asyncio.wait(self._pumps, timeout=timeout)

    def tail(self, n: int = 20) -> str:
        """The last ``n`` output lines, joined."""
        return "\n".join(list(self.last_lines)[-n:])

    def session_pids(self) -> list[int]:
        """Pids of every live process in the child's session (the whole vLLM tree)."""
        return session_members(self.pid)

    async def stop(self, grace: float) -> None:
        """Stop the whole tree: SIGTERM to the group, ``grace`` seconds, SIGKILL, then sweep the session."""
        if self.proc.returncode is None or session_members(self.pid):
            _signal_group(self.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self._wait_tree_gone(), grace)
            except asyncio.TimeoutError:
                log.warning("stop_grace_expired", pid=self.pid, grace_s=grace)
            _signal_group(self.pid, signal.SIGKILL)
            # Our own child is left to asyncio to reap: psutil's wait would waitpid() it
            # and steal the exit status the event loop's child watcher waits for.
            await asyncio.to_thread(sweep_session, self.pid, exclude=self.pid)
        if self.proc.returncode is None:
            await self.proc.wait()
        if self.marker is not None:  # anything of the tree that left the session
            await asyncio.to_thread(lifeline.stop_tree, self.marker, None, 0)
        lifeline.forget(self._record)
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _wait_tree_gone(self) -> None:
        while self.proc.returncode is None or await asyncio.to_thread(session_members, self.pid):
            await asyncio.sleep(0.1)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is ``sid``."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) == sid:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error, OSError):
            continue
    return out


def sweep_session(sid: int, timeout: float = 5.0, exclude: int | None = None) -> list[int]:
    """SIGKILL whatever is left of session ``sid`` (but ``exclude``) and wait for it to go; returns the pids killed."""
    procs = []
    for pid in session_members(sid):
        if pid == exclude:
            # Our own child, listed while it was still exiting from the group's SIGKILL: the event
            # loop's child watcher may reap it before this kill (under load; it raised
            # ProcessLookupError, which ended the owner loop and made vllama exit 1 on SIGTERM).
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            continue
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except psutil.Error:
            continue
    if procs:
        log.warning("swept_leftovers", pids=[p.pid for p in procs])
        psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in procs]
