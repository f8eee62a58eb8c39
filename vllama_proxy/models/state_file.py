"""A JSON file in the state directory that every proxy process shares and any of them may change.

Writers take an ``flock`` on a lock file beside it, read the file under the lock, change it and
replace it atomically (write, fsync, rename): concurrent writers in different workers do not lose
each other's changes and a crash never leaves half a file. Readers keep the parsed content and
read the file again only when its mtime or size changed (:class:`FileView`). Names are Ollama's,
compared without case (:func:`drop`). The alias and created-model stores (``aliases.py``,
``created.py``) are :class:`NameStore` s.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from structlog.typing import FilteringBoundLogger

T = TypeVar("T")


def read_object(path: Path, log: FilteringBoundLogger, event: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when the file is absent, or unreadable, or not an object
    (the first two are logged as ``event`` at warning level, with the path and the error).

    ``log`` is the store's logger: an unreadable file leaves the store empty, and the log says why.
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning(event, path=str(path), error=str(e))
        return {}
    return data if isinstance(data, dict) else {}


def drop(data: dict[str, Any], folded: str) -> bool:
    """Remove every entry whose name, case-folded, is ``folded`` (a name is one entry whatever its
    case, as Ollama compares names); whether one was there."""
    found = [k for k in data if k.casefold() == folded]
    for k in found:
        del data[k]
    return bool(found)


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


class NameStore(Generic[T]):
    """A state file of entries by Ollama name, one entry per name whatever its case: the protocol
    the alias and created-model stores share (write under the lock, read again when changed).

    Subclasses give :meth:`_raw` (the file's content as a JSON-able dict, read under the lock),
    :meth:`lookup` and, where a name has more spellings than its case, :meth:`_fold`.

    Args:
        path: the JSON file (its directory is made on the first write).
        load: what the view makes of the file (:class:`FileView`).
        empty: the view while there is no file.
    """

    def __init__(self, path: Path, load: Callable[[], T], empty: Callable[[], T]) -> None:
        self.path = path
        self._view = FileView(path, load, empty)

    def _raw(self) -> dict[str, Any]:
        raise NotImplementedError

    def _fold(self, name: str) -> str:
        """The name's one spelling entries are compared by."""
        return name.casefold()

    def lookup(self, name: str) -> object | None:
        raise NotImplementedError

    def _put(self, name: str, value: Any) -> None:
        """Store ``value`` under ``name``, replacing the entry of any spelling of it.

        Raises:
            OSError: the state directory cannot be written.
        """
        def change(data: dict[str, Any]) -> None:
            drop(data, self._fold(name))
            data[name] = value

        self._update(change)

    def remove(self, name: str) -> bool:
        """Forget ``name`` (any spelling); whether it was there. Writes nothing when it is not.

        Raises:
            OSError: the state directory cannot be written.
        """
        if self.lookup(name) is None:
            return False
        found = False

        def change(data: dict[str, Any]) -> None:
            nonlocal found
            found = drop(data, self._fold(name))

        self._update(change)
        return found

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        rewrite(self.path, self._raw, change)
        self._view.forget()  # read again on the next lookup
