"""The supervisor's status in shared memory: one writer (the supervisor), any number of readers.

Every proxy process (``--workers N``) gates requests, answers ``/readyz`` and
reports ``/api/ps`` memory from this board, so all of them tell the same story
as the one process that owns vLLM. Reads are plain loads from shared memory:
no lock, no message passing on the request path.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import time
from typing import Any

from ..errors import UpstreamUnavailable
from . import gpu
from .child import session_members
from .states import State

_STATES = list(State)


class StatusBoard:
    """Supervisor status readable from other processes (create before spawning them).

    Attributes written by :meth:`publish`: state, since (epoch s), restarts, vLLM's pid,
    last error and the child's last output lines.
    """

    def __init__(self, served_name: str, ctx: Any = None) -> None:
        ctx = ctx or multiprocessing.get_context("spawn")
        self.served_name = served_name
        self._state = ctx.RawValue("i", _STATES.index(State.STARTING))
        self._since = ctx.RawValue("d", time.time())
        self._restarts = ctx.RawValue("i", 0)
        self._pid = ctx.RawValue("i", 0)
        self._expires = ctx.RawValue("d", 0.0)  # epoch s when keep_alive ends; inf: never; 0: not loaded yet
        self._wake = ctx.RawValue("i", 0)  # set by any process that needs a sleeping/unloaded model
        self._error = ctx.RawArray("c", 4096)
        self._output = ctx.RawArray("c", 16384)

    def publish(self, state: State, *, since: float, restarts: int, pid: int | None, last_error: str | None, last_output: str) -> None:
        """Write the supervisor's current status (called by the supervisor only)."""
        self._error.value = (last_error or "").encode()[: len(self._error) - 1]
        self._output.value = last_output.encode()[-(len(self._output) - 1) :]
        self._restarts.value = restarts
        self._pid.value = pid or 0
        self._since.value = since
        self._state.value = _STATES.index(state)  # last: readers see a complete record for it

    @property
    def state(self) -> State:
        return _STATES[self._state.value]

    @property
    def ready(self) -> bool:
        return _STATES[self._state.value] is State.READY

    @property
    def restarts(self) -> int:
        return self._restarts.value

    @property
    def available(self) -> bool:
        """Ready now, or loadable on demand (sleeping/unloaded): what ``/readyz`` reports as ready."""
        return _STATES[self._state.value] in (State.READY, State.SLEEPING, State.UNLOADED)

    # -- keep_alive (Ollama semantics: per request, negative = forever, 0 = unload now) --------
    def touch(self, keep_alive_s: float) -> None:
        """A request used the model: it stays loaded ``keep_alive_s`` seconds from now."""
        self._expires.value = math.inf if keep_alive_s < 0 else time.time() + keep_alive_s

    @property
    def expires_at(self) -> float:
        """Epoch seconds when the keep-alive ends (``inf``: never)."""
        return self._expires.value

    def request_wake(self) -> None:
        """Ask the supervisor (in whichever process) to wake or reload the model."""
        self._wake.value = 1

    def take_wake(self) -> bool:
        """The supervisor's side: whether a wake was requested (and clear the request)."""
        if self._wake.value:
            self._wake.value = 0
            return True
        return False

    @property
    def waking(self) -> bool:
        return bool(self._wake.value)

    async def wait_ready(self, timeout: float) -> None:
        """Wake a sleeping or unloaded model if needed and wait until it serves.

        Polls shared memory (any worker process may call this): the cold path only.

        Raises:
            UpstreamUnavailable: not ready within ``timeout`` s, or vLLM failed or is stopping.
        """
        deadline = time.monotonic() + timeout
        while not self.ready:
            state = self.state
            if state in (State.SLEEPING, State.UNLOADED):
                self.request_wake()
            elif state in (State.FAILED, State.STOPPING, State.STOPPED, State.UNHEALTHY):
                raise UpstreamUnavailable(self.unavailable_message())
            if time.monotonic() > deadline:
                raise UpstreamUnavailable(self.unavailable_message())
            await asyncio.sleep(0.02)

    @property
    def last_error(self) -> str | None:
        return self._error.value.decode(errors="replace") or None

    def unavailable_message(self) -> str:
        """Why requests cannot be served now, for a 503."""
        state = self.state
        if state is State.FAILED:
            return f"model '{self.served_name}' failed to load: {self.last_error}"
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
