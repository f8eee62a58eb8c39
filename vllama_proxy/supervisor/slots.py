"""On-demand slots: the supervisors that run local models no ``--model`` or ``[[models]]`` names.

Ollama starts any local model the moment a request names it. vllama's workers are spawned with the
status boards they gate requests on, so on-demand models get ``max_on_demand`` slots from the start,
each a board, a loopback port and one supervisor in the main process. A request for a local model no
slot holds *claims* one in whichever process it arrives: under one lock, an empty slot, else the least
recently used one whose model is unloaded (or failed) and unused, and writes the model's name and
:class:`ModelConfig` there; the slot's supervisor reads it when it wakes (:meth:`SlotTable.spec`). A
loaded model keeps its slot until its keep_alive ends or the pool evicts it; with every slot in use,
a request for another model gets a 503 naming them.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from vllama_proxy.ipc.arrays import spawn_context
from vllama_proxy.errors import SlotsFull, UpstreamUnavailable
from vllama_proxy.models.launch_spec import ModelConfig
from . import eviction
from .eviction import Candidate, Held, Need
from .inbox import Kind
from vllama_proxy.ipc.lock import SharedLock
from .states import State
from .status import StatusBoard

#: Bytes for a slot's model (its ``ModelConfig`` as JSON).
_SPEC_BYTES = 16384


class SlotTable:
    """The on-demand slots, in shared memory (create before spawning the proxy processes).

    Args:
        count: how many slots (models loaded or asleep at once, on demand).
        ports: the loopback port of each slot's vLLM.
        workers: proxy processes (each counts its requests in its own board slot).
        keep_alive: the default keep_alive of on-demand models, seconds.
    """

    def __init__(self, count: int, ports: list[int], *, workers: int, keep_alive: float, ctx: Any = None) -> None:
        ctx = spawn_context(ctx)
        assert len(ports) == count
        self.ports = list(ports)
        self.boards = [StatusBoard("", ctx, workers=workers, keep_alive=keep_alive, initial=State.UNLOADED) for _ in range(count)]
        self._specs = [ctx.RawArray("c", _SPEC_BYTES) for _ in range(count)]
        self._generation = ctx.RawArray("i", count)
        self._lock = SharedLock()

    def __len__(self) -> int:
        return len(self.boards)

    def find(self, name: str) -> int | None:
        """The slot holding served name ``name`` (any case), if any."""
        folded = name.casefold()
        return next((i for i, b in enumerate(self.boards) if b.served_name and b.served_name.casefold() == folded), None)

    def spec(self, index: int) -> ModelConfig | None:
        """The model slot ``index`` holds (``None``: empty)."""
        raw = self._specs[index].value
        return ModelConfig.model_validate_json(raw) if raw else None

    def generation(self, index: int) -> int:
        """Bumped each time slot ``index`` takes another model."""
        return self._generation[index]

    def claim(self, spec: ModelConfig) -> int:
        """The slot that serves ``spec.served_name``: the one holding it, else one taken for it.

        Raises:
            SlotsFull: every slot holds a model that is loaded, loading or in use (503); the caller
                may free one with :meth:`evict_idle` and try again once it is unloaded (:meth:`leaving`).
        """
        with self._lock.held():
            found = self.find(spec.served_name)
            if found is not None:
                return found
            free = [i for i, b in enumerate(self.boards) if self._reusable(b)]
            if not free:
                held = ", ".join(f"{b.served_name} ({b.state.value})" for b in self.boards)
                raise SlotsFull(
                    f"cannot load '{spec.served_name}': all {len(self.boards)} on-demand models are loaded or in use "
                    f"({held}); retry when one is idle (keep_alive), unload one (keep_alive 0), or raise --max-on-demand")
            i = min(free, key=lambda k: (bool(self.boards[k].served_name), self.boards[k].last_used))
            raw = spec.model_dump_json(exclude_defaults=True).encode()
            if len(raw) >= _SPEC_BYTES:
                raise UpstreamUnavailable(f"cannot load '{spec.served_name}': its vLLM arguments are too long")
            self._specs[i].value = raw
            self.boards[i].served_name = spec.served_name
            self._generation[i] += 1
        self.boards[i].inbox_bell.ring(Kind.RESPEC)  # its supervisor runs the new model from its next step
        return i

    def vacate(self, name: str) -> bool:
        """Empty the slot holding served name ``name`` if its model is unloaded and unused (:meth:`reusable`):
        it is no longer listed or found (``/api/delete`` of a model it held); whether one was emptied. Its
        supervisor, idle while unloaded, takes the next model :meth:`claim` gives the slot."""
        with self._lock.held():
            i = self.find(name)
            if i is None or not self._reusable(self.boards[i]):
                return False
            self._specs[i].value = b""
            self.boards[i].served_name = ""
            self._generation[i] += 1
            return True

    def leaving(self) -> bool:
        """Whether some slot's model is on its way out, idle: a ready one whose keep_alive has ended,
        or an asleep one asked to stop (:meth:`evict_idle`); its supervisor unloads it at its next check."""
        now = time.time()
        return any(b.served_name and b.in_flight == 0 and b.waiters == 0
                   and ((b.state is State.READY and b.expires_at <= now) or (b.state is State.SLEEPING and b.release_asked))
                   for b in self.boards)

    def evict_idle(self, *, kept: bool = True) -> str | None:
        """Free the least recently used slot whose model is loaded (ready, or asleep with vLLM's sleep
        mode) and idle: no request in flight, waiting for or asking for it; its name, or ``None`` when
        none is idle. As Ollama unloads the least recently used runner for a new model: a ready one's
        keep_alive ends now (:meth:`StatusBoard.expire`; with sleep mode it goes to sleep first), and
        either is asked to stop (:meth:`StatusBoard.request_release`, which also names the reason in
        its supervisor's log). ``kept`` false: a ready model within its keep_alive is not evicted (a user key's
        claim: it does not end another key's keep_alive)."""
        held = {State.READY: Held.LOADED, State.SLEEPING: Held.ASLEEP}
        now = time.time()
        seen = [(b, b.state) for b in self.boards if b.served_name]  # each state read once: it may change meanwhile
        victim = eviction.victim(Need.SLOT, [Candidate(b, held[state], b.last_used, busy=b.in_use,
                                                       protected=not kept and state is State.READY and b.expires_at > now)
                                             for b, state in seen if state in held])
        if victim is None:
            return None
        if victim.state is not State.SLEEPING:
            victim.expire()
        victim.request_release()  # its supervisor logs why: the slot is wanted, not a keep_alive that ended
        return victim.served_name

    def kept_until(self) -> float:
        """Epoch seconds when the first ready slot model's keep_alive ends (inf: none ends)."""
        return min((b.expires_at for b in self.boards if b.served_name and b.state is State.READY), default=math.inf)

    def hurry_leaving(self) -> None:
        """Ask the supervisors of the ready models :meth:`leaving` counts to look at their keep_alive now
        (``StatusBoard.hurry``): each answers by unloading or by declining (used again), so a claim
        waiting on them (:meth:`changed`) learns either way."""
        now = time.time()
        for b in self.boards:
            if b.served_name and b.state is State.READY and b.expires_at <= now and not b.release_asked:
                b.hurry()

    async def changed(self, worker: int, timeout: float) -> None:
        """Until a slot's supervisor publishes its status or answers a release (``StatusBoard.announce``),
        at most ``timeout`` seconds; ``worker``: the calling proxy process."""
        news = [b.news(worker) for b in self.boards]
        try:
            await asyncio.wait(news, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in news:
                f.cancel()

    def reusable(self, index: int) -> bool:
        """Whether slot ``index`` is empty or its model unloaded (or failed) and unused: nothing of it
        is loaded, loading or wanted, so its weights may go (``/api/delete``)."""
        return self._reusable(self.boards[index])

    @staticmethod
    def _reusable(board: StatusBoard) -> bool:
        """Empty, or its model unloaded (or failed) with no request using, waiting for or asking for it."""
        if not board.served_name:
            return True
        return (board.state in (State.UNLOADED, State.FAILED) and board.in_flight == 0 and board.waiters == 0
                and not board.waking and not board.loading)
