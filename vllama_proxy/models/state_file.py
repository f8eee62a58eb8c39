"""A JSON file in the state directory that every proxy process shares and any of them may change.

Writers take an ``flock`` on a lock file beside it, read the file under the lock, change it and
replace it atomically (write, fsync, rename): concurrent writers in different workers do not lose
each other's changes and a crash never leaves half a file. Used by the alias and created-model
stores (``aliases.py``, ``created.py``).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def rewrite(path: Path, read: Callable[[], dict[str, Any]], change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to what ``read()`` returns under the lock, then replace ``path`` with the result.

    Args:
        path: the JSON file (its directory is made when missing; the lock is ``path`` with ``.lock``).
        read: the file's current content as a JSON-able dict (called under the lock).
        change: mutates that dict in place.

    Raises:
        OSError: the state directory cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        data = read()
        change(data)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
