"""Which model makes room: the one eviction rule, a pure function of snapshots (no I/O, no clock).

The pool (``pool.py``) and the on-demand slots (``slots.py``) read what they know into
:class:`Candidate` snapshots and ask :func:`victim`, after llama-swap's ``Swapper.EvictionFor`` and
Ollama's ``server/sched.go`` ``findRunnerToUnload``::

    candidates -> not in_the_way -> busy (a request, a waiter, a wake) -> protected (pinned,
    --protect-models) -> what it frees (a loaded model before a sleeping one) -> least recently used

Invariant: ``keep_alive`` does not protect a model (``-1`` keeps it loaded until it is in the way, as
in Ollama); only ``pin`` and ``--protect-models`` do. Whether it fits at all is ``models/fit.py``'s.
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
