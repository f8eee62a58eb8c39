#!/usr/bin/env python3
"""How long a model's owner loop takes to act on a request that wants it (issue 41.1).

The time from ``StatusBoard.request_wake`` (what a waiting request does) to the owner loop leaving
its wait for a request and beginning the load, measured in-process with the load itself replaced
by a stub (no vLLM is started): before the inbox the loop polled the board every 20 ms; with it the
request's message wakes the loop. Also counts the sleeps vllama's own code awaits in one second
while nobody wants the model (the loop's idle wake-ups).

    PYTHONPATH=. python benchmarks/owner_wake.py [rounds]

CPU only; runs against whichever vllama_proxy is on the path (compare two checkouts).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.lifecycle import Supervisor
from vllama_proxy.supervisor.states import State
from vllama_proxy.supervisor.status import StatusBoard


async def main(rounds: int) -> None:
    board = StatusBoard("m", initial=State.UNLOADED)
    sup = Supervisor(Settings(gpu_check=False), ModelConfig(model="/m", name="m", preload=False), port=1, board=board)
    acted: asyncio.Queue[float] = asyncio.Queue()

    async def load(*, on_demand: bool) -> None:  # the stub: record when the loop acted, stay unloaded
        acted.put_nowait(time.perf_counter())
        board.clear_wake()

    sup._load = load  # type: ignore[method-assign]
    wakeups = 0
    real_sleep = asyncio.sleep

    async def counting_sleep(delay, *a, **kw):
        nonlocal wakeups
        if sys._getframe(1).f_globals.get("__name__", "").startswith("vllama_proxy."):
            wakeups += 1
        return await real_sleep(delay, *a, **kw)

    asyncio.sleep = counting_sleep  # type: ignore[assignment]
    await sup.start()
    await real_sleep(1.0)
    idle_wakeups, wakeups = wakeups, 0
    latencies = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        board.request_wake()
        latencies.append((await acted.get()) - t0)
        await real_sleep(0.005)
    await sup.stop()
    asyncio.sleep = real_sleep  # type: ignore[assignment]
    ms = sorted(x * 1000 for x in latencies)
    print(f"owner loop sleeps in 1 s with nobody wanting the model: {idle_wakeups}")
    print(f"request -> owner acts, {rounds} rounds: median {statistics.median(ms):.2f} ms, "
          f"p90 {ms[int(len(ms) * 0.9)]:.2f} ms, max {ms[-1]:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
