"""The supervisor's status in shared memory: one writer (the supervisor), any number of readers.

Every proxy process (``--workers N``) gates requests, answers ``/readyz`` and
reports ``/api/ps`` memory from this board, so all of them tell the same story
as the one process that owns vLLM. Reads are plain loads from shared memory. The
counts that decide whether vLLM may be put to sleep or evicted (requests in flight and
waiting, the closing flag) change only under one lock (``ipc/lock.py``), once per request:
a request begins only if the model is ready and not closing, and the supervisor closes
it only if nothing is in flight or waiting, each as one atomic step.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

from vllama_proxy.ipc.arrays import spawn_context
from . import gpu
from .child import session_members
from ..errors import ModelLoading, ModelTooLarge, UpstreamUnavailable
from vllama_proxy.ipc.bells import bells
from .inbox import Kind, News
from vllama_proxy.ipc.lock import SharedLock
from .states import State

_STATES = list(State)

#: A wake request counts this long (seconds) unless a request counted as waiting
#: (:meth:`StatusBoard.wait_begin`) keeps wanting it: a waiter asks again when the board's news finds the
#: model still asleep or unloaded, so a model nobody waits for any more is not loaded (nor room made for it).
WANT_TTL = 2.0


class StatusBoard:
    """Supervisor status readable from other processes (create before spawning them).

    Attributes written by :meth:`publish`: state, since (epoch s), restarts, vLLM's pid,
    last error and the child's last output lines. Written by the proxy processes: the
    keep-alive deadline and last use (:meth:`touch`), wake requests, the count of adapters created
    for it (:meth:`adapters_changed`: one word, changed under the lock), and requests in flight, one
    counter per process (``workers``) so that no two processes write the same word. Written by the
    owner's side: whether the last request's end is heard (:meth:`hearing_idle`).

    Args:
        served_name: the model's served name.
        workers: proxy processes that count requests in flight (``--workers``).
        keep_alive: the model's default keep_alive, seconds (negative: forever).
        initial: the state before the supervisor runs (``unloaded`` for a model loaded on demand).
    """

    def __init__(self, served_name: str, ctx: Any = None, *, workers: int = 1, keep_alive: float = 300.0,
                 initial: State = State.STARTING) -> None:
        ctx = spawn_context(ctx)
        self._name = ctx.RawArray("c", 512)  # in shared memory: an on-demand slot's model changes (slots.py)
        self.served_name = served_name
        self.keep_alive = keep_alive
        self._state = ctx.RawValue("i", _STATES.index(initial))
        self._since = ctx.RawValue("d", time.time())
        self._restarts = ctx.RawValue("i", 0)
        self._pid = ctx.RawValue("i", 0)
        self._expires = ctx.RawValue("d", 0.0)  # epoch s when keep_alive ends; inf: never; 0: not loaded yet
        self._last_used = ctx.RawValue("d", 0.0)  # epoch s of the last request (least-recently-used eviction)
        self._wanted = ctx.RawValue("d", 0.0)  # epoch s of the latest wake request from any process
        self._loading = ctx.RawValue("i", 0)  # 1 while a start or wake asked for by requests is under way
        self._closing = ctx.RawValue("i", 0)  # 1 while the supervisor checks it is idle before sleeping/stopping it
        self._settled = ctx.RawValue("i", int(initial is State.UNLOADED))  # 1 once past its first start (any outcome)
        self._release = ctx.RawValue("i", 0)  # 1: an on-demand slot's next model asks this sleeping one to stop
        self._refused = ctx.RawValue("d", 0.0)  # epoch s of the latest fit check that refused it (0: none since it loaded)
        self._adapters = ctx.RawValue("i", 0)  # adapters created for it that may need a restart, counted (adapters_changed)
        self._start_s = ctx.RawValue("d", 0.0)  # seconds the latest start took, until ready (0: none yet)
        self._hearing = ctx.RawValue("i", 0)  # owner-side waits for its last request's end (hearing_idle): end() rings IDLE
        #: the owner loop's inbox (``inbox.py``: requests ring it) and each proxy process's news (the owner rings them)
        self.inbox_bell, *news = bells(1 + max(workers, 1), prefix="vllama-board-")
        self._news = [News(b) for b in news]
        self._lock = SharedLock()  # guards state vs. _closing, _inflight and _waiting together
        self._inflight = ctx.RawArray("i", max(workers, 1))
        self._waiting = ctx.RawArray("i", max(workers, 1))  # requests waiting for it to load, per process
        self._error = ctx.RawArray("c", 4096)
        self._output = ctx.RawArray("c", 16384)

    def publish(self, state: State, *, since: float, restarts: int, pid: int | None, last_error: str | None, last_output: str,
                loading: bool = False) -> None:
        """Write the supervisor's current status (called by the supervisor only)."""
        self._error.value = (last_error or "").encode()[: len(self._error) - 1]
        self._output.value = last_output.encode()[-(len(self._output) - 1) :]
        self._restarts.value = restarts
        self._pid.value = pid or 0
        self._since.value = since
        self._loading.value = int(loading)
        if state in (State.READY, State.SLEEPING, State.UNLOADED, State.FAILED):
            self._settled.value = 1
        with self._lock.held():  # a request begins only against a state it saw whole
            self._state.value = _STATES.index(state)  # last: readers see a complete record for it
        self.announce()

    def announce(self) -> None:
        """The owner's side: every process's waiters look at the board again (:meth:`wait_ready`,
        ``SlotTable.changed``); sent with each :meth:`publish`, and when a request's wish is settled
        without one (a refusal, a release declined)."""
        for news in self._news:
            news.bell.ring()

    def news(self, worker: int) -> asyncio.Future[None]:
        """A future of proxy process ``worker`` answered at the owner's next :meth:`announce`."""
        return self._news[worker].waiter()

    @property
    def served_name(self) -> str:
        """The model's served name (an on-demand slot's changes when another model takes it)."""
        return self._name.value.decode(errors="replace")

    @served_name.setter
    def served_name(self, name: str) -> None:
        self._name.value = name.encode()[: len(self._name) - 1]

    @property
    def state(self) -> State:
        return _STATES[self._state.value]

    @property
    def ready(self) -> bool:
        """Serving now (and not being checked for idleness before it sleeps or stops)."""
        return _STATES[self._state.value] is State.READY and not self._closing.value

    @property
    def restarts(self) -> int:
        return self._restarts.value

    @property
    def pid(self) -> int:
        """vLLM's pid as last published (0: none)."""
        return self._pid.value

    @property
    def start_seconds(self) -> float:
        """Seconds vLLM's latest start took until it was ready (0.0: it has not been ready yet); what a stream
        broken by a restart may expect to wait (``api/resume.py``)."""
        return self._start_s.value

    @start_seconds.setter
    def start_seconds(self, seconds: float) -> None:
        self._start_s.value = seconds

    @property
    def available(self) -> bool:
        """Ready now, or loadable on demand (sleeping/unloaded): what ``/readyz`` reports as ready."""
        return _STATES[self._state.value] in (State.READY, State.SLEEPING, State.UNLOADED)

    # -- keep_alive (Ollama semantics: per request, negative = forever, 0 = unload now) --------
    def touch(self, keep_alive_s: float) -> None:
        """A request used the model: it stays loaded ``keep_alive_s`` seconds from now."""
        now = time.time()
        self._expires.value = math.inf if keep_alive_s < 0 else now + keep_alive_s
        self._last_used.value = now

    def request_release(self) -> None:
        """Ask the supervisor to stop this model if it is asleep and idle (its on-demand slot is
        wanted for another model: a sleeping vLLM holds the slot): a ``RELEASE`` message. The
        supervisor answers with its new state, or by :meth:`clear_release` (declined: in use)."""
        self._release.value = 1
        self.inbox_bell.ring(Kind.RELEASE)

    @property
    def release_asked(self) -> bool:
        """A release was asked for and the supervisor has not finished or dropped it yet."""
        return bool(self._release.value)

    def clear_release(self) -> None:
        """The supervisor's side: the release asked for is done, or no longer applies (woken again,
        used again): the claim waiting on it looks again."""
        if self._release.value:
            self._release.value = 0
            self.announce()

    def expire(self) -> None:
        """End the keep-alive now without counting as a use (the least recently used stays so):
        an ``EXPIRED`` message, the supervisor unloads the model if nothing uses it."""
        self._expires.value = time.time()
        self.hurry()

    def hurry(self) -> None:
        """Ask the supervisor to look at the keep-alive now rather than at its next health check (an
        ``EXPIRED`` message: a claim for its slot waits on it); answered as :meth:`request_release` is."""
        self.inbox_bell.ring(Kind.EXPIRED)

    def adapters_changed(self) -> None:
        """An adapter of this model was created (``/api/create``, after ``created.json`` is written) that
        its running vLLM may have to restart for (``--adapters``: ``models/adapters.py``): counted on the
        board, then an ``ADAPTERS`` message; the supervisor reads the created models once and restarts
        vLLM if its LoRA plan no longer serves them (declared at launch, or larger limits)."""
        with self._lock.held():  # two workers' creates at once: neither count is lost
            self._adapters.value += 1
        self.inbox_bell.ring(Kind.ADAPTERS)

    @property
    def adapters_version(self) -> int:
        """How many times :meth:`adapters_changed` was called: the supervisor compares it with the count
        it read the created models at (a change while its message could not be heard, e.g. during a
        start, is seen at its next look)."""
        return self._adapters.value

    @property
    def expires_at(self) -> float:
        """Epoch seconds when the keep-alive ends (``inf``: never)."""
        return self._expires.value

    @property
    def last_used(self) -> float:
        """Epoch seconds of the latest :meth:`touch` (0: never used)."""
        return self._last_used.value

    def request_wake(self) -> None:
        """Ask the supervisor (in whichever process) to wake or reload the model: a ``WANT`` message;
        lasts ``WANT_TTL`` s, or while requests wait for it (:attr:`waiters`)."""
        self._wanted.value = time.time()
        self.inbox_bell.ring(Kind.WANT)

    @property
    def want_ends(self) -> float:
        """Epoch seconds when the latest wake request stops counting (without waiters)."""
        return self._wanted.value + WANT_TTL

    def clear_wake(self) -> None:
        """The supervisor's side: the model is ready, wake requests are fulfilled."""
        self._wanted.value = 0.0

    @property
    def waking(self) -> bool:
        """A request wants the model loaded (asked within the last ``WANT_TTL`` seconds)."""
        return time.time() - self._wanted.value < WANT_TTL

    def refuse(self) -> None:
        """The supervisor's side: the fit check refused to start it (``last_error`` says why, published
        first); requests waiting for it get that message now. Clears the wake request, so that it is
        checked again only when a request asks again."""
        self._refused.value = time.time()
        self.clear_wake()
        self.announce()

    def admitted(self) -> None:
        """The supervisor's side: it got its GPU memory; earlier refusals no longer apply."""
        self._refused.value = 0.0

    @property
    def settled(self) -> bool:
        """Past its first start: it was ready, or is left unloaded, asleep or failed."""
        return bool(self._settled.value)

    @property
    def loading(self) -> bool:
        """A start or wake that requests asked for is under way (they wait for it)."""
        return bool(self._loading.value)

    # -- requests in flight (the supervisor's idleness check before sleep, stop or eviction) --
    def try_begin(self, worker: int) -> bool:
        """Count a request of proxy process ``worker`` as using the model, if it is ready and not
        closing (atomically: once this returns True the model is not put to sleep under it)."""
        with self._lock.held():
            if _STATES[self._state.value] is not State.READY or self._closing.value:
                return False
            self._inflight[worker] += 1
            return True

    def end(self, worker: int) -> None:
        """That request finished; the last one in flight sends ``IDLE`` while the owner's side hears it
        (:meth:`hearing_idle`: a model waiting for its GPU room, a drain, a restart waiting for idle)."""
        with self._lock.held():
            self._inflight[worker] -= 1
            ring = self._hearing.value > 0 and not any(self._inflight)
        if ring:
            self.inbox_bell.ring(Kind.IDLE)

    def listen_idle(self, on: bool) -> None:
        """The owner's side (the main process): one more (``on``) or one fewer wait for the end of the
        last request in flight. Only while some wait hears it does that end ring ``IDLE``: otherwise no
        one acts on it, and the message woke the owner loop after every lone request (inbox, lifecycle
        and the pool's ``moved``: ~130 µs of the main process per request at c=1). Set under
        the lock, so a request's end either comes before (the waiter then sees nothing in flight) or
        rings."""
        with self._lock.held():
            self._hearing.value += 1 if on else -1

    @contextlib.contextmanager
    def hearing_idle(self) -> Iterator[None]:
        """While inside, the end of the last request in flight rings ``IDLE`` (:meth:`listen_idle`);
        read :attr:`in_flight` after entering, never before."""
        self.listen_idle(True)
        try:
            yield
        finally:
            self.listen_idle(False)

    @property
    def in_flight(self) -> int:
        """Requests using the model now, over every proxy process."""
        return sum(self._inflight)

    def wait_begin(self, worker: int) -> None:
        """A request of proxy process ``worker`` starts waiting for the model (it is not evicted meanwhile)."""
        with self._lock.held():
            self._waiting[worker] += 1

    def wait_end(self, worker: int) -> None:
        """That request stopped waiting (it began, after :meth:`try_begin`, or gave up); the last one
        sends ``GAVE_UP`` (a load or a wait for room nobody waits for any more ends)."""
        with self._lock.held():
            self._waiting[worker] -= 1
            last = not any(self._waiting)
        if last and _STATES[self._state.value] is not State.READY:  # ready: no load or wait for room to end
            self.inbox_bell.ring(Kind.GAVE_UP)

    @property
    def waiters(self) -> int:
        """Requests waiting for the model to load, over every proxy process."""
        return sum(self._waiting)

    @property
    def in_use(self) -> bool:
        """A request is in flight, waits for the model, or asked it to wake (:attr:`waking`): it is
        neither put to sleep nor evicted (``eviction.py``)."""
        return self.in_flight > 0 or self.waiters > 0 or self.waking

    def reset_worker(self, worker: int) -> None:
        """Forget the counts of proxy process ``worker`` (it died; its requests with it)."""
        with self._lock.held():
            self._inflight[worker] = 0
            self._waiting[worker] = 0

    def try_close(self) -> bool:
        """The supervisor's side: if no request is in flight or waiting, set the closing flag
        (atomically), so that none begins until :meth:`reopen`. False: the model is in use."""
        with self._lock.held():
            if any(self._inflight) or any(self._waiting):
                return False
            self._closing.value = 1
            return True

    def close(self) -> None:
        """The supervisor's side: set the closing flag with requests in flight (they finish; new ones
        wait, as for a start, until :meth:`reopen`): a restart that drains (an adapter declared at launch)."""
        with self._lock.held():
            self._closing.value = 1

    def reopen(self) -> None:
        """Clear the closing flag: requests may begin again (once the state is ready)."""
        with self._lock.held():
            self._closing.value = 0

    async def wait_ready(self, timeout: float, worker: int = 0) -> None:
        """Wake a sleeping or unloaded model if needed and wait until it serves.

        Any worker process (``worker``) may call this: it asks the supervisor with a ``WANT`` message
        (:meth:`request_wake`), then waits for the supervisor's news (:meth:`announce`, sent with
        each status it publishes) and looks again, asking again if the want lapsed: no polling.

        Raises:
            ModelTooLarge: the fit check refused to load it after this call asked (507).
            UpstreamUnavailable: not ready within ``timeout`` s, or vLLM failed or is stopping.
        """
        deadline = time.monotonic() + timeout
        asked = time.time()
        while not self.ready:
            news = self.news(worker)  # before the look: a status published from here on answers it
            state = self.state
            if state in (State.SLEEPING, State.UNLOADED):
                if self._refused.value >= asked:  # a verdict reached since this request asked: final for it
                    raise ModelTooLarge(self.last_error or f"model '{self.served_name}' does not fit in its GPUs' memory")
                if not self.waking:
                    self.request_wake()
            elif state in (State.FAILED, State.STOPPING, State.STOPPED, State.UNHEALTHY):
                raise self.unavailable()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.unavailable(waited=timeout)
            try:
                await asyncio.wait_for(news, remaining)
            except asyncio.TimeoutError:
                pass

    async def wait_left_ready(self, timeout: float, worker: int = 0) -> bool:
        """Wait until the model is no longer ready (its owner began a restart, a sleep, a stop), told by
        the owner's news (:meth:`announce`, sent with each status it publishes): no polling.

        Returns False if it was still ready after ``timeout`` seconds; never raises.
        """
        deadline = time.monotonic() + timeout
        while True:
            news = self.news(worker)  # before the look: a status published from here on answers it
            if not self.ready:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(news, remaining)
            except asyncio.TimeoutError:
                pass

    @property
    def last_error(self) -> str | None:
        return self._error.value.decode(errors="replace") or None

    def unavailable(self, waited: float | None = None) -> UpstreamUnavailable:
        """The 503 for a request the model cannot serve now: :class:`ModelLoading` (with
        ``Retry-After``) while it is on its way to ready, else final (failed, stopping, or
        ``waited`` seconds went by)."""
        message = self.unavailable_message(waited)
        loading = waited is None and self.state in (State.STARTING, State.RESTARTING, State.UNHEALTHY, State.SLEEPING,
                                                     State.UNLOADED)
        return ModelLoading(message) if loading else UpstreamUnavailable(message)

    def unavailable_message(self, waited: float | None = None) -> str:
        """Why requests cannot be served now, for a 503 (``waited``: seconds a request waited)."""
        state = self.state
        if state is State.FAILED:
            return f"model '{self.served_name}' failed to load: {self.last_error}"
        if state in (State.SLEEPING, State.UNLOADED, State.STARTING) and waited is not None:
            why = f": {self.last_error}" if self.last_error else ""
            return f"model '{self.served_name}' could not be loaded within {waited:g} s{why}"
        if state in (State.STARTING, State.RESTARTING, State.UNHEALTHY, State.SLEEPING, State.UNLOADED):
            return f"model '{self.served_name}' is loading (vLLM {state.value} since {_iso(self._since.value)}), please retry"
        return f"model '{self.served_name}' is unavailable (vLLM {state.value})"

    def status(self) -> dict[str, Any]:
        """``/readyz`` body: state, since when, restarts, vLLM's pid, last error and output."""
        body: dict[str, Any] = {
            "state": self.state.value,
            "since": _iso(self._since.value),
            "model": self.served_name,
            "restarts": self.restarts,
            "pid": self._pid.value or None,
            "last_error": self.last_error,
            "expires_at": None if math.isinf(self._expires.value) or not self._expires.value else _iso(self._expires.value),
            "in_flight": self.in_flight,
            "waiting": self.waiters,
        }
        output = self._output.value.decode(errors="replace")
        if body["last_error"] and output:
            body["last_output"] = output.splitlines()
        return body

    async def vram_bytes(self) -> int:
        """GPU memory (NVML) held by vLLM's process tree, bytes; 0 when unknown."""
        pid = self._pid.value
        if not pid:
            return 0
        pids = await asyncio.to_thread(session_members, pid)
        return await asyncio.to_thread(gpu.memory_of, set(pids))


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
