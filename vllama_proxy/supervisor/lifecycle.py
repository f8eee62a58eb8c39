"""The life of one ``vllm serve`` child: start, health, restart, sleep, wake, stop.

Invariant: one task (:meth:`Supervisor._run`) owns the state (``states.py``) and every transition, one step
per state, each ending in a transition; why a step ended travels in typed values (``states.py``), never in
strings to parse. What is wanted of it (a request waiting, a neighbour needing room, its on-demand slot
claimed, stop) arrives on its one inbox (``inbox.py``), which each step waits on: nothing polls a flag.
Callers, in any process, wait on the status board (``StatusBoard.wait_ready``). Room on the GPUs is the
pool's to give (``pool.py``); what needs no I/O is decided by pure deciders beside it (``hang.py``,
``lora_restart.py``, ``respec.py``, ``restarts.py``, ``warm.py``). Patterns: Ollama's ``llm/server.go``
``WaitUntilRunning`` and llama-swap's process owner loop (``internal/process/process.go``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import psutil

from vllama_proxy.models.adapters import LoraPlan, lora_plan
from vllama_proxy.models.launch_spec import ModelConfig, pooling
from vllama_proxy.models.created import CreatedStore
from vllama_proxy.models.model_files import read_model_files
from . import gpu, probes
from .child import VllmProcess
from .hang import EngineWatch
from .inbox import Inbox, Kind
from .launch import lora_mode, vllm_argv, vllm_env
from .start_errors import start_error
from .lora_restart import lora_restart
from ..errors import UpstreamError
from ..logs import get_logger
from .placement import pin_engine_cores
from .respec import respec
from .restarts import backoff, failures_before
from .room import KEEP_ALIVE, Admitted, Eviction, KeepAliveExpired, MakeRoom, Refused, SlotWanted, Verdict, Waiting
from ..settings import Settings
from .slots import SlotTable
from .states import (TRANSITIONS, Crashed, Evicted, Healthy, Idle, InvalidTransition, LoraOutgrown, Misconfigured, StartOutcome, State,
                     StopAsked, Wanted, WakeOutcome, WatchOutcome)
from .status import StatusBoard
from ..upstream import Upstream, read_response
from .warm import leave_sleep, why_not_asleep

log = get_logger("vllama.supervisor")


#: The states in which no vLLM runs and an on-demand slot may hold another model by the next step.
_NOT_RUNNING = frozenset({State.UNLOADED, State.RESTARTING, State.FAILED})
#: What a ready vLLM's watch is told (``inbox.py``): asked to make room, its keep_alive ended early, an adapter created.
_WATCHED = frozenset({Kind.EVICT, Kind.RELEASE, Kind.EXPIRED, Kind.ADAPTERS})

class Pool(Protocol):
    """What a supervisor asks of the pool that shares its GPUs (``pool.ModelPool``)."""

    async def admit(self, sup: Supervisor, *, check_fit: bool) -> Verdict[Supervisor]:
        """The verdict on ``sup`` taking its share of its GPUs now (recorded as held when admitted);
        ``check_fit``: estimate its size against the GPUs' memory first (``models/fit.py``)."""
        ...

    def slept(self, sup: Supervisor) -> None:
        """``sup``'s vLLM went to sleep: it holds only its CUDA context now."""
        ...

    def released(self, sup: Supervisor) -> None:
        """``sup``'s vLLM is stopped and its GPU memory freed."""
        ...

    def moved(self, sup: Supervisor) -> None:
        """Something of ``sup``'s may have freed room (a transition, its last request ended): the
        models waiting for room on its GPUs look again (a ``ROOM`` message)."""
        ...

    def hearing_neighbours(self, sup: Supervisor) -> contextlib.AbstractContextManager[None]:
        """While inside, ``sup`` may wait for room: the last request's end of each model sharing its GPUs
        rings ``IDLE`` (``StatusBoard.hearing_idle``), which :meth:`moved` turns into ``ROOM`` for it."""
        ...


class Unpooled:
    """The pool of a supervisor alone on its GPUs: always room."""

    async def admit(self, sup: Supervisor, *, check_fit: bool) -> Verdict[Supervisor]:
        return Admitted()

    def slept(self, sup: Supervisor) -> None:
        pass

    def released(self, sup: Supervisor) -> None:
        pass

    def moved(self, sup: Supervisor) -> None:
        pass

    def hearing_neighbours(self, sup: Supervisor) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class Supervisor:
    """Keeps one ``vllm serve`` healthy on a private loopback port.

    Args:
        settings: vllama settings (executable, timeouts, backoff).
        spec: the model: what vLLM loads, its served name, arguments, GPUs and policy.
        port: the loopback port vLLM listens on; only the proxy is exposed.
        board: where the status is published for every proxy process; its state at
            construction is the initial one (``unloaded``: loaded on the first request).
        pool: the model pool that decides whether the model fits on its GPUs before each
            start or wake (``None``: :class:`Unpooled`, it always fits).
        engine_cpus: one CPU set per engine core, applied each time vLLM becomes ready
            (``placement.py``; ``None``: the kernel places them).
        slot: ``(table, index)`` for an on-demand slot (``slots.py``): ``spec`` is a placeholder and
            the model is whatever the slot holds when a request wakes it.
        prepare: applied to each model a slot takes (the front end's ``--api-server-count``, as for
            configured models: ``sizing.with_api_servers``).
    """

    def __init__(self, settings: Settings, spec: ModelConfig, *, port: int, board: StatusBoard, pool: Pool | None = None,
                 engine_cpus: list[list[int]] | None = None, slot: tuple[SlotTable, int] | None = None,
                 prepare: Callable[[ModelConfig], ModelConfig] | None = None) -> None:
        self.s = settings
        self.slot = slot
        self.prepare = prepare
        self._generation = 0
        self.engine_cpus = engine_cpus
        self.spec = spec
        self.port = port
        self.board = board
        self.pool: Pool = pool if pool is not None else Unpooled()
        self.served_name = spec.served_name
        self.state = board.state
        self.since = time.time()
        #: Why it last failed or was refused (a crash's reason outlives a wait for room).
        self.last_error: str | None = None
        self.last_output: str = ""
        self.restarts = 0
        self.child: VllmProcess | None = None
        self._note: str | None = None  # why it waits for room (the pool's Waiting note), shown as last_error meanwhile
        self._loading = False  # the current start or wake was asked for by requests
        self._failures = 0  # failures in a row (the backoff's exponent; a crash loop at crash_loop_limit)
        self._ready_at = 0.0  # when the last start became ready (monotonic)
        self._evict_reason: Eviction | None = None
        self._sleep_fails = False  # its first sleep and wake failed: stopped, never put to sleep
        #: vLLM's own message when it rejected its arguments (a usage error): a configuration error.
        self.config_error: str | None = None
        self._weights_bytes: int | None = None
        self._probe = Upstream(f"http://127.0.0.1:{port}", connect_timeout=2.0, read_timeout=settings.health_timeout)
        #: the hang check's own request (probes.answers), on a client that waits for its answer as long as the check does
        self._asker = Upstream(f"http://127.0.0.1:{port}", connect_timeout=2.0,
                               read_timeout=max(settings.hang_timeout, settings.health_timeout))
        #: what is wanted of the owner loop (``inbox.py``): requests from every process ring the board's bell
        self.inbox = Inbox(board.inbox_bell, on_message=self._told)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[State, str | None], Any]] = []
        #: models made with /api/create (their LoRA adapters set this vLLM's LoRA limits), and the plan it runs with
        self._created = CreatedStore(settings.state_dir / "created.json")
        self._lora = LoraPlan()
        #: the board's adapter count (``StatusBoard.adapters_version``) when the created models were last read
        self._lora_version = board.adapters_version
        #: the plan a created adapter asks for, while the running vLLM must restart for it and has not yet
        self._lora_wanted: LoraPlan | None = None

    # -- public API ----------------------------------------------------------------
    def argv(self) -> list[str]:
        """The child's command line (``launch.py``: :func:`vllm_argv`) with the LoRA plan it starts with."""
        return vllm_argv(self.s, self.spec, self.port, self._lora)

    def lora_plan(self) -> LoraPlan:
        """The LoRA plan the adapters known now ask for (``models/adapters.py``)."""
        return lora_plan(self._created.current().values(), self.served_name)

    async def start(self) -> None:
        """Begin supervising (returns at once; vLLM loads in the background)."""
        await self._probe.start()
        await self._asker.start()
        self.inbox.open()
        if self.slot is None:  # an empty on-demand slot has nothing to say yet
            log.info("state", model=self.served_name, to=self.state.value,
                     reason="launching" if self.state is State.STARTING else "loads on demand")
        self._task = asyncio.create_task(self._run(), name=f"supervisor:{self.served_name}")

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The owner loop's task (``None`` before :meth:`start`): done when supervision ends, with its
        exception if the loop crashed."""
        return self._task

    async def stop(self) -> None:
        """Stop vLLM's whole process tree and end supervision (idempotent)."""
        self._stop.set()
        self.inbox.post(Kind.STOP)
        if self._task is not None:
            await self._task
        await self._probe.close()
        await self._asker.close()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    def evict(self, why: Eviction) -> None:
        """Ask the owner loop to sleep or stop vLLM now if it is idle (no request in flight);
        a sleeping vLLM is stopped (it still holds its CUDA context).

        Asked by a model that waits for room (the pool's ``Waiting.victim``); a busy model ignores it.
        """
        if self.state in (State.READY, State.SLEEPING) and self._evict_reason is None:
            log.info("evicting", model=self.served_name, reason=str(why))
            self._evict_reason = why
            self.inbox.post(Kind.EVICT)

    def _told(self, kind: Kind) -> None:
        """Every message as it arrives, read or not: the models waiting for room on this one's GPUs
        look again when its last request ended."""
        if kind is Kind.IDLE:
            self.pool.moved(self)

    @property
    def evicting(self) -> bool:
        """An eviction was asked for and is not finished."""
        return self._evict_reason is not None

    # -- state and status: written here only --------------------------------------------------
    def _set(self, new: State, reason: str | None = None) -> None:
        if new not in TRANSITIONS[self.state]:
            raise InvalidTransition(f"{self.state.value} -> {new.value}")
        log.info("state", model=self.served_name, **{"from": self.state.value, "to": new.value, "reason": reason})
        self.state = new
        if new is not State.READY:
            self._evict_reason = None  # an eviction asked of a ready vLLM is over (done, or it died)
        self.since = time.time()
        self._publish()
        for listener in self.listeners:
            listener(new, reason)
        self.pool.moved(self)

    def _publish(self) -> None:
        self.board.publish(
            self.state,
            since=self.since,
            restarts=self.restarts,
            pid=self.child.pid if self.child else None,
            last_error=self._note or self.last_error,
            last_output=self.last_output,
            loading=self._loading,
        )

    # -- the owner loop: one step per state ------------------------------------------------------
    async def _run(self) -> None:
        steps: dict[State, Callable[[], Awaitable[None]]] = {
            State.STARTING: self._preload,  # a preload's first start; later starts go through _load
            State.UNLOADED: self._unloaded,
            State.READY: self._ready,
            State.SLEEPING: self._asleep,
            State.RESTARTING: self._retry,
            State.FAILED: self._failed,
        }
        try:
            while not self._stop.is_set():
                # an on-demand slot takes another model only while nothing of it runs (slots.py)
                if self.state in _NOT_RUNNING and self._respec() and self.state is not State.UNLOADED:
                    self._set(State.UNLOADED, f"the slot now holds {self.served_name}")  # from failed or restarting
                await steps[self.state]()
        finally:
            self._loading = False
            if self.state is not State.STOPPED:
                if self.state is not State.STOPPING:
                    self._set(State.STOPPING)
                await self._stop_child()
                self._set(State.STOPPED)

    async def _preload(self) -> None:
        """``starting`` (a preloaded model's first start): admitted, then launched."""
        await self._load(on_demand=False)

    async def _unloaded(self) -> None:
        """``unloaded``: until a request wants it (or the slot takes another model), then load it."""
        if isinstance(await self._until_wanted(None), StopAsked):
            return
        self._respec()
        await self._load(on_demand=True)

    async def _retry(self) -> None:
        """``restarting``: the backoff is over (:meth:`_fail` waited it out); start again."""
        await self._load(on_demand=False)

    async def _failed(self) -> None:
        """``failed``: a crash loop retries slowly (:meth:`_fail` waited); a configuration error waits
        for a new configuration: an on-demand slot taking another model, else never."""
        if self.config_error is None:
            await self._load(on_demand=False)
        elif self.slot is None or not await self._wait_respec():
            await self._stop.wait()

    async def _load(self, *, on_demand: bool) -> None:
        """Admitted by the pool, start vLLM and wait until it is ready: ``ready``, a failure
        (``restarting``/``failed``), or ``unloaded`` when there is no room (loaded on demand later)."""
        if not await self._admit(on_demand):
            if self._stop.is_set():
                return
            # No room on its GPUs: loaded on demand later (then idle models make room).
            self._loading = False
            if self.state is State.UNLOADED:
                self._publish()  # the demand lapsed or the wait timed out: its note; a waiter still there asks again
            else:
                self._set(State.UNLOADED, self._note or self.last_error)
            return
        self._loading = on_demand
        if self.state is not State.STARTING:
            self._set(State.STARTING, "requested" if on_demand else None)
        else:
            self._publish()
        outcome = await self._start_once()
        if self._stop.is_set():
            return
        match outcome:
            case Misconfigured(reason):
                # vLLM's argparse refused its command line: no restart can fix that, only a new
                # configuration does. Failed at once, with vLLM's own message.
                self._loading = False
                self.last_error = reason
                self.last_output = self.child.tail() if self.child else ""
                log.error("vllm_cannot_start", model=self.served_name, error=self.config_error, argv=self.argv())
                await self._stop_child()
                self._set(State.FAILED, reason)
            case Crashed(reason):
                await self._fail(reason)
            case Healthy():
                if self.slot is not None and await self._why_not_asleep() is None:
                    crashed = await self._warm_sleep()
                    if self._stop.is_set():
                        return
                    if crashed is not None:
                        return await self._fail(crashed.reason)
                self._keep_alive_from_now()
                self._loading = False  # the start requests asked for is over (as after a wake)
                self._ready_at = time.monotonic()
                self._set(State.READY)

    async def _ready(self) -> None:
        """``ready``: watch it until it must restart, is outgrown by a new adapter, or is idle past
        its keep_alive or asked to make room (then put away: asleep or stopped)."""
        outcome = await self._watch()
        match outcome:
            case Idle():
                await self._put_away()
            case LoraOutgrown():
                if not await self._drain():
                    return  # in use: the next watch tries again
                # closed to requests: stop, then start anew with the new adapter (or limits) when next wanted
                await self._stop_child()
                self.board.reopen()
                self._set(State.UNLOADED, "restarting with a new adapter or draft (--lora-modules, larger LoRA limits, "
                                               "--speculative-config)")
                self._failures = 0
            case Crashed(reason):
                await self._crashed(reason)

    async def _drain(self) -> bool:
        """Close the model to new requests for a restart: True once none is in flight (closed), False
        when it stays in use (reopened; tried again at the next watch). Idle: closed at once. In
        ``launch`` adapter mode a busy model is closed too (new requests wait, as for a start) and
        its in-flight requests get ``--drain-timeout`` seconds to finish, so that a new adapter is
        served under steady load; in ``runtime`` mode only an idle model restarts (larger LoRA limits)."""
        if self.board.try_close():
            return True
        if lora_mode(self.s, self.spec).mode != "launch":
            return False
        self.board.close()
        log.info("draining", model=self.served_name, in_flight=self.board.in_flight, reason="a new adapter, declared at launch")
        deadline = time.monotonic() + self.s.drain_timeout
        with self.board.hearing_idle():  # told by the board's IDLE message when the last one ends (inbox.py)
            while self.board.in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set() or await self.inbox.next({Kind.IDLE}, timeout=left) is Kind.STOP:
                    self.board.reopen()
                    log.warning("drain_timed_out", model=self.served_name, in_flight=self.board.in_flight,
                                then="serving on; the restart is tried again at the next check")
                    return False
        return True

    async def _put_away(self) -> None:
        """Sleep or stop an idle vLLM, unless a request renewed its keep_alive meanwhile.

        Closes the model to new requests only if none is in flight or waiting (one atomic step
        with the requests' own check, ``status.py``); a request that renewed keep_alive keeps it serving.
        """
        # a slot claimed for another model ended this keep_alive early (slots.evict_idle): say so
        why: Eviction | KeepAliveExpired = self._evict_reason or (SlotWanted() if self.board.release_asked else KEEP_ALIVE)
        renewed = self._evict_reason is None and time.time() < self.board.expires_at
        if renewed or not self.board.try_close():
            self._evict_reason = None
            if renewed:
                self.board.clear_release()  # used again: the claim looks for another model to unload
            self.board.announce()  # in use: a claim waiting on it looks again
            return
        if self._evict_reason is None and time.time() < self.board.expires_at:
            self.board.reopen()  # a request ended (and renewed keep_alive) just before the close
            self.board.announce()
            return
        try:
            # its slot is wanted: stop, do not sleep
            how = None if isinstance(why, SlotWanted) else await self._why_not_asleep()
            if isinstance(why, SlotWanted) or how is not None:
                await self._stop_child()
                self.board.clear_release()
                # why not asleep: the next request starts vLLM anew (on the CPU vLLM has no sleep mode)
                self._set(State.UNLOADED, str(why) if how is None else f"{why}; stopped: {how}")
                self._failures = 0  # started afresh when requested
                return
            try:
                await self._vllm("/sleep", level="1")
            except UpstreamError as e:
                crashed: str | None = f"vLLM failed to go to sleep: {e.message}"
            else:
                crashed = None
                self.pool.slept(self)
                self._set(State.SLEEPING, str(why))
        finally:
            self.board.reopen()
            self._evict_reason = None
        if crashed is not None:
            await self._crashed(crashed)
        elif time.time() < self.board.expires_at and not isinstance(why, MakeRoom):
            self.board.request_wake()  # a request arrived while we were putting vLLM to sleep

    async def _asleep(self) -> None:
        """``sleeping``: until a request wants it (admitted, then woken: ``ready``), it is asked to
        make room (stopped: ``unloaded``), or its vLLM exits."""
        child = self.child
        assert child is not None
        exited = asyncio.ensure_future(child.wait())
        try:
            match await self._until_wanted(exited):
                case StopAsked():
                    return
                case Crashed(reason):
                    return await self._crashed(reason)
                case Evicted(why):  # asleep, yet in the way: stop it outright
                    await self._stop_child()
                    self.board.clear_release()  # done (asked until now: the slot's claimant waits on it)
                    self._set(State.UNLOADED, str(why))
                    self._failures = 0
                    return
            self._evict_reason = None  # wanted again: whatever was asked before no longer applies
            if not await self._admit(on_demand=True):
                if not self._stop.is_set():
                    self._publish()  # its note says why it could not wake; a waiter still there asks again
                return  # still asleep: the next step waits for a request again
        finally:
            exited.cancel()
        self._loading = True
        self._publish()
        try:
            took = await self._vllm("/wake_up")
        except UpstreamError as e:
            return await self._crashed(f"vLLM failed to wake up: {e.message}")
        log.info("woke_up", model=self.served_name, seconds=round(took, 3))
        self._keep_alive_from_now()
        self._loading = False
        self._set(State.READY, "woken by a request")

    async def _vllm(self, path: str, **params: str) -> float:
        """POST to one of vLLM's sleep endpoints (``/sleep``, ``/wake_up``; served with
        ``VLLM_SERVER_DEV_MODE``) and read its answer; the seconds it took.

        Raises:
            UpstreamError: vLLM refused or did not answer.
        """
        started = time.monotonic()
        async with self._probe.request("POST", path, params=params or None) as resp:
            await read_response(resp)
        return time.monotonic() - started

    async def _warm_sleep(self) -> Crashed | None:
        """One sleep and wake of a freshly started on-demand model that will sleep, before it is
        ready: vLLM's first sleep of a model is slow (2.0 s on the H200, pinning host
        memory for the weights' backup; later ones 0.15 s: ``benchmarks/RESULTS.md``, sleep and
        wake on the H200), so it is paid now, while requests wait for the start anyway, rather than by the
        first request for another model that evicts it. Both durations are logged (``sleep_warmed``).

        Its status says so meanwhile (its note). A failed sleep is logged and the model serves on,
        stopped instead of put to sleep from then on; a failed wake leaves vLLM asleep: the start failed.
        """
        self._note = "warming its sleep (one sleep and wake now, so that its first eviction is fast)"
        self._publish()
        try:
            try:
                slept = await self._vllm("/sleep", level="1")
            except UpstreamError as e:
                self._sleep_fails = True
                log.warning("sleep_warm_failed", model=self.served_name, step="sleep", error=e.message,
                            then="it serves, and is stopped instead of put to sleep")
                return None
            try:
                woke = await self._vllm("/wake_up")
            except UpstreamError as e:
                self._sleep_fails = True
                log.warning("sleep_warm_failed", model=self.served_name, step="wake_up", error=e.message,
                            then="restarted, and stopped instead of put to sleep")
                return Crashed(f"vLLM failed to wake up: {e.message}")
            log.info("sleep_warmed", model=self.served_name, sleep_s=round(slept, 3), wake_s=round(woke, 3))
            return None
        finally:
            self._note = None

    async def _crashed(self, reason: str) -> None:
        """A ready or sleeping vLLM failed: ``unhealthy``, then restarted (:meth:`_fail`)."""
        self._loading = False
        self._set(State.UNHEALTHY, reason)
        self._failures = failures_before(self._failures, time.monotonic() - self._ready_at, self.s.restart_reset_after)
        await self._fail(reason)

    async def _fail(self, reason: str) -> None:
        """Stop the failed vLLM and wait out the backoff: ``restarting``, or ``failed`` (retried
        slowly) after ``crash_loop_limit`` failures in a row."""
        self._loading = False
        self._failures += 1
        self.last_error = reason
        self.last_output = self.child.tail() if self.child else ""
        log.warning("vllm_failed", model=self.served_name, reason=reason, failures=self._failures, last_output=self.last_output)
        await self._stop_child()
        wait = backoff(self._failures, crash_loop_limit=self.s.crash_loop_limit, initial=self.s.restart_backoff_initial,
                       cap=self.s.restart_backoff_max, failed_retry=self.s.failed_retry_interval)
        self._set(State.FAILED if wait.crash_loop else State.RESTARTING, reason)
        if not await self._sleep_or_stop(wait.delay):
            self.restarts += 1

    def _respec(self) -> bool:
        """An on-demand slot took another model since it was last read: run that one from now on
        (``respec.py`` decides)."""
        if self.slot is None:
            return False
        table, index = self.slot
        new = respec(self._generation, table.generation(index), lambda: table.spec(index), self.prepare)
        if new is None:
            return False
        self._generation, spec = new.generation, new.spec
        self.spec, self.served_name = spec, spec.served_name
        self.config_error = self.last_error = self._note = None
        self.last_output = ""
        self.restarts = 0
        self._weights_bytes = None
        self._sleep_fails = False
        log.info("on_demand_model", slot=index, model=self.served_name, repo=spec.model, vllm_args=spec.args())
        return True

    async def _wait_respec(self) -> bool:
        """Until the slot takes another model (True) or supervision stops (False)."""
        table, index = self.slot
        while table.generation(index) == self._generation:
            if await self.inbox.next({Kind.RESPEC}) is Kind.STOP or self._stop.is_set():
                return False
        return True

    async def _admit(self, on_demand: bool) -> bool:
        """Ask the pool for room on its GPUs until it answers (``room.py``): True once admitted.

        A start or wake waits while a neighbour on a shared GPU loads (one start at a time). With
        no room, a preload or restart (``on_demand`` false) gives up at once and loads on demand
        later; one that requests wait for asks the pool's choice of idle neighbour to make room,
        one at a time, and gives up after ``load_timeout`` or once no request waits any more. A
        model that cannot fit at all is refused: its requests get the numbers (507).
        """
        with self.pool.hearing_neighbours(self):  # from before the first verdict: no neighbour's end unheard
            return await self._admit_heard(on_demand)

    async def _admit_heard(self, on_demand: bool) -> bool:
        """:meth:`_admit` while the neighbours' last requests' ends are heard."""
        deadline = time.monotonic() + self.s.load_timeout
        check_fit = True  # once, when no neighbour is loading: NVML's free memory is then what vLLM would see
        while not self._stop.is_set():
            match await self.pool.admit(self, check_fit=check_fit):
                case Admitted():
                    self._note = None  # a crash's reason (last_error) outlives the wait
                    self.board.admitted()
                    return True
                case Refused(report):
                    # left unloaded: why (the numbers and the advice) in its status, then the
                    # refusal mark that answers the requests waiting for it
                    self.last_error, self._note = report.message(), None
                    self._publish()
                    self.board.refuse()
                    return False
                case Waiting(note, neighbour_loading, victim):
                    if note != self._note:  # why it waits, in its status now (the 503 of a request that gives up quotes it)
                        self._note = note
                        self._publish()
                        log.info("waiting_for_room", model=self.served_name, detail=note,
                                 victim=victim.served_name if victim is not None else None)
                    if not neighbour_loading:
                        check_fit = False
                        if not on_demand:
                            log.warning("model_does_not_fit", model=self.served_name, detail=note)
                            return False
                    if on_demand and (not self._wanted() or time.monotonic() > deadline):
                        return False
                    if victim is not None:
                        victim.evict(MakeRoom(self.served_name))
            # until the room may have changed (ROOM: a neighbour's transition, or its last request
            # ended), nobody waits any more (GAVE_UP, or the want lapses), or the deadline
            timeout = None
            if on_demand:
                timeout = deadline - time.monotonic()
                if not self.board.waiters:
                    timeout = min(timeout, self.board.want_ends - time.time())
            await self.inbox.next({Kind.ROOM, Kind.GAVE_UP}, timeout)
        return False

    def _wanted(self) -> bool:
        """A request asked for it lately, or requests wait for it."""
        return self.board.waking or self.board.waiters > 0

    @property
    def sleep_mode(self) -> bool:
        """Whether vLLM runs with ``--enable-sleep-mode`` (then keep_alive expiry sleeps, not stops)."""
        return self.spec.sleeps

    def _keep_alive_from_now(self) -> None:
        # Ready again: wake requests are fulfilled (waiters re-ask while they poll), and a
        # fresh load starts the default keep_alive, unless a request asked for longer.
        self.board.clear_wake()
        self.board.clear_release()  # a release asked of it while asleep no longer applies
        default = self.board.keep_alive
        until = math.inf if default < 0 else time.time() + default
        if self.board.expires_at < until:
            self.board.touch(default)

    async def _why_not_asleep(self) -> str | None:
        """Why an idle vLLM would be stopped rather than put to sleep (``warm.why_not_asleep``), ``None``
        when it may sleep; host RAM is read only when sleep mode is on and did not fail."""
        reserve = self.s.sleep_host_memory_reserve
        if not self.sleep_mode or self._sleep_fails:
            return why_not_asleep(self.sleep_mode, self._sleep_fails, None, None, reserve)
        if self._weights_bytes is None:
            self._weights_bytes = (await asyncio.to_thread(read_model_files, self.spec.model, self.served_name)).size
        available = psutil.virtual_memory().available
        why = why_not_asleep(True, False, self._weights_bytes, available, reserve)
        if why is not None:
            log.warning("host_memory_short", model=self.served_name, available=available, weights=self._weights_bytes)
        return why

    async def _until_wanted(self, exited: asyncio.Future[int] | None) -> WakeOutcome:
        """Until a request wants the model, or (asleep: ``exited`` given) its vLLM exits, it is
        asked to make room (an eviction, or its on-demand slot claimed for another model), or it
        has slept ``--sleep-unload-after`` (then it is stopped for real)."""
        unload_after = self.s.sleep_unload_seconds()
        while not self.board.waking:
            if self._stop.is_set():
                return StopAsked()
            timeout = None
            if exited is not None:
                if exited.done():
                    return Crashed(f"vLLM exited with code {exited.result()} while asleep")
                self._evict_reason = leave_sleep(self._evict_reason, self.board.release_asked, unload_after, time.time() - self.since)
                if self._evict_reason is not None:
                    return Evicted(self._evict_reason)
                if unload_after >= 0:
                    timeout = self.since + unload_after - time.time()
            # WANT: a request; RELEASE, EVICT: asked to make room; EXPIRED: a claim looks at it (asleep, it holds its slot)
            if await self.inbox.next({Kind.WANT, Kind.RELEASE, Kind.EVICT, Kind.EXPIRED}, timeout, also=exited) is Kind.EXPIRED:
                self.board.announce()  # asleep and not asked to stop: the claim looks again
        return Wanted()

    async def _start_once(self) -> StartOutcome:
        """Launch and wait until ready.

        Races three things: the child exiting (fail fast), the deadline (pushed back
        while the child's output shows loading progress), and readiness.
        """
        try:
            # the count first: an adapter created from here on is looked at once vLLM is ready (_watch)
            self._lora_version, self._lora_wanted = self.board.adapters_version, None
            self._lora = await asyncio.to_thread(self.lora_plan)
            if self._lora.modules:
                mode = lora_mode(self.s, self.spec)
                log.info("lora_mode", model=self.served_name, mode=mode.mode, why=mode.why, adapters=sorted(self._lora.modules))
            if self._lora.speculative:  # a created model's DRAFT (models/modelfile_v033.py)
                log.info("speculative_decoding", model=self.served_name, config=self._lora.speculative)
            env = vllm_env(self.s, self.spec, sleep_mode=self.sleep_mode, lora=self._lora)
            self.child = await VllmProcess.launch(self.argv(), env=env, model=self.served_name, state_dir=self.s.state_dir)
        except OSError as e:
            # not there or not executable: no restart can fix it, only a new configuration
            self.config_error = f"cannot run {self.s.vllm_executable!r}: {e.strerror or e}"
            return Misconfigured(self.config_error)
        child = self.child
        self._publish()
        started = time.monotonic()
        exited = asyncio.ensure_future(child.wait())
        try:
            while True:
                if exited.done():
                    await child.drained(0.2)  # the output pumps catch the last lines
                    cannot = start_error(exited.result(), list(child.last_lines))
                    if cannot is not None:  # a restart would only repeat it (start_errors.py)
                        self.config_error = cannot
                        return Misconfigured(cannot)
                    return Crashed(f"vLLM exited with code {exited.result()} during startup")
                deadline = max(started + self.s.startup_timeout, child.last_progress + self.s.startup_progress_extension)
                if time.monotonic() > deadline:
                    return Crashed(f"vLLM was not ready after {time.monotonic() - started:.0f} s")
                if await probes.health(self._probe) == 200 and await probes.serves(self._probe, self.served_name):
                    log.info("ready", model=self.served_name, startup_s=round(time.monotonic() - started, 1))
                    self.board.start_seconds = time.monotonic() - started
                    if self.engine_cpus:
                        cpus = self.engine_cpus
                        await asyncio.to_thread(lambda: pin_engine_cores(child.session_pids(), cpus, self.served_name))
                    return Healthy()
                if await self._first(exited, self.s.startup_poll_interval) is Kind.STOP:
                    return StopAsked()
        finally:
            exited.cancel()

    async def _watch(self) -> WatchOutcome:
        """Watch a ready vLLM until it must restart (it exited, failed its health checks, or hangs:
        ``hang.py`` judges each look at its load), its keep_alive ended (or an eviction was asked) with
        nothing running, a new adapter needs a restart (:meth:`_lora_outgrown`), or stop is asked. A model
        vllama's own requests no longer use sleeps (or stops) at the end of its keep_alive (``vllama stop``)
        when vLLM's load lets it (``EngineWatch.idle``).
        """
        child = self.child
        assert child is not None
        exited = asyncio.ensure_future(child.wait())
        failed_polls = 0
        engine = EngineWatch(self.s.hang_timeout, self.s.health_interval, time.monotonic())
        asked: asyncio.Task[tuple[bool, str]] | None = None  # the hang check's request (probes.answers), while it runs
        if self.board.adapters_version != self._lora_version:
            self.inbox.post(Kind.ADAPTERS)  # an adapter created while it started or slept (its message unheard then): look now
        hearing = False
        try:
            while True:
                # IDLE while a created adapter's restart waits for the base's requests to end (_lora_outgrown):
                # only then does the end of its last request ring (StatusBoard.hearing_idle)
                if hearing != (self._lora_wanted is not None):
                    hearing = not hearing
                    self.board.listen_idle(hearing)
                    if hearing and self.board.in_flight == 0:
                        self.inbox.post(Kind.IDLE)  # it ended before it was heard: look now
                kinds = _WATCHED | {Kind.IDLE} if hearing else _WATCHED
                told = await self._first(exited, self.s.health_interval, kinds)
                if told is Kind.STOP:
                    return StopAsked()
                if exited.done():
                    return Crashed(f"vLLM exited with code {exited.result()}")
                code = await probes.health(self._probe)
                failed_polls = 0 if code == 200 else failed_polls + 1
                if failed_polls >= self.s.unhealthy_threshold:
                    return Crashed(f"/health failed {failed_polls} times in a row (last: {code or 'unreachable'})")
                if await self._lora_outgrown():
                    return LoraOutgrown()
                # An eviction asked during the probe below is weighed at the next look (its EVICT
                # message ends the wait at once), never cleared unseen: nobody would tell the model
                # waiting for room, which waited for --load-timeout (a CI hang under load).
                evict = self._evict_reason
                expired = evict is not None or time.time() >= self.board.expires_at
                if self.s.hang_timeout > 0 or expired:
                    load = await probes.load(self._probe)
                    now = time.monotonic()
                    engine.saw(load, now)
                    if expired and load is not None and not self.board.in_use and engine.idle(load, now):
                        if load.pending:
                            log.info("engine_gauge_ignored", model=self.served_name, pending=load.pending,
                                     still_s=round(now - engine.moved_at, 1),
                                     why="no request of vllama's in flight and no token generated since the last look")
                        return Idle()
                    if evict is not None and self.board.in_flight + self.board.waiters > 0:
                        # busy: declined; the pool looks for another model to evict when its requests
                        # end (IDLE). Idle here but not by vLLM's count (or /metrics unread): asked still.
                        log.info("eviction_declined", model=self.served_name, reason=str(evict), in_flight=self.board.in_flight,
                                 waiting=self.board.waiters)
                        self._evict_reason = None
                    if load is not None and self.s.hang_timeout > 0:
                        answer = None
                        if asked is not None and asked.done():
                            answer, asked = asked.result(), None
                        look = engine.judge(load, now, asking=asked is not None, answer=answer)
                        if look.stale is not None:
                            (log.warning if look.first else log.info)(
                                "engine_gauge_stale", model=self.served_name, **look.stale,
                                why="vLLM's gauge says requests are pending and no token came, but vllama's own request "
                                "was answered: not restarted")
                        if look.hung is not None:
                            return Crashed(look.hung)
                        if look.cancel and asked is not None:
                            asked.cancel()  # tokens came, or nothing is pending: the engine works
                            asked = None
                        if look.ask:
                            asked = asyncio.ensure_future(probes.answers(
                                self._asker, self.served_name, pooling=pooling(self.spec.args())))
                if told in (Kind.RELEASE, Kind.EXPIRED):  # asked to make room for a claim, and in use: declined
                    self.board.clear_release()
                    self.board.announce()  # the claim looks again
        finally:
            exited.cancel()
            if asked is not None:
                asked.cancel()
            if hearing:
                self.board.listen_idle(False)

    async def _lora_outgrown(self) -> bool:
        """Whether vLLM must restart now for an adapter created since it started (``models/adapters.py``:
        ``LoraPlan.needs_restart``: not declared at launch, or larger LoRA limits).

        The created models are read only when the board's adapter count moved (a create's ``ADAPTERS``
        message, ``StatusBoard.adapters_changed``), never on the health probe's clock (the
        create waited for that clock, 5 s, and every model read ``created.json`` and its adapters'
        configs every 5 s). In ``launch`` mode the restart is due at once (busy or not: it drains,
        :meth:`_drain`); in ``runtime`` mode, where only the LoRA limits can ask for it, once vLLM is
        idle: the ``IDLE`` of its last request, or a later probe, looks again. A drain that timed out
        is tried again at the next probe or ``IDLE``. An adapter created through another vllama that
        shares the state directory rings no bell here: this vLLM declares it at its next start.
        """
        version = self.board.adapters_version
        read = version != self._lora_version
        if not read and self._lora_wanted is None:
            return False  # the watch's usual look: nothing created, nothing read
        mode = lora_mode(self.s, self.spec).mode
        wanted = self._lora_wanted
        if read:
            self._lora_version = version
            wanted = await asyncio.to_thread(self.lora_plan)
        decision = lora_restart(self._lora, wanted, read=read, mode=mode, in_use=self.board.in_use)
        self._lora_wanted = decision.wanted
        if decision.waits and decision.wanted is not None:
            log.info("lora_restart_waits", model=self.served_name, adapters=sorted(decision.wanted.modules),
                     until="its requests end (--adapters runtime restarts only an idle vLLM)", in_flight=self.board.in_flight)
        return decision.now

    async def _first(self, exited: asyncio.Future[int], timeout: float, kinds: frozenset[Kind] | set[Kind] = frozenset()) -> Kind | None:
        """Wait for the child's exit, a message of ``kinds`` or stop, or ``timeout`` (the next
        probe of vLLM); the message (``STOP`` once stop was asked), else ``None``."""
        told = await self.inbox.next(kinds, timeout, also=exited)
        return Kind.STOP if self._stop.is_set() else told

    async def _sleep_or_stop(self, delay: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), delay)
            return True
        except asyncio.TimeoutError:
            return False

    async def _stop_child(self) -> None:
        child, self.child = self.child, None
        if child is None:
            self.pool.released(self)
            return
        pids = set(await asyncio.to_thread(child.session_pids))
        await child.stop(self.s.stop_grace)
        log.info("vllm_stopped", pid=child.pid, returncode=child.returncode)
        if self.s.gpu_check and pids:
            released = await asyncio.to_thread(gpu.wait_released, pids, self.s.gpu_release_timeout)
            if not released:
                log.warning("gpu_memory_not_released", pids=sorted(pids), timeout_s=self.s.gpu_release_timeout)
        self.pool.released(self)  # only now: the next model's vLLM checks free memory when it starts
