#!/usr/bin/env python3
"""The usage ledger's cost in isolation (issue 39): what a request pays (``Ledger.record``, on the
event loop), what a batch write costs (SQLite WAL, in a thread), and how long the event loop is held
while a batch is written beside it (the writer thread takes the GIL to build its rows).

    python benchmarks/ledger_micro.py [--rows 1000] [--batches 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from vllama_proxy.api.ledger import Ledger
from vllama_proxy.api.ledger_store import Row, open_store


def row(i: int) -> Row:
    return Row(time.time(), "host", f"key-{i % 8}", "qwen2.5:7b", "/api/generate", 200, 128, 128, 812.5, None)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1000, help="rows per batch (--usage-flush-rows)")
    p.add_argument("--batches", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ledger = Ledger(lambda: open_store(None, Path(d)), flush_interval=3600, flush_rows=10**9)
        await ledger.start()
        rows = [row(i) for i in range(args.rows)]
        t = time.perf_counter_ns()
        for r in rows:
            ledger.record(r)
        per_record = (time.perf_counter_ns() - t) / len(rows)
        writes, lags = [], []
        for _ in range(args.batches):
            for r in rows:
                ledger.record(r)
            stop = asyncio.Event()

            async def probe() -> None:  # the loop's lag while the batch is written: what streams would wait
                while not stop.is_set():
                    t0 = time.perf_counter()
                    await asyncio.sleep(0)
                    lags.append(time.perf_counter() - t0)

            task = asyncio.create_task(probe())
            t0 = time.perf_counter()
            await ledger.flush()
            writes.append(time.perf_counter() - t0)
            stop.set()
            await task
        await ledger.close()
    print(f"record(): {per_record:.0f} ns per request (on the event loop)")
    print(f"batch of {args.rows} rows written (SQLite WAL, thread) + totals read: median {statistics.median(writes) * 1000:.1f} ms, "
          f"max {max(writes) * 1000:.1f} ms")
    lags.sort()
    print(f"event loop turn while writing: median {statistics.median(lags) * 1e6:.0f} us, p99 {lags[int(len(lags) * .99)] * 1e6:.0f} us, "
          f"max {lags[-1] * 1e3:.2f} ms ({len(lags)} turns)")


if __name__ == "__main__":
    asyncio.run(main())
