"""Which model makes room: the one eviction rule, a pure function of snapshots (no I/O, no clock).

Two places make room for a model: the pool, when a model's share of a GPU does not fit beside the
models holding theirs (``pool.py``), and the on-demand slots, when every slot holds a model and a
request names another (``slots.py``). Both read what they know first (the pool's record, the status
boards; NVML before that, for the fit check) into :class:`Candidate` snapshots and ask
:func:`victim`, after llama-swap's ``Swapper.EvictionFor(target, running)`` (a pure function,
tested alone) and Ollama's scheduler (``server/sched.go`` ``findRunnerToUnload``: the least recently
used runner with no request in flight)::

    candidates                         the models in, as the caller saw them
      -> not in_the_way                evicting it frees nothing the target lacks
      -> busy                          a request in flight, waiting for it, or asking to wake it
      -> protected                     pinned, or an operator's model and --protect-models
      -> what it frees                 GPU memory: a loaded model (its share) before a sleeping one
                                       (its CUDA context only); a slot: either frees it whole
      -> least recently used           the victim (None: nobody may go; the target waits or gives up)

A model's ``keep_alive`` does not protect it: ``-1`` (forever) keeps an idle model loaded until it
is in the way, as in Ollama; only ``pin`` (and ``--protect-models``) does. Whether the target fits
once every evictable model is gone is the fit check's question (``models/fit.py``), asked before.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

#: Whatever the caller names its models by (a supervisor, a status board): returned as given.
M = TypeVar("M")


class Held(enum.Enum):
    """What a candidate holds now."""

    LOADED = "loaded"  # vLLM ready: its GPU share and CUDA context, and an on-demand slot
    ASLEEP = "asleep"  # vLLM sleep mode level 1: its CUDA context only, and an on-demand slot


class Need(enum.Enum):
    """What the target lacks."""

    GPU_MEMORY = "gpu memory"  # its share does not fit on a GPU (pool.py)
    SLOT = "slot"  # every on-demand slot holds a model (slots.py)


@dataclass(frozen=True)
class Candidate(Generic[M]):
    """One model as the caller saw it, for :func:`victim`.

    Attributes:
        model: the caller's handle, returned as the victim.
        held: loaded or asleep (a model starting, waking, stopped or failed is no candidate).
        last_used: epoch seconds of its last request (0: never used).
        busy: a request is in flight, waiting for it, or asked it to wake (``StatusBoard``:
            ``in_flight``, ``waiters``, ``waking``).
        protected: never evicted for this target (``pin``; an operator's model for an on-demand
            target with ``--protect-models``).
        in_the_way: evicting it frees some of what the target lacks (shares a GPU it is short on;
            any slot for a slot).
    """

    model: M
    held: Held
    last_used: float
    busy: bool = False
    protected: bool = False
    in_the_way: bool = True


def victim(need: Need, candidates: Iterable[Candidate[M]]) -> M | None:
    """The model to evict for a target that lacks ``need``: the least recently used of the idle,
    unprotected candidates in its way; for GPU memory a loaded one before a sleeping one (a
    sleeping vLLM frees only its CUDA context); ``None`` when none may go.
    """
    free = [c for c in candidates if c.in_the_way and not c.busy and not c.protected]
    if need is Need.GPU_MEMORY:
        free = [c for c in free if c.held is Held.LOADED] or free
    best = min(free, key=lambda c: c.last_used, default=None)
    return None if best is None else best.model
