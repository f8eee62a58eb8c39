"""A weighted fair queue in front of vLLM's running slots, shared by every worker (issue 38).

vLLM's ``priority`` orders only its own waiting queue: a request it already runs is preempted only
under KV-cache pressure, so one key's flood holds every running slot and a light key's request
waits behind it (H100, ``--max-num-seqs 256``, 1,000 streams of one key: the other key's TTFT p99
11x of alone). So vllama keeps the queue itself: at most ``capacity`` requests (vLLM's running
capacity, ``--max-num-seqs`` x data-parallel size summed over models) are upstream at once; the
rest wait here, one queue per key, and each freed place goes to the next key in VTC's order
("Fairness in Serving Large Language Models", Sheng et al., OSDI'24):

- every key has a virtual token counter; a dispatched request adds its cost, ``W_IN`` x prompt
  tokens + ``W_OUT`` x output tokens, divided by the key's ``weight``; the prompt is charged at
  dispatch (an estimate from the body's size, corrected at the end) and the output at the end of
  the request (one lock per request, none per token);
- the backlogged key with the highest ``priority``, then the smallest counter, then the fewest
  requests upstream, goes next;
- a key that becomes backlogged has its counter lifted to the smallest counter of the backlogged
  keys (or, with none, to the counter of the last key dispatched): idling earns no credit;
- work-conserving: nothing waits while fewer than ``capacity`` are upstream, and a key alone may
  use every place.

Everything lives in shared memory under :class:`~vllama_proxy.supervisor.shm.SharedLock` (a few
loads and stores and a scan of the backlogged keys only, per dispatch), so the order is the
server's, not a worker's. A waiter is a future in its own worker; the process that frees a place
picks the next key and a worker with a waiter of that key, counts the grant in shared memory and
wakes that worker with one byte on its FIFO (``/dev/shm``): no polling, no sleep.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import multiprocessing
import os
import tempfile
from typing import Any

from vllama_proxy.supervisor.shm import SharedLock

#: VTC's weights of a prompt token and an output token (the paper's w_p = 1, w_q = 2: an output
#: token costs a decode step, prompt tokens are batched in prefill).
W_IN, W_OUT = 1.0, 2.0
#: Bytes of request body per prompt token, for the estimate charged at dispatch.
BYTES_PER_TOKEN = 4
_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class FairQueue:
    """At most ``capacity`` requests upstream; the rest wait per key and leave in VTC order.

    Args:
        capacity: requests upstream at once over every worker (vLLM's running capacity).
        workers: worker processes (each with its slot ``0 .. workers - 1`` and a FIFO to be woken by).
        keys: per-key counters (``keys.KEY_SLOTS``).

    Pickled into every worker (``spawn``). :meth:`turn` is the one coroutine a request awaits;
    :meth:`done` gives its place back. Not thread-safe within a process (one event loop each).
    """

    def __init__(self, capacity: int, workers: int, keys: int, ctx: Any = None) -> None:
        ctx = ctx or multiprocessing.get_context("spawn")
        self.capacity = max(int(capacity), 1)
        self.workers = max(int(workers), 1)
        self.keys = keys
        n = self.workers * keys
        self._lock = SharedLock()
        self._upstream = ctx.RawValue("i", 0)      # requests upstream
        self._key_up = ctx.RawArray("i", keys)     # ... per key
        self._worker_up = ctx.RawArray("i", n)     # ... per worker and key (a dead worker's are given back)
        self._key_wait = ctx.RawArray("i", keys)   # requests waiting per key
        self._worker_wait = ctx.RawArray("i", n)   # ... per worker and key
        self._grants = ctx.RawArray("i", n)        # places given to a worker's waiters, not yet taken
        self._wait_cost = ctx.RawArray("d", keys)  # summed prompt estimates of a key's waiting requests
        self._vtc = ctx.RawArray("d", keys)        # the virtual token counters
        self._weight = ctx.RawArray("d", [1.0] * keys)
        self._priority = ctx.RawArray("i", keys)
        self._backlog = ctx.RawArray("i", keys)    # the keys with requests waiting, unordered ...
        self._backlog_n = ctx.RawValue("i", 0)     # ... and how many
        self._floor = ctx.RawValue("d", 0.0)       # the counter of the last key dispatched
        self._next_worker = ctx.RawArray("i", keys)  # round robin over workers within a key
        self._dispatched = ctx.RawValue("q", 0)    # requests dispatched since start (tests, logs)
        where = tempfile.mkdtemp(prefix="vllama-fair-", dir=_DIR)  # one FIFO per worker, made before they start
        self._fifos = [os.path.join(where, str(w)) for w in range(self.workers)]
        for path in self._fifos:
            os.mkfifo(path, 0o600)
        atexit.register(_remove, where, self._fifos)  # in the creating process only (not on unpickling)
        self._local_init()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_pid", "_fds", "_waiters", "_reader", "_loop", "_slot"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local_init()

    def _local_init(self) -> None:
        self._pid = os.getpid()
        self._fds: dict[int, int] = {}
        self._waiters: dict[int, collections.deque[asyncio.Future[None]]] = {}
        self._reader: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slot = -1

    # -- the request's side -------------------------------------------------------------------

    async def turn(self, slot: int, key: int, *, weight: float = 1.0, priority: int = 0, cost: float = 0.0) -> None:
        """Wait until this request of worker ``slot`` and key counter ``key`` may go upstream.

        Args:
            weight: the key's share weight (> 0): its counter grows by cost / weight.
            priority: higher goes first, whatever the counters.
            cost: the prompt's estimated cost (``W_IN`` x tokens), charged when dispatched.

        Returns at once while fewer than ``capacity`` are upstream and no key waits. Cancelled
        (the client left) while waiting, its place in the queue, or a place granted meanwhile,
        is given back. Each return must be followed by one :meth:`done`.
        """
        with self._lock.held():
            self._weight[key] = weight
            self._priority[key] = priority
            if self._upstream.value < self.capacity and self._backlog_n.value == 0:
                self._dispatch(slot, key, cost)
                return
            self._enqueue(slot, key, cost)
        self._listen(slot)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, collections.deque()).append(fut)  # before any await: see _wake
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled before it ran
                self.done(slot, key)
                raise
            self._waiters[key].remove(fut)
            wake: set[int] = set()
            with self._lock.held():
                i = slot * self.keys + key
                if self._worker_wait[i] > 0:  # still waiting: leave the queue
                    self._worker_wait[i] -= 1
                    self._leave_queue(key, self._wait_cost[key] / max(self._key_wait[key], 1))
                else:  # a place was granted to this worker's waiters of this key: give it back
                    self._grants[i] -= 1
                    wake = self._release(slot, key, 0.0)
            self._signal(wake)
            raise

    def done(self, slot: int, key: int, correction: float = 0.0) -> None:
        """The request finished upstream: its place goes to the next waiter in VTC order.

        Args:
            correction: its cost not charged at dispatch (``W_OUT`` x output tokens, and the prompt's
                actual cost less its estimate), added to the key's counter (divided by its weight).
        """
        with self._lock.held():
            wake = self._release(slot, key, correction)
        self._signal(wake)

    # -- under the lock -----------------------------------------------------------------------

    def _dispatch(self, slot: int, key: int, cost: float) -> None:
        self._upstream.value += 1
        self._key_up[key] += 1
        self._worker_up[slot * self.keys + key] += 1
        self._vtc[key] += cost / self._weight[key]
        self._floor.value = self._vtc[key]
        self._dispatched.value += 1

    def _enqueue(self, slot: int, key: int, cost: float) -> None:
        if self._key_wait[key] == 0:  # newly backlogged: no credit for having been idle
            n = self._backlog_n.value
            lift = min((self._vtc[self._backlog[j]] for j in range(n)), default=self._floor.value)
            self._vtc[key] = max(self._vtc[key], lift)
            self._backlog[n] = key
            self._backlog_n.value = n + 1
        self._key_wait[key] += 1
        self._worker_wait[slot * self.keys + key] += 1
        self._wait_cost[key] += cost

    def _leave_queue(self, key: int, cost: float) -> None:
        self._key_wait[key] -= 1
        self._wait_cost[key] = max(self._wait_cost[key] - cost, 0.0) if self._key_wait[key] else 0.0
        if self._key_wait[key] == 0:
            n = self._backlog_n.value
            for j in range(n):
                if self._backlog[j] == key:
                    self._backlog[j] = self._backlog[n - 1]
                    self._backlog_n.value = n - 1
                    break

    def _release(self, slot: int, key: int, correction: float) -> set[int]:
        self._upstream.value -= 1
        self._key_up[key] -= 1
        self._worker_up[slot * self.keys + key] -= 1
        if correction:
            self._vtc[key] += correction / self._weight[key]
        return self._fill()

    def _fill(self) -> set[int]:
        """Dispatch waiters while there is room; the workers to wake."""
        wake: set[int] = set()
        while self._upstream.value < self.capacity and self._backlog_n.value:
            key = self._pick()
            worker = self._worker_with_waiter(key)
            cost = self._wait_cost[key] / self._key_wait[key]
            self._worker_wait[worker * self.keys + key] -= 1
            self._leave_queue(key, cost)
            self._grants[worker * self.keys + key] += 1
            self._dispatch(worker, key, cost)
            wake.add(worker)
        return wake

    def _pick(self) -> int:
        best, best_rank = -1, None
        for j in range(self._backlog_n.value):
            k = self._backlog[j]
            rank = (-self._priority[k], self._vtc[k], self._key_up[k])
            if best_rank is None or rank < best_rank:
                best, best_rank = k, rank
        return best

    def _worker_with_waiter(self, key: int) -> int:
        start = self._next_worker[key]
        for step in range(self.workers):
            w = (start + step) % self.workers
            if self._worker_wait[w * self.keys + key] > 0:
                self._next_worker[key] = (w + 1) % self.workers
                return w
        raise AssertionError(f"key {key} is backlogged with no waiter")  # the counts are kept together

    # -- waking a worker ----------------------------------------------------------------------

    def _listen(self, slot: int) -> None:
        """Read this worker's FIFO from its event loop (once per process)."""
        loop = asyncio.get_running_loop()
        if self._reader is not None and self._loop is loop:
            return
        fd = self._fd(slot)
        loop.add_reader(fd, self._wake)
        self._reader, self._loop, self._slot = fd, loop, slot

    def _fd(self, slot: int) -> int:
        if self._pid != os.getpid():
            self._local_init()
        fd = self._fds.get(slot)
        if fd is None:  # O_RDWR: a FIFO opened so never blocks, and never reads end-of-file
            fd = self._fds[slot] = os.open(self._fifos[slot], os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        return fd

    def _signal(self, workers: set[int]) -> None:
        for w in workers:
            if w == self._slot and self._loop is not None:
                self._loop.call_soon(self._wake)
                continue
            with contextlib.suppress(BlockingIOError):  # full: it has a wake-up pending anyway
                os.write(self._fd(w), b"x")

    def _wake(self) -> None:
        """This worker's waiters whose places were granted go on (FIFO order within a key)."""
        if self._reader is not None:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._reader, 4096):
                    pass
        keys = [k for k, q in self._waiters.items() if q]
        if not keys:
            return
        granted: list[tuple[int, int]] = []
        with self._lock.held():
            for k in keys:
                i = self._slot * self.keys + k
                n = self._grants[i]
                if n:
                    self._grants[i] = 0
                    granted.append((k, n))
        for k, n in granted:
            q = self._waiters[k]
            for _ in range(n):
                q.popleft().set_result(None)

    # -- the supervisor's side ----------------------------------------------------------------

    def reset_slot(self, slot: int) -> None:
        """Worker ``slot`` died: its requests upstream, waiting or granted are given back."""
        with self._lock.held():
            base = slot * self.keys
            for k in range(self.keys):
                up, waiting = self._worker_up[base + k], self._worker_wait[base + k]
                if up:
                    self._worker_up[base + k] = 0
                    self._key_up[k] -= up
                    self._upstream.value -= up
                self._grants[base + k] = 0  # granted places are counted in _worker_up already
                for _ in range(waiting):
                    self._worker_wait[base + k] -= 1
                    self._leave_queue(k, self._wait_cost[k] / max(self._key_wait[k], 1))
            wake = self._fill()
        self._signal(wake)

    def stats(self) -> dict[str, Any]:
        """``upstream``, ``waiting`` and ``dispatched`` over the server (a snapshot, for logs and tests)."""
        return {"capacity": self.capacity, "upstream": self._upstream.value,
                "waiting": sum(self._key_wait[self._backlog[j]] for j in range(self._backlog_n.value)),
                "dispatched": self._dispatched.value}

    def counter(self, key: int) -> float:
        """The key's virtual token counter (tests)."""
        return self._vtc[key]


def _remove(where: str, paths: list[str]) -> None:
    with contextlib.suppress(OSError):
        for path in paths:
            os.unlink(path)
        os.rmdir(where)
