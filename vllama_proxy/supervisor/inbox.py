"""A model's inbox: what is wanted of its owner loop, as messages on one queue; carried between
processes by the bells of ``ipc/bells.py``.

The owner loop of a model (``lifecycle.py``) is told, not polled: a request that wants the model or
gave up waiting, a slot claimed or given, a neighbour needing room or whose room changed, an adapter
created, and stop are messages it waits on, as llama-swap's process loop waits on its channels
(``internal/process/process_command.go``). The other way, waiters wait on the model's *news*, rung
whenever the owner publishes its status (``status.py``). Invariants: a message carries no data (what
is wanted is written to the status board in shared memory first, so a message is a doorbell and one
that finds its question answered is dropped); it crosses processes as one byte in a ``/dev/shm``
FIFO read by ``loop.add_reader`` (no thread, no sleep); messages of one kind waiting unread are one.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterable
from typing import Any

from vllama_proxy.ipc.bells import Bell

class Kind(enum.IntEnum):
    """What a message asks of (or tells) a model's owner loop, and who sends it."""

    WANT = 1  # a request waits for the model: wake or load it (StatusBoard.request_wake; any process)
    GAVE_UP = 2  # the last request waiting for it left (StatusBoard.wait_end; any process)
    RELEASE = 3  # its on-demand slot is wanted for another model: stop it if idle (StatusBoard.request_release)
    RESPEC = 4  # its on-demand slot took another model (SlotTable.claim; any process)
    IDLE = 5  # its last request in flight ended (StatusBoard.end; any process): the pool's waiters look again
    EVICT = 6  # a model waiting for GPU room asks it to make room (Supervisor.evict; the main process)
    ROOM = 7  # a neighbour's room changed: a transition, or a neighbour became idle (the pool)
    STOP = 8  # supervision ends (Supervisor.stop)
    EXPIRED = 9  # its keep_alive was ended early, or a claim for its slot waits on it: look now (any process)
    ADAPTERS = 10  # an adapter was created that its vLLM may have to restart for (StatusBoard.adapters_changed; any process)


class News:
    """What a process's waiters wait on: one future per wait, all answered when the bell rings
    (the owner published), or by :meth:`notify` in the owner's own process."""

    def __init__(self, bell: Bell) -> None:
        self.bell = bell
        self._waiters: list[asyncio.Future[None]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"bell": self.bell}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.bell = state["bell"]
        self._waiters = []

    def waiter(self) -> asyncio.Future[None]:
        """A future answered at the next news (listening from this process's loop from now on)."""
        if not self.bell.listening:
            self.bell.listen(lambda _data: self._answer())
        f = asyncio.get_running_loop().create_future()
        self._waiters = [w for w in self._waiters if not w.done()]  # those that timed out or were cancelled
        self._waiters.append(f)
        return f

    def _answer(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)


class Inbox:
    """A model's owner loop's one queue of messages (:class:`Kind`); at most one of each kind unread.

    The owner :meth:`open` s it in its loop; any process sends through the board's bell, the main
    process may :meth:`post` directly. ``on_message`` sees every message as it arrives, read or not
    (the supervisor tells its pool of an ``IDLE`` there).
    """

    def __init__(self, bell: Bell | None = None, on_message: Callable[[Kind], None] | None = None) -> None:
        self.bell = bell
        self.on_message = on_message
        self._queue: asyncio.Queue[Kind] = asyncio.Queue()
        self._unread: set[Kind] = set()

    def open(self) -> None:
        """Read the bell from the running loop (the owner's)."""
        if self.bell is not None:
            self.bell.listen(self._arrived)

    def _arrived(self, data: bytes) -> None:
        for code in dict.fromkeys(data):  # in order of arrival, each kind once
            with contextlib.suppress(ValueError):
                self.post(Kind(code))

    def post(self, kind: Kind) -> None:
        """Deliver ``kind`` (in the owner's process)."""
        if self.on_message is not None:
            self.on_message(kind)
        if kind not in self._unread:
            self._unread.add(kind)
            self._queue.put_nowait(kind)

    async def next(self, kinds: Iterable[Kind], timeout: float | None = None, *,
                   also: asyncio.Future[Any] | None = None) -> Kind | None:
        """The next message of ``kinds`` (others that arrive meanwhile are dropped: what they asked is
        on the board, read by the step they matter to); ``None`` after ``timeout`` seconds or once
        ``also`` (vLLM's exit) is done."""
        wanted = set(kinds) | {Kind.STOP}
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(timeout, 0.0)
        while also is None or not also.done():
            if self._queue.empty():
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return None
                get = asyncio.ensure_future(self._queue.get())
                try:
                    await asyncio.wait({get} if also is None else {get, also}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not get.done():
                        get.cancel()
                if not get.done() or get.cancelled():
                    continue  # the deadline, or vLLM exited
                kind = get.result()
            else:
                kind = self._queue.get_nowait()
            self._unread.discard(kind)
            if kind in wanted:
                return kind
        return None
