"""A lock for the counters in shared memory that every proxy process updates (``--workers N``).

Invariant: counters that decide things (admit a request, put a model to sleep) change only under this
lock, so a check and the update it allows are one atomic step with the lock's memory fences, not a
handshake of flags the CPU may reorder; a section is a few loads and stores, once per request, never
per token. The lock is ``flock(2)`` on a file, which the kernel releases when its holder dies: a
worker killed inside a section cannot leave the others waiting. Its users are the supervisor's boards
and slots (``status.py``, ``slots.py``) and the API's shared counts (``admission.py``,
``fair_queue.py``, ``rate_limits.py``): it stands on the lower floor of the two
(``docs/architecture.md``, "The rules").
"""

from __future__ import annotations

import atexit
import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

#: This process's id, kept by a fork hook: ``os.getpid()`` is a system call, and sections are
#: taken twice per request.
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def this_pid() -> int:
    """This process's id, read once (and again in a forked child): for the per-request checks of
    which process holds a file descriptor (locks, FIFOs) and for prometheus-client's values."""
    return _PID[0]

#: Where lock files go: memory, when there is a /dev/shm.
_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class SharedLock:
    """An exclusive lock shared by the processes this object is pickled into (``spawn``).

    Each process opens the file on first use (an ``flock`` belongs to an open file, so two
    processes' opens exclude each other). Not reentrant: sections must not nest.
    """

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="vllama-lock-", dir=_DIR)
        os.close(fd)
        atexit.register(_unlink, self.path)  # in the creating process only (not on unpickling)
        self._fd: int | None = None
        self._pid = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._fd, self._pid = None, 0

    def _file(self) -> int:
        if self._pid != _PID[0]:  # first use in this process (or a fork of it)
            self._fd, self._pid = os.open(self.path, os.O_RDWR | os.O_CLOEXEC), _PID[0]
        assert self._fd is not None
        return self._fd

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the block (blocks this thread only for another holder's few stores)."""
        fd = self._file()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _unlink(path: str) -> None:
    with suppress(OSError):
        os.unlink(path)
