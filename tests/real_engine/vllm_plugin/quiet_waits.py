"""A vLLM general plugin for the real-engine tier: vLLM's processes wait for each other by sleeping 0.1 ms, not by
spinning.

On the CPU, vLLM 0.32 runs its engine core and its model worker as two processes that pass each step through a
shared-memory queue (``vllm/distributed/device_communicators/shm_broadcast.py``). A reader that read within the last
second waits for the next message in a loop of ``sched_yield()``: the engine core spins for the whole of every step
its worker computes (or sleeps in ``slow_steps.py``), and the worker for a second after each step. On the 2-core
test machine that is a second core busy for nothing: 1,000 tokens of the tiny model took 5.7 CPU-s of the engine
core's beside 6.0 of the worker's. With this plugin the loop sleeps 0.1 ms a turn instead (1.5 CPU-s; the 1,000
tokens ~10 % slower on an idle machine), which leaves those cores to the rest of the suite. Nothing vllama does or
sees changes: the same processes, requests, answers and metrics.

Loaded by vLLM itself in its engine core and worker (``load_general_plugins``, entry point group
``vllm.general_plugins``): ``tests/real_engine/conftest.py`` puts this folder, which holds the entry point's
``.dist-info`` beside the module, on every real server's ``PYTHONPATH``.
"""

from __future__ import annotations

import time


def _sleep_a_little() -> None:
    time.sleep(0.0001)


def register() -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    if not hasattr(shm_broadcast, "sched_yield"):
        raise RuntimeError("vLLM's shm_broadcast has no sched_yield any more: tests/real_engine/vllm_plugin/quiet_waits.py "
                           "no longer quiets its waits")
    shm_broadcast.sched_yield = _sleep_a_little
