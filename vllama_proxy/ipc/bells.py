"""Bells: one FIFO in ``/dev/shm`` per listening process, a byte written by any process wakes that
process's event loop (``loop.add_reader``): no thread, no sleep, no polling. Made before the processes
spawn and pickled into them. The supervisor's owner loops (``supervisor/inbox.py``) and the fair queue's
workers (``api/policy/fair_queue.py``) are woken by them."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

from .lock import this_pid

_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class Bell:
    """One FIFO that wakes one process's event loop; made before the processes spawn, pickled into them.

    :meth:`ring` (any process) writes one byte; :meth:`listen` (the one reading process, in its loop)
    hands the bytes that arrived to a callback. A full FIFO (64 KiB unread) drops the byte: its reader
    has a wake-up pending anyway.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._local_init()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._local_init()

    def _local_init(self) -> None:
        self._pid = this_pid()
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _open(self) -> int:
        if self._pid != this_pid():  # forked: this process opens its own
            self._local_init()
        if self._fd is None:  # O_RDWR: a FIFO opened so never blocks, and never reads end-of-file
            self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        return self._fd

    def ring(self, code: int = 0) -> None:
        """Send one byte (non-blocking; never raises for a full FIFO or one removed at exit)."""
        with contextlib.suppress(BlockingIOError, FileNotFoundError):
            os.write(self._open(), bytes((code,)))

    def listen(self, on_bytes: Callable[[bytes], None]) -> None:
        """Hand what arrives to ``on_bytes`` from the running loop (replaces an earlier listener of
        this process's loop)."""
        loop = asyncio.get_running_loop()
        fd = self._open()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)
        self._loop = loop

        def drain() -> None:
            data = b""
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(fd, 4096):
                    data += chunk
            if data:
                on_bytes(data)

        loop.add_reader(fd, drain)

    @property
    def listening(self) -> bool:
        """Whether this process listens in its running loop."""
        return self._pid == this_pid() and self._loop is not None and self._loop is _running_loop()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def bells(count: int, prefix: str = "vllama-bell-") -> list[Bell]:
    """``count`` new FIFOs in one directory of ``/dev/shm``, removed when the making process exits."""
    where = tempfile.mkdtemp(prefix=prefix, dir=_DIR)
    paths = [os.path.join(where, str(i)) for i in range(count)]
    for path in paths:
        os.mkfifo(path, 0o600)
    atexit.register(_remove, where, paths)  # in the making process only (not on unpickling)
    return [Bell(p) for p in paths]


def _remove(where: str, paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            os.unlink(p)
    with contextlib.suppress(OSError):
        os.rmdir(where)
