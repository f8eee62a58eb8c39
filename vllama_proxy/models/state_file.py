"""A JSON file in the state directory that every proxy process shares and any of them may change.

Writers take an ``flock`` on a lock file beside it, read the file under the lock, change it and
replace it atomically (write, fsync, rename): concurrent writers in different workers do not lose
each other's changes and a crash never leaves half a file. Readers keep the parsed content and
read the file again only when its mtime or size changed (:class:`FileView`). Used by the alias
and created-model stores (``aliases.py``, ``created.py``).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


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


class FileView(Generic[T]):
    """What ``load()`` makes of ``path``, made again only when the file's mtime or size changed.

    Args:
        path: the file.
        load: reads and parses it (called only when the file exists and changed).
        empty: what the view holds while the file is absent or cannot be stat'ed.
    """

    def __init__(self, path: Path, load: Callable[[], T], empty: Callable[[], T]) -> None:
        self.path = path
        self._load, self._empty = load, empty
        self._stamp: tuple[int, int] | None = None
        self._value: T = empty()

    def get(self) -> T:
        """The content as the file is now."""
        try:
            st = self.path.stat()
        except OSError:
            self._stamp, self._value = None, self._empty()
            return self._value
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._value = self._load()
            self._stamp = stamp
        return self._value

    def forget(self) -> None:
        """Read the file again on the next :meth:`get` (after this process wrote it)."""
        self._stamp = None
