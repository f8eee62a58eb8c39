"""A lock in shared memory for the counters every proxy process updates (``--workers N``).

Each critical section is a few loads and stores in shared memory, taken once per request
(never per token), so the uncontended cost is one futex operation. Counters that several
processes read and write decide things (admit a request, put a model to sleep), so they
change only under this lock: a check and the update it allows are one atomic step, with
the lock's memory fences, instead of a handshake of flags whose order the CPU may
reorder (issue 12).

A process killed inside a critical section would leave the lock taken forever. Sections
never block, so a lock held for :data:`STUCK_AFTER` seconds has lost its holder: it is
logged and taken over.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .logs import get_logger

log = get_logger("vllama.shm")

#: Seconds after which a held lock is taken to belong to a dead process.
STUCK_AFTER = 2.0


class SharedLock:
    """A ``multiprocessing`` lock that survives the death of its holder (see the module doc).

    Create it before spawning the processes that share it; it pickles into them.
    """

    def __init__(self, ctx: Any = None) -> None:
        self._lock = (ctx or multiprocessing.get_context("spawn")).Lock()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the block (blocks this thread only for another holder's few stores)."""
        if not self._lock.acquire(timeout=STUCK_AFTER):
            log.error("shared_lock_taken_over", after_s=STUCK_AFTER, why="its holder died inside a critical section")
            try:
                self._lock.release()
            except ValueError:  # released meanwhile
                pass
            self._lock.acquire()
        try:
            yield
        finally:
            self._lock.release()
