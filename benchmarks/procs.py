"""Subprocess helpers the CPU benchmarks share: free ports, readiness waits, children always stopped."""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Poll ``url`` until it answers (any status).

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: no answer within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args[:4]))} exited with {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer in {timeout} s")


class Children:
    """Subprocesses that are stopped whatever happens (``stop_all`` is idempotent, also run at exit)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.stop_all)

    def start(self, cmd: list[str], env: dict[str, str], log_path: Path, cpus: set[int] | None = None) -> subprocess.Popen:
        """Start ``cmd`` in its own session, output to ``log_path``, pinned to ``cpus`` if given."""

        def pin() -> None:
            os.sched_setaffinity(0, cpus)  # before exec: every thread inherits it

        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    preexec_fn=pin if cpus else None, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
