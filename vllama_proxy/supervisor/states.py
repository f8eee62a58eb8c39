"""The supervisor's states, the transitions allowed between them (:data:`TRANSITIONS`, drawn above
:class:`State`), and the typed outcomes of a step of the owner loop.

Invariant: one task (``lifecycle.Supervisor._run``) owns every transition, one step per state; everyone
else waits on them (``StatusBoard.wait_ready``) and never acts on a state they read earlier. Why a step
ended is one of the typed outcomes below, never a string to parse. What each state means to a client:
``docs/operations.md`` "The supervisor (``--model``)".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .room import Eviction


# The transitions, as :data:`TRANSITIONS` allows them:
#
#     starting ──► ready ──► unhealthy ──► restarting ──► starting
#        │  └──────────────────────────────►─┘    ▲
#        └──► failed ──(slow retry)──► starting    │
#     any ──► stopping ──► stopped          failed ┘
#
#     keep_alive expired   ready ──► sleeping ──(request)──► ready        (vLLM sleep mode)
#     or evicted:          ready ──► unloaded ──(request)──► starting     (no sleep mode)
#
#     no room on its GPUs: starting | restarting | failed ──► unloaded    (loads on demand)
#     evicted while asleep,
#     or asleep too long:   sleeping ──► unloaded                         (frees its CUDA context and host RAM)
#     a model loaded on demand starts in unloaded.
class State(str, enum.Enum):
    """Where the supervised ``vllm serve`` stands."""

    STARTING = "starting"  # launched, loading; connections refused until weights and graphs are ready
    READY = "ready"  # /health 200 and /v1/models lists the model
    UNHEALTHY = "unhealthy"  # exited, /health failing, or engine hung; about to restart
    RESTARTING = "restarting"  # old process tree stopped; waiting out the backoff
    FAILED = "failed"  # crash loop: retrying slowly; /readyz shows the last error
    SLEEPING = "sleeping"  # keep_alive expired: vLLM sleep mode level 1 (weights in CPU RAM, KV cache freed)
    UNLOADED = "unloaded"  # not running (keep_alive expired or evicted without sleep mode, or no room): started on the next request
    STOPPING = "stopping"
    STOPPED = "stopped"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.READY, State.RESTARTING, State.FAILED, State.UNLOADED, State.STOPPING}),
    State.READY: frozenset({State.UNHEALTHY, State.SLEEPING, State.UNLOADED, State.STOPPING}),
    State.SLEEPING: frozenset({State.READY, State.UNLOADED, State.UNHEALTHY, State.STOPPING}),
    State.UNLOADED: frozenset({State.STARTING, State.STOPPING}),
    State.UNHEALTHY: frozenset({State.RESTARTING, State.FAILED, State.STOPPING}),
    State.RESTARTING: frozenset({State.STARTING, State.UNLOADED, State.STOPPING}),
    State.FAILED: frozenset({State.STARTING, State.UNLOADED, State.STOPPING}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A transition the table does not allow: a supervisor bug, never a user error."""


# -- why a step of the owner loop ended ---------------------------------------------------
@dataclass(frozen=True)
class Healthy:
    """vLLM answers ``/health`` and lists the model: ready to serve."""


@dataclass(frozen=True)
class Crashed:
    """vLLM must be restarted (exited, ``/health`` failing, engine hung, sleep or wake refused);
    ``reason`` becomes ``last_error``."""

    reason: str


@dataclass(frozen=True)
class Misconfigured:
    """vLLM cannot run with this configuration (not executable, its argparse refused the command line,
    or the model cannot be had: ``start_errors.py``): no restart can fix it. ``reason`` becomes ``last_error``; ``config_error`` holds vLLM's own words."""

    reason: str


@dataclass(frozen=True)
class StopAsked:
    """:meth:`Supervisor.stop` was called."""


@dataclass(frozen=True)
class Idle:
    """Its keep_alive ended, or an eviction was asked, and nothing runs on it: put it away."""


@dataclass(frozen=True)
class LoraOutgrown:
    """An adapter created since the start needs a restart (``models/adapters.py``: ``LoraPlan.needs_restart``:
    not declared at launch, or larger LoRA limits): start anew."""


@dataclass(frozen=True)
class Wanted:
    """A request wants the model (the board's wake request)."""


@dataclass(frozen=True)
class Evicted:
    """Asked to give up its room while asleep (it still holds its CUDA context): stop it."""

    why: Eviction


#: How a start ended (``starting``), a watch of a ready vLLM (``ready``), and a wait while unloaded or asleep.
StartOutcome = Healthy | Crashed | Misconfigured | StopAsked
WatchOutcome = Crashed | Idle | LoraOutgrown | StopAsked
WakeOutcome = Wanted | Crashed | Evicted | StopAsked
