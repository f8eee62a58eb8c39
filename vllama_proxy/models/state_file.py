"""A JSON file in the state directory that every proxy process shares and any of them may change.

Writers take an ``flock`` on a lock file beside it, read the file under the lock, change it and
replace it atomically (write, fsync, rename): concurrent writers in different workers do not lose
each other's changes and a crash never leaves half a file. Readers keep the parsed content and
read the file again only when its mtime or size changed (:class:`FileView`); given the server's
:class:`Changes` (a count its writers raise), they look at the file only when the count moved, or
once :data:`RECHECK` seconds passed (a writer outside this server), not at every lookup. Names are Ollama's,
compared without case (:func:`drop`). The alias and created-model stores (``aliases.py``,
``created.py``) are :class:`NameStore` s.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic
from typing import Any, Generic, TypeVar

from structlog.typing import FilteringBoundLogger

from vllama_proxy.ipc.arrays import spawn_context

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


#: Seconds after which a reader given :class:`Changes` looks at its file even though no writer of this
#: server counted a change: another vllama sharing the state directory, or the file edited by hand.
RECHECK = 1.0


class Changes:
    """How many times this server's processes changed one state file: one word in shared memory
    (create it before spawning the workers; it is pickled to them, as ``supervisor/status.py``'s
    boards are). Raised by the writer under the file's lock, after the file was replaced; read
    with a plain load, so a reader learns of a change made in any worker without a system call
    (a ``stat`` per request, which raised ``FileNotFoundError`` while no model was created).
    """

    def __init__(self, ctx: Any = None) -> None:
        ctx = spawn_context(ctx)
        self._count = ctx.RawValue("Q", 0)

    @property
    def count(self) -> int:
        """Changes made so far."""
        return self._count.value

    def raise_count(self) -> None:
        """One more change (only under the file's lock: no two writers race on the word)."""
        self._count.value += 1


@dataclass
class StoreChanges:
    """The :class:`Changes` of the state files every request may look at: ``created.json``
    (``created.py``) and ``aliases.json`` (``aliases.py``)."""

    created: Changes = field(default_factory=Changes)
    aliases: Changes = field(default_factory=Changes)


def rewrite(path: Path, read: Callable[[], dict[str, Any]], change: Callable[[dict[str, Any]], None],
            changes: Changes | None = None) -> None:
    """Apply ``change`` to what ``read()`` returns under the lock, then replace ``path`` with the result.

    Args:
        path: the JSON file (its directory is made when missing; the lock is ``path`` with ``.lock``).
        read: the file's current content as a JSON-able dict (called under the lock).
        change: mutates that dict in place.
        changes: the file's change count, raised once it is replaced (still under the lock).

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
        if changes is not None:
            changes.raise_count()


class FileView(Generic[T]):
    """What ``load()`` makes of ``path``, made again only when the file's mtime or size changed.

    Args:
        path: the file.
        load: reads and parses it (called only when the file exists and changed).
        empty: what the view holds while the file is absent or cannot be stat'ed.
        changes: the file's change count (:class:`Changes`): the file is stat'ed only when it moved
            or :data:`RECHECK` seconds passed; ``None``: at every :meth:`get`.
    """

    def __init__(self, path: Path, load: Callable[[], T], empty: Callable[[], T], changes: Changes | None = None) -> None:
        self.path = path
        self._load, self._empty = load, empty
        self._stamp: tuple[int, int] | None = None
        self._value: T = empty()
        self._changes = changes
        self._seen = -1  # the change count when the file was last looked at (-1: never)
        self._next_look = 0.0  # monotonic s after which the file is looked at anyway

    def get(self) -> T:
        """The content as the file is now (as this server's writers left it, and any other's
        :data:`RECHECK` seconds ago, when the view has :class:`Changes`)."""
        if self._changes is not None:
            seen, now = self._changes.count, monotonic()  # the count before the look: a change after it is seen next time
            if seen == self._seen and now < self._next_look:
                return self._value
            self._seen, self._next_look = seen, now + RECHECK
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
        self._seen = -1


class NameStore(Generic[T]):
    """A state file of entries by Ollama name, one entry per name whatever its case: the protocol
    the alias and created-model stores share (write under the lock, read again when changed).

    Subclasses give :meth:`_raw` (the file's content as a JSON-able dict, read under the lock),
    :meth:`lookup` and, where a name has more spellings than its case, :meth:`_fold`.

    Args:
        path: the JSON file (its directory is made on the first write).
        load: what the view makes of the file (:class:`FileView`).
        empty: the view while there is no file.
        changes: the file's change count shared by this server's processes (:class:`Changes`), raised by
            every write; ``None``: the file is stat'ed at every lookup.
    """

    def __init__(self, path: Path, load: Callable[[], T], empty: Callable[[], T], changes: Changes | None = None) -> None:
        self.path = path
        self._changes = changes
        self._view = FileView(path, load, empty, changes)

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
        rewrite(self.path, self._raw, change, self._changes)
        self._view.forget()  # read again on the next lookup
