"""Room on the GPUs: what the pool answers a model that asks for it, and why a model is asked to give it up.

Plain values, no I/O. A supervisor asks its pool for room before each start or wake and gets one
verdict; the pool keeps its own record, and only the supervisor writes its state from the answer
(after llama-swap's ``Swapper``: the pool decides, the owner loop acts)::

    Admitted()                      its share is counted as taken: start or wake it now
    Refused(report)                 it cannot fit even with every evictable neighbour unloaded
    Waiting(note, ...)              not now: why (its status says so), and whom to evict for it

A model asked to give room up is told why: :class:`MakeRoom`, :class:`SlotWanted`, or :data:`KEEP_ALIVE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from vllama_proxy.models.fit import FitReport

#: The model a verdict names (the supervisor; a type variable so that this module imports none).
M = TypeVar("M")


@dataclass(frozen=True)
class Admitted:
    """The model's share of each of its GPUs (and its CUDA context) is counted as taken from now."""


@dataclass(frozen=True)
class Refused:
    """The model cannot fit on its GPUs even if every idle neighbour that may be evicted for it were
    unloaded (``models/fit.py``): launching it would only fail. ``report.message()`` gives the numbers
    and what would fit."""

    report: FitReport


@dataclass(frozen=True)
class Waiting(Generic[M]):
    """No room now. ``note``: why, for its status (a request that gives up quotes it).

    ``neighbour_loading``: another model on a shared GPU is starting or waking (vLLM sizes its KV
    cache from the memory it finds free, so starts take turns); every start waits for that. Else its
    GPUs are full: only a model that requests wait for waits (a preload or restart gives up), and
    ``victim`` is the idle neighbour to evict for it (``None``: none may be, or one is on its way out).
    """

    note: str
    neighbour_loading: bool
    victim: M | None = None


Verdict = Admitted | Refused | Waiting[M]


@dataclass(frozen=True)
class MakeRoom:
    """Evicted because a request for ``model`` needs its GPU memory (its own waiting requests, if any
    arrive meanwhile, do not wake it again at once)."""

    model: str

    def __str__(self) -> str:
        return f"evicted to make room for {self.model}"


@dataclass(frozen=True)
class SlotWanted:
    """Asleep in an on-demand slot that a request claimed for another model: stopped (``slots.py``)."""

    def __str__(self) -> str:
        return "its on-demand slot is wanted for another model"


@dataclass(frozen=True)
class KeepAliveExpired:
    """Its keep_alive ended with no request in flight (Ollama's ``keep_alive``)."""

    def __str__(self) -> str:
        return "keep_alive expired"


@dataclass(frozen=True)
class SleepOver:
    """Asleep for ``--sleep-unload-after``: stopped for real, its host RAM and CUDA context given back."""

    seconds: float

    def __str__(self) -> str:
        return f"asleep for {self.seconds:g} s (--sleep-unload-after): stopped"


#: The one keep_alive expiry (it carries nothing).
KEEP_ALIVE = KeepAliveExpired()

#: Why a model is asked to unload before its keep_alive ends.
Eviction = MakeRoom | SlotWanted | SleepOver
