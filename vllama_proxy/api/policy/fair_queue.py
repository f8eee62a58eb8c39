"""A weighted fair queue in front of vLLM's running slots, shared by every worker.

At most ``capacity`` requests (vLLM's running capacity) are upstream at once; the rest wait here, one
queue per key, and each freed place goes to the backlogged key with the highest ``priority``, then the
smallest virtual token counter, then the fewest upstream (VTC, Sheng et al., OSDI'24). A request costs
``W_OUT`` per output token + ``--fair-prompt-weight`` (:data:`W_IN`) per prompt token over the key's
``weight``, estimated at dispatch and settled at the end (:meth:`_bounded`); a newly backlogged key is
lifted to the smallest backlogged counter. Heavy keys leave ``--fair-reserve`` places free and, while a
light key is active, run at most ``--fair-light-running``. Rules: ``docs/configuration.md`` "Fair
share"; why: ``docs/decisions.md``. Invariant: the state is in shared memory under ``ipc/lock.py``'s
lock (once at each end of a request), and the freer of a place rings the waiter's ``ipc/bells.py`` bell.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from vllama_proxy.ipc.arrays import spawn_context
from vllama_proxy.ipc.bells import bells
from vllama_proxy.ipc.lock import SharedLock, this_pid

#: The cost of an output token (the unit: one running slot for one decode step), and the default cost
#: of a prompt token (``--fair-prompt-weight``): prefill takes a slot for a step or a few, however
#: long the prompt, so 0 gives every key its weighted share of the output tokens. VTC's
#: paper weighs them w_p = 1, w_q = 2 (0.5 here): it counts the prompt as work, not slot time.
W_IN, W_OUT = 0.0, 1.0
#: Weight of the last request in a key's expected output tokens (an exponential moving average).
EXPECT_ALPHA = 0.25
#: Bytes of request body per prompt token, for the estimate charged at dispatch.
BYTES_PER_TOKEN = 4
#: Seconds a key stays active after its last request ended: a light key that asks again within it
#: finds the reserve kept and the heavy keys' running batch still small.
LINGER = 10.0


def prompt_tokens_guess(body: bytes | None) -> float:
    """A request's prompt tokens guessed from its body's size (:data:`BYTES_PER_TOKEN`), before vLLM
    counts them: what admission charges at dispatch, and what a stream its client left before vLLM's
    usage came is charged (``routes/answer.py``, ``routes/openai.py``)."""
    return len(body or b"") / BYTES_PER_TOKEN


class FairQueue:
    """At most ``capacity`` requests upstream; the rest wait per key and leave in VTC order.

    Args:
        capacity: requests upstream at once over every worker (vLLM's running capacity).
        workers: worker processes (each with its slot ``0 .. workers - 1`` and a FIFO to be woken by).
        keys: per-key counters (``keys.KEY_COUNTERS``).
        reserve: the last places, which heavy keys leave free while another key is active: a
            light key's request then finds a running slot at once, instead of waiting for one of a
            heavy key's long requests to end (0: strictly work-conserving).
        light_running: while a light key is active, the most requests the heavy keys run together
            (0, or the capacity or more: no such cap).
        linger: seconds a key stays active after its last request ended.
        prompt_weight: the cost of a prompt token in output tokens (:data:`W_IN` by default); the
            caller charges ``prompt_weight`` x its prompt tokens through :meth:`turn`'s ``cost``
            and :meth:`done`'s ``correction``.

    Pickled into every worker (``spawn``). :meth:`turn` is the one coroutine a request awaits;
    :meth:`done` gives its place back. Not thread-safe within a process (one event loop each).
    """

    def __init__(self, capacity: int, workers: int, keys: int, ctx: Any = None, *, reserve: int = 0,
                 light_running: int = 0, linger: float = LINGER, prompt_weight: float = W_IN) -> None:
        ctx = spawn_context(ctx)
        self.capacity = max(int(capacity), 1)
        self.prompt_weight = max(float(prompt_weight), 0.0)
        self.reserve = min(max(int(reserve), 0), self.capacity - 1)
        self.light_running = int(light_running) if 0 < int(light_running) < self.capacity else self.capacity
        self.linger = max(float(linger), 0.0)
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
        self._expect_out = ctx.RawArray("d", keys)  # each key's expected output tokens (moving average)
        self._out_charged = ctx.RawArray("d", keys)  # expected outputs charged for the key's requests upstream
        self._seen = ctx.RawArray("b", keys)        # whether a request of the key has ended (its average is known)
        self._expect_all = ctx.RawValue("d", 0.0)   # every key's expected output tokens: a new key's until its own is known
        self._seen_all = ctx.RawValue("b", 0)       # whether any request has ended (the first output seeds that average)
        self._weight = ctx.RawArray("d", [1.0] * keys)
        self._parent = ctx.RawArray("i", [-1] * keys)  # an end user's key (end_users.py), -1 for a key's own counter
        self._kids = ctx.RawArray("i", keys)       # a key's active end users: its weight is split between them
        self._priority = ctx.RawArray("i", keys)
        self._backlog = ctx.RawArray("i", keys)    # the keys with requests waiting, unordered ...
        self._backlog_n = ctx.RawValue("i", 0)     # ... and how many
        self._floor = ctx.RawValue("d", 0.0)       # the counter of the last key dispatched
        self._next_worker = ctx.RawArray("i", keys)  # round robin over workers within a key
        self._dispatched = ctx.RawValue("q", 0)    # requests dispatched since start (tests, logs)
        self._elsewhere = ctx.RawArray("d", keys)  # each key's service on the other fronts, as last read (absorb)
        self._fresh = ctx.RawArray("b", [1] * keys)  # the key became active here since: its next read is a baseline
        self._active = ctx.RawArray("i", keys)     # the active keys (requests upstream or waiting, or lingering), unordered ...
        self._active_n = ctx.RawValue("i", 0)      # ... and how many
        self._is_active = ctx.RawArray("b", keys)  # whether the key is in that list
        self._last_end = ctx.RawArray("d", keys)   # when the key's last request ended or left (time.monotonic, system-wide)
        self._bells = bells(self.workers, prefix="vllama-fair-")  # one FIFO per worker, made before they start
        self._local_init()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_pid", "_waiters", "_loop", "_slot", "_recheck", "_timer", "_timer_at", "_timer_loop"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local_init()

    def _local_init(self) -> None:
        self._pid = this_pid()
        self._waiters: dict[int, collections.deque[asyncio.Future[None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slot = -1
        self._recheck: float | None = None  # set by _fill: when a lingering key's end may let waiters go
        self._timer: asyncio.TimerHandle | None = None  # this process's one timer for it ...
        self._timer_at = 0.0  # ... when it fires (time.monotonic) ...
        self._timer_loop: asyncio.AbstractEventLoop | None = None  # ... and in which loop

    # -- the request's side -------------------------------------------------------------------

    async def turn(self, slot: int, key: int, *, weight: float = 1.0, priority: int = 0, cost: float = 0.0,
                   parent: int = -1) -> None:
        """Wait until this request of worker ``slot`` and key counter ``key`` may go upstream.

        Args:
            weight: the key's share weight (> 0): its counter grows by cost / weight.
            priority: higher goes first, whatever the counters.
            cost: the prompt's estimated cost (``prompt_weight`` x tokens; + ``W_OUT`` per input of an
                embeddings, rerank or score request), charged when dispatched.
            parent: for an end user of a trusted front (``end_users.py``: ``key`` is then the user's counter),
                the key's counter: ``weight`` (the key's) is split evenly between the key's active users, so
                the key as a whole keeps its share against other keys and its users share it by VTC
                (hierarchical fair share, one level). ``-1``: ``key`` is a key's own counter.

        Returns at once while there is room and no key waits ahead of it (one lock). Cancelled
        (the client left) while waiting, its place in the queue, or a place granted meanwhile,
        is given back. Each return must be followed by one :meth:`done`.
        """
        self._listen(slot)
        local = self._waiters.setdefault(key, collections.deque())
        i = slot * self.keys + key
        with self._lock.held():
            self._weight[key] = weight
            self._priority[key] = priority
            self._parent[key] = parent
            self._enqueue(slot, key, cost)
            wake = self._fill()
            mine = not local and self._grants[i] > 0  # no older waiter of this key here: the place is this one's
            if mine:
                self._grants[i] -= 1
        if mine:
            if not any(self._waiters.values()):  # nothing here for _wake to hand on
                wake.discard(slot)
            self._signal(wake)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        local.append(fut)  # before any await: see _wake
        self._signal(wake)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled before it ran
                self.done(slot, key)
                raise
            local.remove(fut)
            wake = set()
            with self._lock.held():
                if self._worker_wait[i] > 0:  # still waiting: leave the queue
                    self._worker_wait[i] -= 1
                    self._leave_queue(key, self._wait_cost[key] / max(self._key_wait[key], 1))
                else:  # a place was granted to this worker's waiters of this key: give it back
                    self._grants[i] -= 1
                    wake = self._release(slot, key, 0.0)
            self._signal(wake)
            raise

    def done(self, slot: int, key: int, correction: float = 0.0, output: int | None = None) -> None:
        """The request finished upstream: its place goes to the next waiter in VTC order.

        Args:
            correction: the prompt's actual cost less its estimate, added to the key's counter
                (divided by its weight).
            output: its output tokens (``None``: unknown, e.g. an embedding or a stream without
                usage). At dispatch the key was charged ``W_OUT`` x its expected output (a moving
                average of its requests' outputs), so that a key's long answers count while they
                run, not only when they end; the difference is settled here.
        """
        with self._lock.held():
            wake = self._release(slot, key, correction, output)
        self._signal(wake)

    # -- the other fronts (``--state-url``: api/policy/fleet_counters.py) --------------------------------

    def service(self, prompt: float, output: float, weight: float = 1.0) -> float:
        """A request's service in counter units: its cost (:attr:`prompt_weight` x ``prompt`` +
        ``W_OUT`` x ``output`` tokens) over the key's ``weight``: what another front adds to the key's counter."""
        return (self.prompt_weight * prompt + W_OUT * output) / weight

    def absorb(self, key: int, elsewhere: float) -> None:
        """Fold into the key's counter the service it got on the other fronts of a fleet since this
        front last read it: ``elsewhere`` is that service in all (counter units, summed over the
        other fronts, read from the shared store at a request's end), so a key flooding two fronts
        is counted once by each. The first read after the key became active here only sets the
        baseline: like the lift in :meth:`_enqueue`, service before the key contended here is no
        debt. A read lower than the last is an older one (two workers' reads, answered in the
        other order) and changes nothing; a store that forgot the key (restarted) counts again
        from the key's next start here, or once its total passes the last read."""
        with self._lock.held():
            if self._fresh[key]:
                self._fresh[key] = 0
                self._elsewhere[key] = elsewhere
            elif elsewhere > self._elsewhere[key]:
                self._vtc[key] += elsewhere - self._elsewhere[key]
                self._elsewhere[key] = elsewhere

    # -- under the lock -----------------------------------------------------------------------

    def _w(self, key: int) -> float:
        """The counter's weight: a key's own, or an end user's share of its key's (split between its active users)."""
        parent = self._parent[key]
        return self._weight[key] / max(self._kids[parent], 1) if parent >= 0 else self._weight[key]

    def _dispatch(self, slot: int, key: int, cost: float) -> None:
        self._upstream.value += 1
        self._key_up[key] += 1
        self._worker_up[slot * self.keys + key] += 1
        expected = self._expect_out[key] if self._seen[key] else self._expect_all.value  # a new key: everyone's usual
        self._out_charged[key] += expected
        self._vtc[key] += (cost + W_OUT * expected) / self._w(key)
        self._floor.value = self._vtc[key]
        self._dispatched.value += 1

    def _enqueue(self, slot: int, key: int, cost: float) -> None:
        if self._key_wait[key] == 0 and self._key_up[key] == 0:  # newly active here: see absorb
            self._fresh[key] = 1
        if not self._is_active[key]:
            self._is_active[key] = 1
            if self._parent[key] >= 0:
                self._kids[self._parent[key]] += 1
            self._active[self._active_n.value] = key
            self._active_n.value += 1
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
        if self._key_wait[key] == 0 and self._key_up[key] == 0:
            self._last_end[key] = time.monotonic()
        self._wait_cost[key] = max(self._wait_cost[key] - cost, 0.0) if self._key_wait[key] else 0.0
        if self._key_wait[key] == 0:
            n = self._backlog_n.value
            for j in range(n):
                if self._backlog[j] == key:
                    self._backlog[j] = self._backlog[n - 1]
                    self._backlog_n.value = n - 1
                    break

    def _release(self, slot: int, key: int, correction: float, output: int | None = None) -> set[int]:
        charged = self._out_charged[key] / self._key_up[key]  # this request's share of the outputs charged
        self._out_charged[key] -= charged
        self._upstream.value -= 1
        self._key_up[key] -= 1
        self._worker_up[slot * self.keys + key] -= 1
        if output is not None:  # settle the output charged at dispatch, and learn the key's usual one
            correction += W_OUT * (output - charged)
            expected = self._expect_out[key] if self._seen[key] else output
            self._expect_out[key] = expected + EXPECT_ALPHA * (output - expected)
            self._seen[key] = 1
            # seeded with the first output, as a key's own: an average that started from 0 charged
            # a fresh server's new keys a quarter of a usual answer, or less, for their first requests
            # (each key then pays what its answers exceed that when they end)
            everyone = self._expect_all.value if self._seen_all.value else output
            self._expect_all.value = everyone + EXPECT_ALPHA * (output - everyone)
            self._seen_all.value = 1
        if correction:
            self._vtc[key] += self._bounded(key, correction / self._w(key), output)
        if self._key_up[key] == 0:
            self._out_charged[key] = 0.0
            if self._key_wait[key] == 0:
                self._last_end[key] = time.monotonic()
        return self._fill()

    def _bounded(self, key: int, add: float, output: int | None) -> float:
        """``add`` to the key's counter, but never past the smallest counter of the other keys
        waiting plus two of its requests' cost: what a request ending now settles (an output
        longer than was charged at dispatch) may not turn into a debt that starves the key while
        it waits (a key alone takes every place; keys arriving meanwhile are lifted to its counter
        as charged at dispatch)."""
        if add <= 0:
            return add
        others = [self._vtc[k] for k in (self._backlog[j] for j in range(self._backlog_n.value)) if k != key]
        if not others:
            return add
        request = (W_OUT * (output if output is not None else self._expect_out[key]) + self._wait_cost[key]
                   / max(self._key_wait[key], 1)) / self._w(key)
        cap = min(others) + 2 * request
        now = self._vtc[key]
        return max(min(now + add, cap) - now, 0.0) if now + add > cap else add

    def _fill(self) -> set[int]:
        """Dispatch waiters while there is room; the workers to wake."""
        wake: set[int] = set()
        self._recheck = None
        if not self._backlog_n.value:
            return wake
        view = self._view()
        while self._upstream.value < self.capacity and self._backlog_n.value:
            key = self._pick(view)
            if key < 0:  # only what heavy keys leave free is left, and only heavy keys wait
                if view is not None and view.until is not None:  # until a lingering key leaves the view
                    self._recheck = view.until
                break
            worker = self._worker_with_waiter(key)
            cost = self._wait_cost[key] / self._key_wait[key]
            self._worker_wait[worker * self.keys + key] -= 1
            self._leave_queue(key, cost)
            self._grants[worker * self.keys + key] += 1
            self._dispatch(worker, key, cost)
            if view is not None and key not in view.light:
                view.heavy_up += 1
            wake.add(worker)
        return wake

    def _view(self) -> _Active | None:
        """The active keys now (those idle for ``linger`` leave the list); ``None`` while fewer than
        two are active (a key alone takes every place). A scan of the active keys, under the lock
        (each shared array read once per key: ~0.3 µs a key)."""
        now, linger = time.monotonic(), self.linger
        active, up, wait, last = self._active, self._key_up, self._key_wait, self._last_end
        n, j, weights, until = self._active_n.value, 0, 0.0, None
        seen: list[tuple[int, int, float]] = []  # (key, requests upstream + waiting, weight)
        while j < n:
            k = active[j]
            asks = up[k] + wait[k]
            if not asks:
                leaves = last[k] + linger
                if leaves <= now:
                    self._is_active[k] = 0
                    if self._parent[k] >= 0:
                        self._kids[self._parent[k]] -= 1
                    n -= 1
                    active[j] = active[n]
                    continue
                if until is None or leaves < until:
                    until = leaves
            w = self._w(k)
            weights += w
            seen.append((k, asks, w))
            j += 1
        self._active_n.value = n
        if n < 2:
            return None
        view = _Active()
        view.until = until
        per_weight, priority, light = self.capacity / (weights or 1.0), self._priority, view.light
        top, top_n, light_top, heavy_up = None, 0, None, 0
        for k, asks, w in seen:
            p = priority[k]
            if top is None or p > top:
                top, top_n = p, 1
            elif p == top:
                top_n += 1
            if asks <= 1 or asks < per_weight * w:
                light.add(k)
                if light_top is None or p > light_top:
                    light_top = p
            else:
                heavy_up += up[k]
        view.top, view.top_n, view.light_top, view.heavy_up = top, top_n, light_top, heavy_up
        return view

    def _pick(self, view: _Active | None) -> int:
        """The next key to dispatch, in VTC order among those that may take a place now: a heavy
        key leaves the reserve to the other active keys of its priority or higher, and keeps to
        ``light_running`` for a light key of its priority or higher (priority goes first)."""
        reserved = view is not None and self._upstream.value >= self.capacity - self.reserve
        capped = view is not None and view.light_top is not None and view.heavy_up >= self.light_running
        best, best_rank = -1, None
        for j in range(self._backlog_n.value):
            k = self._backlog[j]
            if (reserved or capped) and k not in view.light:  # type: ignore[union-attr]
                p = self._priority[k]
                if reserved and (p < view.top or view.top_n > 1):  # type: ignore[union-attr,operator]
                    continue
                if capped and p <= view.light_top:  # type: ignore[union-attr,operator]
                    continue
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
        """Read this worker's bell from its event loop (once per process)."""
        if self._pid != this_pid():  # forked: this process listens on its own
            self._local_init()
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._slot == slot and self._bells[slot].listening:
            return
        self._bells[slot].listen(lambda _data: self._wake())
        self._loop, self._slot = loop, slot

    def _signal(self, workers: set[int]) -> None:
        for w in workers:
            if w == self._slot and self._loop is not None and self._pid == this_pid():
                self._loop.call_soon(self._wake)
                continue
            self._bells[w].ring()  # a full FIFO drops the byte: that worker has a wake-up pending anyway
        if self._recheck is not None:
            self._arm(self._recheck)

    def _arm(self, at: float) -> None:
        """Run the queue again at ``at`` (``time.monotonic``), when a lingering key leaves the view
        and the waiters it held back may go: one timer per process, the earliest asked for. Without
        an event loop (the supervisor's :meth:`reset_worker`) the next request's start or end does it."""
        self._recheck = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._timer is not None and self._timer_loop is loop and self._timer_at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_later(max(at - time.monotonic(), 0.0), self._rerun), at
        self._timer_loop = loop

    def _rerun(self) -> None:
        self._timer = None
        with self._lock.held():
            wake = self._fill()
        self._signal(wake)

    def _wake(self) -> None:
        """This worker's waiters whose places were granted go on (FIFO order within a key)."""
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
        left: list[tuple[int, int]] = []
        for k, n in granted:
            q = self._waiters[k]
            live = [f for f in q if not f.done()][:n]  # a cancelled waiter settles its own count (turn)
            for f in live:
                q.remove(f)
                f.set_result(None)
            if len(live) < n:
                left.append((k, n - len(live)))
        if left:  # more places than live waiters: kept for the cancelled ones to give back
            with self._lock.held():
                for k, n in left:
                    self._grants[self._slot * self.keys + k] += n

    # -- the supervisor's side ----------------------------------------------------------------

    def reset_worker(self, slot: int) -> None:
        """Worker ``slot`` died: its requests upstream, waiting or granted are given back."""
        with self._lock.held():
            base = slot * self.keys
            for k in range(self.keys):
                up, waiting = self._worker_up[base + k], self._worker_wait[base + k]
                if up:
                    self._out_charged[k] -= self._out_charged[k] * up / self._key_up[k]
                    self._worker_up[base + k] = 0
                    self._key_up[k] -= up
                    self._upstream.value -= up
                self._grants[base + k] = 0  # granted places are counted in _worker_up already
                for _ in range(waiting):
                    self._worker_wait[base + k] -= 1
                    self._leave_queue(k, self._wait_cost[k] / max(self._key_wait[k], 1))
                if up and self._key_up[k] == 0 and self._key_wait[k] == 0:
                    self._last_end[k] = time.monotonic()
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


class _Active:
    """:meth:`FairQueue._view`: the light keys among the active ones, what the heavy keys run, and
    when the view next changes by itself (a lingering key leaves it)."""

    __slots__ = ("light", "heavy_up", "until", "top", "top_n", "light_top")

    def __init__(self) -> None:
        self.light: set[int] = set()
        self.heavy_up = 0
        self.top: int | None = None  # the highest priority of the active keys ...
        self.top_n = 0  # ... and how many have it
        self.light_top: int | None = None  # the highest of the light keys (None: no light key)
        self.until: float | None = None  # the soonest a lingering key leaves the active ones (time.monotonic)
