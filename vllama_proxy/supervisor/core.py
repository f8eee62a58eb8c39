"""The supervisor: launches ``vllm serve``, waits for it, watches it, restarts it, stops it.

One task (:meth:`Supervisor._run`) owns the state (``states.py``) and every
transition; callers wait with :meth:`Supervisor.ensure_ready` or read
:meth:`Supervisor.status`. Patterns from Ollama's ``llm/server.go``
``WaitUntilRunning`` (startup deadline pushed back while loading progresses; the
child's last output shown on failure) and llama-swap's process owner loop.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from typing import Any

import psutil

from vllama_proxy.models.adapters import LoraPlan, lora_plan
from vllama_proxy.models.launch_spec import ModelConfig, has_flag
from vllama_proxy.models.created import CreatedStore
from vllama_proxy.models.model_files import read_model_files
from . import gpu, probes
from .child import VllmProcess, find_executable
from ..errors import UpstreamError, UpstreamUnavailable
from ..logs import get_logger
from .placement import pin_engine_cores
from ..settings import Settings
from .states import TRANSITIONS, InvalidTransition, State
from .status import StatusBoard
from .warm import compile_cache
from ..upstream import Upstream, read_response

log = get_logger("vllama.supervisor")

_EXPIRED = object()  # _watch: the keep_alive ended and nothing is running
_RELOAD = object()  # _serve: vLLM was stopped (keep_alive or eviction); start it afresh when wanted
_LORA = object()  # _watch: an adapter created since the start needs larger LoRA limits (models/adapters.py)


#: A host that can never resolve (RFC 6761 ``.invalid``): vLLM's domain allow-list with only
#: this in it lets no media URL through.
NO_MEDIA_DOMAIN = "media-fetching-is-off.invalid"


def media_args(allowed: list[str], vllm_args: list[str]) -> list[str]:
    """vLLM flags limiting which hosts it fetches media URLs from (``/v1/*`` requests can name
    ``image_url``s; vLLM's ``MediaConnector`` fetches them server-side, a request-forgery hole
    on a shared server). ``allowed`` empty: none (the allow-list holds one unresolvable host);
    ``["*"]``: any (no flag, vLLM's default). Left to the user's own ``--allowed-media-domains``
    after ``--`` when given. Local files stay off as in vLLM (no ``--allowed-local-media-path``).
    Redirects are turned off in :meth:`Supervisor._start_once`'s environment."""
    if "*" in allowed or has_flag(vllm_args, "--allowed-media-domains"):
        return []
    return ["--allowed-media-domains", *(allowed or [NO_MEDIA_DOMAIN])]


def usage_error(returncode: int, lines: list[str]) -> str | None:
    """vLLM's message when it exited because it rejected its command line, else ``None``.

    vLLM parses ``vllm serve``'s arguments with argparse, which prints ``usage: vllm serve
    ...`` and ``vllm serve: error: <why>`` and exits with status 2.
    """
    if returncode != 2:
        return None
    errors = [line.strip() for line in lines if ": error: " in line]
    if not errors or not any(line.lstrip().startswith("usage:") for line in lines):
        return None
    return errors[-1]


class Supervisor:
    """Keeps one ``vllm serve`` healthy on a private loopback port.

    Args:
        settings: vllama settings (executable, timeouts, backoff).
        spec: the model: what vLLM loads, its served name, arguments, GPUs and policy.
        port: the loopback port vLLM listens on; only the proxy is exposed.
        board: where the status is published for every proxy process; its state at
            construction is the initial one (``unloaded``: loaded on the first request).
        pool: the model pool that decides whether the model fits on its GPUs before each
            start or wake (``None``: it always fits).
        engine_cpus: one CPU set per engine core, applied each time vLLM becomes ready
            (``placement.py``; ``None``: the kernel places them).
        slot: ``(table, index)`` for an on-demand slot (``slots.py``): ``spec`` is a placeholder and
            the model is whatever the slot holds when a request wakes it.
        prepare: applied to each model a slot takes (the front end's ``--api-server-count``, as for
            configured models: ``sizing.with_api_servers``).
    """

    def __init__(self, settings: Settings, spec: ModelConfig, *, port: int, board: StatusBoard, pool: Any = None,
                 engine_cpus: list[list[int]] | None = None, slot: tuple[Any, int] | None = None,
                 prepare: Callable[[ModelConfig], ModelConfig] | None = None) -> None:
        self.s = settings
        self.slot = slot
        self.prepare = prepare
        self._generation = 0
        self.engine_cpus = engine_cpus
        self.spec = spec
        self.port = port
        self.board = board
        self.pool = pool
        self.served_name = spec.served_name
        self.state = board.state
        self.since = time.time()
        self.last_error: str | None = None
        self.last_output: str = ""
        self.restarts = 0
        self.child: VllmProcess | None = None
        #: Whether its GPU memory share counts as taken (set by the pool on admission; false once stopped or asleep).
        self.holds_gpu = False
        self._loading = False  # the current start or wake was asked for by requests
        self._evict_reason: str | None = None
        #: vLLM's own message when it rejected its arguments (a usage error): a configuration error.
        self.config_error: str | None = None
        self._weights_bytes: int | None = None
        self._probe = Upstream(f"http://127.0.0.1:{port}", connect_timeout=2.0, read_timeout=settings.health_timeout)
        self._changed = asyncio.Event()
        self._poke = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[State, str | None], Any]] = []
        #: models made with /api/create (their LoRA adapters set this vLLM's LoRA limits), and the plan it runs with
        self._created = CreatedStore(settings.state_dir / "created.json")
        self._lora = LoraPlan()

    # -- public API ----------------------------------------------------------------
    def argv(self) -> list[str]:
        """The child's command line (no shell): vLLM bound to loopback on the private port, media
        fetching limited (:func:`media_args`); with LoRA adapters of created models, their
        arguments and one API server (vLLM refuses runtime adapter loading with several)."""
        args = self.spec.args()
        lora = self._lora.args()
        if lora:
            args = [a for i, a in enumerate(args) if a != "--api-server-count" and (i == 0 or args[i - 1] != "--api-server-count")
                    and not a.startswith("--api-server-count=")] + ["--api-server-count", "1"]
        return [
            find_executable(self.s.vllm_executable) or self.s.vllm_executable, "serve", self.spec.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", self.served_name,
            *media_args(self.s.allowed_media_domains, args),
            *args,
            *lora,
        ]

    def lora_plan(self) -> LoraPlan:
        """The LoRA plan the adapters known now ask for (``models/adapters.py``)."""
        return lora_plan(self._created.current().values(), self.served_name)

    async def start(self) -> None:
        """Begin supervising (returns at once; vLLM loads in the background)."""
        await self._probe.start()
        if self.slot is None:  # an empty on-demand slot has nothing to say yet
            log.info("state", model=self.served_name, to=self.state.value,
                     reason="launching" if self.state is State.STARTING else "loads on demand")
        self._task = asyncio.create_task(self._run(), name=f"supervisor:{self.served_name}")

    async def stop(self) -> None:
        """Stop vLLM's whole process tree and end supervision (idempotent)."""
        self._stop.set()
        if self._task is not None:
            await self._task
        await self._probe.close()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    def evict(self, reason: str) -> None:
        """Ask the owner loop to sleep or stop vLLM now if it is idle (no request in flight);
        a sleeping vLLM is stopped (it still holds its CUDA context).

        Used by the pool to make room for another model; a busy model ignores it.
        """
        if self.state in (State.READY, State.SLEEPING) and self._evict_reason is None:
            log.info("evicting", model=self.served_name, reason=reason)
            self._evict_reason = reason
            self._poke.set()

    @property
    def evicting(self) -> bool:
        """An eviction was asked for and is not finished."""
        return self._evict_reason is not None

    async def ensure_ready(self, timeout: float) -> None:
        """Wait until vLLM is ready.

        Raises:
            UpstreamUnavailable: not ready within ``timeout`` seconds, vLLM is in a crash loop
                (``failed``), or supervision stopped.
        """
        deadline = time.monotonic() + timeout
        while self.state is not State.READY:
            if self.state in (State.STOPPING, State.STOPPED):
                raise UpstreamUnavailable(f"vLLM is {self.state.value}")
            if self.state is State.FAILED:  # a crash loop: say so now, not at the timeout
                raise self.board.unavailable()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.board.unavailable()
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    # -- the owner loop ------------------------------------------------------------------
    def _set(self, new: State, reason: str | None = None) -> None:
        if new not in TRANSITIONS[self.state]:
            raise InvalidTransition(f"{self.state.value} -> {new.value}")
        log.info("state", model=self.served_name, **{"from": self.state.value, "to": new.value, "reason": reason})
        self.state = new
        if new is not State.READY:
            self._evict_reason = None  # an eviction asked of a ready vLLM is over (done, or it died)
        self.since = time.time()
        self._publish()
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in self.listeners:
            listener(new, reason)

    def _publish(self) -> None:
        self.board.publish(
            self.state,
            since=self.since,
            restarts=self.restarts,
            pid=self.child.pid if self.child else None,
            last_error=self.last_error,
            last_output=self.last_output,
            loading=self._loading,
        )

    async def _run(self) -> None:
        failures = 0
        on_demand = self.state is State.UNLOADED
        try:
            while not self._stop.is_set():
                if self._respec() and self.state is not State.UNLOADED:
                    self._set(State.UNLOADED, f"the slot now holds {self.served_name}")  # from failed or restarting
                if self.state is State.UNLOADED:
                    if not await self._wait_wake(None):
                        break
                    self._respec()
                    on_demand = True
                if not await self._admit(on_demand):
                    if self._stop.is_set():
                        break
                    # No room on its GPUs: loaded on demand later (then idle models make room).
                    self._loading = False
                    if self.state is State.UNLOADED:
                        self._publish()
                        await self._sleep_or_stop(0.2)  # the demand lapsed or the wait timed out
                    else:
                        self._set(State.UNLOADED, self.last_error)
                    continue
                self._loading = on_demand
                if self.state is not State.STARTING:
                    self._set(State.STARTING, "requested" if on_demand else None)
                else:
                    self._publish()
                reason = await self._start_once()
                if self._stop.is_set():
                    break
                if self.config_error is not None:
                    # vLLM's argparse refused its command line: no restart can fix that, only a new
                    # configuration does. Failed at once, with vLLM's own message (issue 19.9).
                    self._loading = False
                    self.last_error = reason
                    self.last_output = self.child.tail() if self.child else ""
                    log.error("vllm_cannot_start", model=self.served_name, error=self.config_error,
                              argv=self.argv())
                    await self._stop_child()
                    self._set(State.FAILED, reason)
                    if self.slot is None or not await self._wait_respec():
                        await self._stop.wait()
                        break
                    continue  # an on-demand slot: it now holds another model
                if reason is None:
                    self._keep_alive_from_now()
                    self._loading = False  # the start requests asked for is over (as after a wake)
                    self._set(State.READY)
                    ready_at = time.monotonic()
                    reason = await self._serve()
                    if reason is None:
                        break  # stop requested
                    if reason is _LORA:  # closed to requests by _serve: stop, then start anew with the larger limits
                        await self._stop_child()
                        self.board.reopen()
                        self._set(State.UNLOADED, "restarting with larger LoRA limits for a new adapter")
                        reason = _RELOAD
                    if reason is _RELOAD:
                        failures = 0
                        on_demand = True
                        continue  # unloaded by keep_alive or eviction: started afresh when requested
                    self._loading = False
                    self._set(State.UNHEALTHY, reason)
                    if time.monotonic() - ready_at >= self.s.restart_reset_after:
                        failures = 0
                self._loading = False
                on_demand = False
                failures += 1
                self.last_error = reason
                self.last_output = self.child.tail() if self.child else ""
                log.warning("vllm_failed", model=self.served_name, reason=reason, failures=failures, last_output=self.last_output)
                await self._stop_child()
                if failures >= self.s.crash_loop_limit:
                    self._set(State.FAILED, reason)
                    delay = self.s.failed_retry_interval
                else:
                    self._set(State.RESTARTING, reason)
                    delay = min(self.s.restart_backoff_initial * 2 ** (failures - 1), self.s.restart_backoff_max)
                if await self._sleep_or_stop(delay):
                    break
                self.restarts += 1
        finally:
            self._loading = False
            if self.state is not State.STOPPED:
                if self.state is not State.STOPPING:
                    self._set(State.STOPPING)
                await self._stop_child()
                self._set(State.STOPPED)

    def _respec(self) -> bool:
        """An on-demand slot took another model since it was last read: run that one from now on."""
        if self.slot is None:
            return False
        table, index = self.slot
        generation = table.generation(index)
        if generation == self._generation:
            return False
        spec = table.spec(index)  # parsed only when the slot took another model
        if spec is None:
            return False
        self._generation = generation
        if self.prepare is not None:
            spec = self.prepare(spec)
        self.spec, self.served_name = spec, spec.served_name
        self.config_error = self.last_error = None
        self.last_output = ""
        self.restarts = 0
        self._weights_bytes = None
        log.info("on_demand_model", slot=index, model=self.served_name, repo=spec.model, vllm_args=spec.args())
        return True

    async def _wait_respec(self) -> bool:
        """Until the slot takes another model (True) or supervision stops (False)."""
        table, index = self.slot
        while table.generation(index) == self._generation:
            if await self._sleep_or_stop(0.1):
                return False
        return True

    async def _admit(self, on_demand: bool) -> bool:
        """Whether vLLM may take its GPU memory now (see ``pool.ModelPool.make_room``)."""
        if self.pool is None:
            self.holds_gpu = True
            return True
        return await self.pool.make_room(self, on_demand=on_demand)

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

    async def _can_sleep(self) -> bool:
        """Sleep mode is on and host RAM can take the weights (vLLM level 1 copies them to CPU
        memory) with ``sleep_host_memory_reserve`` to spare; else vLLM is stopped instead."""
        if not self.sleep_mode:
            return False
        if self._weights_bytes is None:
            self._weights_bytes = (await asyncio.to_thread(read_model_files, self.spec.model, self.served_name)).size
        available = psutil.virtual_memory().available
        if available < self._weights_bytes + self.s.sleep_host_memory_reserve:
            log.warning("host_memory_short", model=self.served_name, available=available, weights=self._weights_bytes)
            return False
        return True

    async def _serve(self) -> object:
        """Serve a ready vLLM through keep_alive cycles.

        Returns ``None`` when asked to stop, ``_RELOAD`` when vLLM was stopped (keep_alive
        or eviction) and is wanted again (start it afresh), or the reason it must restart.
        """
        while True:
            reason = await self._watch()
            if reason is _LORA:
                if self.board.try_close():
                    return _LORA
                continue  # a request came in: the next check tries again
            if reason is not _EXPIRED:
                return reason
            # Close the model to new requests only if none is in flight or waiting (one atomic step
            # with the requests' own check, status.py); a request renewed keep_alive: keep serving.
            why = self._evict_reason or "keep_alive expired"
            renewed = self._evict_reason is None and time.time() < self.board.expires_at
            if renewed or not self.board.try_close():
                self._evict_reason = None
                continue
            if self._evict_reason is None and time.time() < self.board.expires_at:
                self.board.reopen()  # a request ended (and renewed keep_alive) just before the close
                continue
            try:
                if not await self._can_sleep():
                    await self._stop_child()
                    self._set(State.UNLOADED, why)
                    return _RELOAD
                try:
                    async with self._probe.request("POST", "/sleep", params={"level": "1"}) as resp:
                        await read_response(resp)
                except UpstreamError as e:
                    return f"vLLM failed to go to sleep: {e.message}"
                self.holds_gpu = False
                self._set(State.SLEEPING, why)
            finally:
                self.board.reopen()
                self._evict_reason = None
            if time.time() < self.board.expires_at and not why.startswith("evicted"):
                self.board.request_wake()  # a request arrived while we were putting vLLM to sleep
            child = self.child
            assert child is not None
            exited = asyncio.ensure_future(child.wait())
            try:
                while True:
                    if not await self._wait_wake(exited):
                        if self._stop.is_set():
                            return None
                        if not exited.done() and self._evict_reason is not None:
                            why = self._evict_reason  # asleep, yet in the way: stop it outright
                            await self._stop_child()
                            self.board.clear_release()  # done (asked until now: the slot's claimant waits on it)
                            self._set(State.UNLOADED, why)
                            return _RELOAD
                        return f"vLLM exited with code {exited.result()} while asleep"
                    self._evict_reason = None  # wanted again: whatever was asked before no longer applies
                    if await self._admit(on_demand=True):
                        break
                    if self._stop.is_set():
                        return None
                    self._publish()  # last_error says why it could not wake
                    await self._sleep_or_stop(0.2)
            finally:
                exited.cancel()
            self._loading = True
            self._publish()
            started = time.monotonic()
            try:
                async with self._probe.request("POST", "/wake_up") as resp:
                    await read_response(resp)
            except UpstreamError as e:
                return f"vLLM failed to wake up: {e.message}"
            log.info("woke_up", model=self.served_name, seconds=round(time.monotonic() - started, 3))
            self._keep_alive_from_now()
            self._loading = False
            self._set(State.READY, "woken by a request")

    async def _wait_wake(self, exited: asyncio.Future[int] | None) -> bool:
        """Wait for a request to need the model; False if stop was requested, the child exited,
        or (asleep) an eviction was asked for."""
        while not self.board.waking:
            if exited is not None and self._evict_reason is None and self.board.release_asked:
                self._evict_reason = "its on-demand slot is wanted for another model"
            if self._stop.is_set() or (exited is not None and (exited.done() or self._evict_reason is not None)):
                return False
            await asyncio.sleep(0.02)
        return True

    async def _start_once(self) -> str | None:
        """Launch and wait until ready; ``None`` when ready, else why not.

        Races three things: the child exiting (fail fast), the deadline (pushed back
        while the child's output shows loading progress), and readiness.
        """
        try:
            # nvidia-smi's GPU numbering for every child (the pool counts GPUs by it), unless set
            env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **os.environ, **self.spec.env()}
            # an allowed media host must not redirect vLLM to one that is not (vLLM follows redirects by default)
            env.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
            # vllama's own metrics directory (--workers) is not vLLM's: with several API servers vLLM
            # makes its own, and given ours it would mix its series into vllama's /metrics and back.
            env.pop("PROMETHEUS_MULTIPROC_DIR", None)
            # vLLM's compile cache where it survives a restart (the state directory when home is read-only)
            env.update(compile_cache(self.s.state_dir, env)[2])
            if self.sleep_mode:
                env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM serves /sleep and /wake_up only then (on loopback)
            self._lora = await asyncio.to_thread(self.lora_plan)
            if self._lora.modules:
                env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # adapters created later load without a restart
            self.child = await VllmProcess.launch(self.argv(), env=env, model=self.served_name, state_dir=self.s.state_dir)
        except OSError as e:
            # not there or not executable: no restart can fix it, only a new configuration (issue 26.1)
            self.config_error = f"cannot run {self.s.vllm_executable!r}: {e.strerror or e}"
            return self.config_error
        child = self.child
        self._publish()
        started = time.monotonic()
        exited = asyncio.ensure_future(child.wait())
        try:
            while True:
                if exited.done():
                    await asyncio.sleep(0.2)  # let the output pumps catch the last lines
                    usage = usage_error(exited.result(), list(child.last_lines))
                    if usage is not None:
                        self.config_error = usage
                        return f"vLLM rejected its arguments: {usage}"
                    return f"vLLM exited with code {exited.result()} during startup"
                deadline = max(started + self.s.startup_timeout, child.last_progress + self.s.startup_progress_extension)
                if time.monotonic() > deadline:
                    return f"vLLM was not ready after {time.monotonic() - started:.0f} s"
                if await probes.health(self._probe) == 200 and await probes.serves(self._probe, self.served_name):
                    log.info("ready", model=self.served_name, startup_s=round(time.monotonic() - started, 1))
                    if self.engine_cpus:
                        cpus = self.engine_cpus
                        await asyncio.to_thread(lambda: pin_engine_cores(child.session_pids(), cpus, self.served_name))
                    return None
                if await self._first(exited, self.s.startup_poll_interval):
                    return "stopped"
        finally:
            exited.cancel()

    async def _watch(self) -> object:
        """Watch a ready vLLM; returns why it must restart, ``_EXPIRED`` when its keep_alive
        ended with nothing running, or ``None`` when asked to stop."""
        child = self.child
        assert child is not None
        exited = asyncio.ensure_future(child.wait())
        failed_polls = 0
        tokens: float | None = None
        stalled_since: float | None = None
        try:
            while True:
                if await self._first(exited, self.s.health_interval):
                    return None
                if exited.done():
                    return f"vLLM exited with code {exited.result()}"
                code = await probes.health(self._probe)
                failed_polls = 0 if code == 200 else failed_polls + 1
                if failed_polls >= self.s.unhealthy_threshold:
                    return f"/health failed {failed_polls} times in a row (last: {code or 'unreachable'})"
                idle_now = self.board.in_flight == 0 and self.board.waiters == 0 and not self.board.waking
                if idle_now and self._created.path.exists() and not self._lora.covers(await asyncio.to_thread(self.lora_plan)):
                    return _LORA
                expired = self._evict_reason is not None or time.time() >= self.board.expires_at
                if self.s.hang_timeout > 0 or expired:
                    load = await probes.load(self._probe)
                    idle = self.board.in_flight == 0 and self.board.waiters == 0 and not self.board.waking
                    if expired and load is not None and load.pending == 0 and idle:
                        return _EXPIRED
                    self._evict_reason = None  # busy: the pool looks for another model to evict
                    if load is not None and self.s.hang_timeout > 0:
                        now = time.monotonic()
                        if load.pending > 0 and load.generation_tokens == tokens:
                            stalled_since = stalled_since or now
                            if now - stalled_since >= self.s.hang_timeout:
                                return f"engine hung: {load.pending:g} requests pending, no token generated for {now - stalled_since:.0f} s"
                        else:
                            stalled_since = None
                        tokens = load.generation_tokens
        finally:
            exited.cancel()

    async def _first(self, exited: asyncio.Future[int], timeout: float) -> bool:
        """Wait for the child's exit, a stop request, an eviction, or ``timeout``; True if stop was requested."""
        stop = asyncio.ensure_future(self._stop.wait())
        poke = asyncio.ensure_future(self._poke.wait())
        try:
            await asyncio.wait({exited, stop, poke}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            poke.cancel()
            self._poke.clear()
        return self._stop.is_set()

    async def _sleep_or_stop(self, delay: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), delay)
            return True
        except asyncio.TimeoutError:
            return False

    async def _stop_child(self) -> None:
        child, self.child = self.child, None
        if child is None:
            self.holds_gpu = False
            return
        pids = set(await asyncio.to_thread(child.session_pids))
        await child.stop(self.s.stop_grace)
        log.info("vllm_stopped", pid=child.pid, returncode=child.returncode)
        if self.s.gpu_check and pids:
            released = await asyncio.to_thread(gpu.wait_released, pids, self.s.gpu_release_timeout)
            if not released:
                log.warning("gpu_memory_not_released", pids=sorted(pids), timeout_s=self.s.gpu_release_timeout)
        self.holds_gpu = False  # only now: the next model's vLLM checks free memory when it starts
