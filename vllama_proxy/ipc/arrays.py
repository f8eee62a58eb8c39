"""The one multiprocessing context of the proxy's processes, for its shared memory.

Counters every worker reads and writes (admission, the fair queue, rate limits, budgets, the status
board, on-demand slots) are ``RawArray``/``RawValue`` made in the main process before the workers
spawn, changed under ``ipc/lock.py``'s lock. Workers are started with "spawn" (``front/workers.py``:
no fork of a process with threads and an event loop), so the arrays come from the same context.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import SpawnContext

#: What every worker is started with and every shared array is made in.
SPAWN: SpawnContext = multiprocessing.get_context("spawn")


def spawn_context(ctx: SpawnContext | None = None) -> SpawnContext:
    """``ctx`` if a test gives one, else :data:`SPAWN`."""
    return ctx or SPAWN
