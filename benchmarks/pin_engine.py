"""Issue 11 attribution: switch vllama's engine-core placement on and off on a running server.

``--state on`` does what ``vllama serve`` does by default (``--pin-engine-core auto``,
``vllama_proxy/supervisor/placement.py``): the EngineCore process under ``--under PID``
(vllama's main process) on the last CPU of the affinity, vllama and every other process
of its tree (workers, vLLM's API servers) on the rest. ``--engine-cpus K`` gives the engine
core the last K CPUs instead (its busy scheduling thread and its input/output socket threads
then need not share one CPU). ``--state off`` puts that whole tree
back on every CPU, as with ``--pin-engine-core off``. Processes outside the tree (the load
generator) are left alone in both states, as they would be in production.
"""

from __future__ import annotations

import argparse
import os

import psutil

from vllama_proxy.supervisor.placement import engine_core_pids, set_affinity, smt_siblings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--under", type=int, required=True, help="vllama's main pid")
    p.add_argument("--state", choices=("on", "off"), required=True)
    p.add_argument("--engine-cpus", type=int, default=1, help="CPUs (from the top) for the engine core when on")
    a = p.parse_args()
    every = set(range(os.cpu_count() or 1))
    top = psutil.Process(a.under)
    tree = [top, *top.children(recursive=True)]
    engines = engine_core_pids(q.pid for q in tree)
    core = set().union(*(smt_siblings(c) for c in sorted(every)[-a.engine_cpus:]))
    for proc in tree:
        cpus = every if a.state == "off" else core if proc.pid in engines[:1] else every - core
        try:
            set_affinity(proc.pid, cpus)
        except OSError:
            pass
    print(f"placement {a.state}: engine core {engines[:1]} -> {sorted(core) if a.state == 'on' else 'all'}; "
          f"{len(tree)} processes of vllama's tree")


if __name__ == "__main__":
    main()
