"""Where vLLM's engine cores run: a CPU of their own, and everything else of ours on the rest.

vLLM's engine core (``VLLM::EngineCore``, one process per data-parallel rank) schedules every step in
one busy Python thread, which under many streams sets the pace (TPOT) and suffers from sharing CPUs.
Linux keeps a thread's affinity across ``fork``/``exec``, so (1) at start vllama confines itself to the
CPUs left after the engine cores' (its workers and every vLLM it launches inherit that), and (2) once
a vLLM is ready, each EngineCore process moves to its own CPU, with its SMT siblings, counted from the
top of this process's affinity, offset by the host-wide number of the engine's GPU. Invariant:
``auto`` pins only when vllama's CPU budget is its whole affinity (not under a quota below it, nor
beside programs not vllama's to move); instances that all see every CPU need a cpuset each.
Measurements and known costs: ``docs/decisions.md``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..logs import get_logger

log = get_logger("vllama.placement")

#: With ``auto``, engine cores get CPUs of their own only when at least this many CPUs remain
#: for the API servers, vllama's workers and the kernel's network work.
MIN_OTHER_CPUS = 4


def smt_siblings(cpu: int) -> set[int]:
    """The CPUs sharing ``cpu``'s physical core (itself included), from sysfs; ``{cpu}`` if unknown."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return {cpu}
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.strip().isdigit():
            out.update(range(int(lo), int(hi or lo) + 1))
    return out or {cpu}


@dataclass(frozen=True)
class Placement:
    """CPUs of the engine cores and of everything else (shown in ``/readyz`` ``front_end``).

    Attributes:
        engine_cpus: served name -> one CPU set per data-parallel rank (empty: not pinned).
        other_cpus: the CPUs of vllama, its workers and vLLM's other processes (empty: not pinned).
        source: ``auto``, ``on``, or why nothing was pinned.
    """

    engine_cpus: dict[str, list[list[int]]] = field(default_factory=dict)
    other_cpus: list[int] = field(default_factory=list)
    source: str = "off"

    @property
    def active(self) -> bool:
        return bool(self.engine_cpus)


def plan_placement(
    mode: str,
    affinity: Iterable[int],
    cpus: float,
    engines: dict[str, list[int]],
    siblings: Callable[[int], set[int]] = smt_siblings,
) -> Placement:
    """Choose the engine cores' CPUs.

    Physical cores are counted from the top of the affinity; an engine core with slot ``k``
    takes the ``k``-th (cyclically, the next one free). The slot is the host-wide number of
    the GPU it drives (``gpu.host_numbers``), so several vllama instances on one host, each with
    its own GPUs (one container or unit per GPU, all seeing every CPU), pin to different cores
    without knowing of each other.

    Args:
        mode: ``auto`` (pin when vllama's CPU budget is its whole affinity and at least
            :data:`MIN_OTHER_CPUS` CPUs remain), ``on`` (pin when at least one remains), ``off``.
        affinity: the CPUs this process may run on.
        cpus: usable CPUs (the affinity lowered to the cgroup quota, or ``--cpus``). Below the
            affinity's size (a Kubernetes CPU limit without a cpuset), the CPUs are shared with
            others: a pinned engine core could not escape a busy neighbour, so ``auto`` does not pin.
        engines: served name -> one slot per engine-core process (data-parallel rank, in order).
        siblings: a CPU -> its physical core's CPUs.
    """
    if mode == "off":
        return Placement(source="off (--pin-engine-core off)")
    if not engines:
        return Placement(source="off (no vLLM launched)")
    free_set = set(affinity)
    free = sorted(free_set, reverse=True)
    if mode == "auto" and cpus < len(free):
        return Placement(source=f"off (a CPU budget of {cpus:g} within an affinity of {len(free)} CPUs: they are shared)")
    cores: list[list[int]] = []
    seen: set[int] = set()
    for c in free:
        if c not in seen:
            core = sorted((siblings(c) & free_set) | {c})
            seen.update(core)
            cores.append(core)
    taken: set[int] = set()
    chosen: dict[str, list[list[int]]] = {}
    for name, slots in engines.items():
        for slot in slots:
            order = (cores[(slot + j) % len(cores)] for j in range(len(cores)))
            core = next((k for k in order if not taken.intersection(k)), None)
            if core is None:
                return Placement(source=f"off (too few CPUs: {len(free)})")
            taken.update(core)
            chosen.setdefault(name, []).append(core)
    other = sorted(free_set - taken)
    left = min(len(other), cpus - len(taken))
    need = MIN_OTHER_CPUS if mode == "auto" else 1
    if left < need:
        return Placement(source=f"off (too few CPUs: {len(taken)} for engine cores would leave {left:g}, want {need})")
    return Placement(chosen, other, mode)


def set_affinity(pid: int, cpus: Iterable[int]) -> int:
    """Move every thread of process ``pid`` to ``cpus``; returns the threads moved.

    Raises:
        OSError: the process is gone or not ours (threads that end meanwhile are skipped).
    """
    cpus = set(cpus)
    moved = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            moved += 1
        except ProcessLookupError:
            continue
    return moved


#: vLLM's engine-core process titles: ``VLLM::EngineCore``, ``VLLM::EngineCore_DP3`` (setproctitle;
#: the prefix is ``VLLM_PROCESS_NAME_PREFIX``).
_ENGINE_TITLE = re.compile(r"^(?:[\w.-]+::)?EngineCore(?:_DP(\d+))?$")


def engine_core_pids(session_pids: Iterable[int]) -> list[int]:
    """The EngineCore processes among ``session_pids``, in data-parallel rank order (then pid).

    A process whose parent also carries the title (a fork that kept it) is not one."""
    found: dict[int, tuple[int, int]] = {}
    for pid in session_pids:
        try:
            proc = psutil.Process(pid)
            argv = proc.cmdline()
            parent = proc.ppid()
        except psutil.Error:
            continue
        m = _ENGINE_TITLE.match(argv[0].strip()) if argv else None
        if m:
            found[pid] = (int(m.group(1) or 0), parent)
    return sorted((p for p, (_, parent) in found.items() if parent not in found), key=lambda p: (found[p][0], p))


def pin_engine_cores(session_pids: Iterable[int], cpu_sets: list[list[int]], model: str) -> list[dict[str, object]]:
    """Move each EngineCore process of one vLLM to its CPU set; logged, never raises.

    Returns ``[{"pid", "cpus", "threads"}]`` for the processes moved.
    """
    done: list[dict[str, object]] = []
    pids = engine_core_pids(session_pids)
    for pid, cpus in zip(pids, cpu_sets):
        try:
            done.append({"pid": pid, "cpus": cpus, "threads": set_affinity(pid, cpus)})
        except OSError as e:
            log.warning("engine_core_not_pinned", model=model, pid=pid, error=str(e))
    if done:
        log.info("engine_core_pinned", model=model, engine_cores=done)
    elif not pids:
        log.warning("engine_core_not_found", model=model, detail="no EngineCore process in vLLM's session")
    return done
