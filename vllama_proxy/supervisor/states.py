"""The supervisor's states and the transitions allowed between them.

    starting ──► ready ──► unhealthy ──► restarting ──► starting
       │  └──────────────────────────────►─┘    ▲
       └──► failed ──(slow retry)──► starting    │
    any ──► stopping ──► stopped          failed ┘

    keep_alive expired   ready ──► sleeping ──(request)──► ready        (vLLM sleep mode)
    or evicted:          ready ──► unloaded ──(request)──► starting     (no sleep mode)

    no room on its GPUs: starting | restarting | failed ──► unloaded    (loads on demand)
    evicted while asleep: sleeping ──► unloaded                         (frees its CUDA context)
    a model loaded on demand starts in unloaded.

One task (``Supervisor._run``) owns every transition; everyone else waits on
them (``Supervisor.ensure_ready``) and never acts on a state they read earlier.
"""

from __future__ import annotations

import enum


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
