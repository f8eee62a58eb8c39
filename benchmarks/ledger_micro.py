#!/usr/bin/env python3
"""The usage ledger's cost in isolation (issue 39): what a request pays (``Ledger.record``, on the
event loop), what a batch write costs (SQLite WAL, in a thread), how long the event loop is held
while a batch is written beside it (the writer thread takes the GIL to build its rows), and how much
of its time a *busy* loop (a burst of requests: back-to-back 50 µs callbacks, never idle) keeps while
a batch is written beside it, with the store's one-statement JSON insert and with ``executemany``
(a statement per row, the writer taking the GIL back after each; the ledger's way before).

    python benchmarks/ledger_micro.py [--rows 1000] [--batches 20]
"""

from __future__ import annotations

import argparse
import asyncio
import selectors
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from vllama_proxy.api.ledger import Ledger
from vllama_proxy.api.ledger_store import COLUMNS, Row, Store, open_store


def row(i: int) -> Row:
    return Row(time.time(), "host", f"key-{i % 8}", "qwen2.5:7b", "/api/generate", 200, 128, 128, 812.5, None)


def executemany(store: Store, rows: list[Row]) -> None:
    """The write as it was before the JSON insert: a statement per row."""
    with store._lock:
        store._conn.executemany(f"INSERT INTO vllama_usage ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", rows)
        store._conn.commit()


def spin(until: Callable[[], bool], unit_s: float = 50e-6) -> tuple[int, float]:
    """A busy event loop's stand-in: turns of ``unit_s`` of pure Python, each ended by a poll of an
    epoll set with timeout 0, as asyncio's loop polls between its callbacks (the GIL released for the
    call, so a writer thread may take it then and the loop waits to get it back), until ``until()``.
    Returns (turns done, the longest gap between two in s: time the thread had neither GIL nor CPU)."""
    poll = selectors.DefaultSelector()
    n, worst, last = 0, 0.0, time.perf_counter()
    while not until():
        end = last + unit_s
        while time.perf_counter() < end:
            pass
        poll.select(0)
        now = time.perf_counter()
        worst = max(worst, now - end)
        last, n = now, n + 1
    poll.close()
    return n, worst


def gil_waits() -> int:
    """This thread's voluntary context switches so far (Linux): a spinning thread blocks only to wait
    for the GIL, so their increase while it spins counts the times another thread held it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    except (OSError, StopIteration):
        return 0


def busy_share(write: Callable[[list[Row]], None], rows: list[Row]) -> tuple[float, float, float, float]:
    """The busy loop's share of its wall time (callbacks x 50 µs / wall) while ``write(rows)`` runs in a
    thread beside it, the longest gap (ms), the write's own wall time (ms) and the times the loop
    waited for the GIL (:func:`gil_waits`)."""
    done = threading.Event()
    took = [0.0]

    def writer() -> None:
        t = time.perf_counter()
        write(rows)
        took[0] = time.perf_counter() - t
        done.set()

    waits, t0 = gil_waits(), time.perf_counter()
    threading.Thread(target=writer).start()
    n, worst = spin(done.is_set)
    return n * 50e-6 / (time.perf_counter() - t0), worst * 1000, took[0] * 1000, gil_waits() - waits


def busy_comparison(store: Store, n_rows: int, batches: int) -> list[str]:
    """:func:`busy_share` per write, alternating the store's write, ``executemany`` and no write (the
    loop alone for as long as the last write took); medians."""
    got: dict[str, list[tuple[float, float, float, float]]] = {"json (the store)": [], "executemany (before)": [], "no write": []}
    for _ in range(batches):
        rows = [row(i) for i in range(n_rows)]
        got["json (the store)"].append(busy_share(store.write, rows))
        got["executemany (before)"].append(busy_share(lambda r: executemany(store, r), rows))
        wall = got["executemany (before)"][-1][2] / 1000
        got["no write"].append(busy_share(lambda _r, w=wall: time.sleep(w), rows))
    lines = [(f"a busy loop beside a {n_rows}-row batch write ({batches} each, medians): loop share of wall, longest gap, "
              "write time, the loop's waits for the GIL")]
    for name, v in got.items():
        share, gap, took, waits = (statistics.median(x[i] for x in v) for i in range(4))
        lines.append(f"  {name:22} {share:6.1%}  {gap:7.2f} ms  {took:8.1f} ms  {waits:6.0f}")
    return lines


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
        busy = busy_comparison(ledger.store, args.rows, args.batches)
        await ledger.close()
    print(f"record(): {per_record:.0f} ns per request (on the event loop)")
    print(f"batch of {args.rows} rows written (SQLite WAL, thread) + totals read: median {statistics.median(writes) * 1000:.1f} ms, "
          f"max {max(writes) * 1000:.1f} ms")
    lags.sort()
    print(f"event loop turn while writing: median {statistics.median(lags) * 1e6:.0f} us, p99 {lags[int(len(lags) * .99)] * 1e6:.0f} us, "
          f"max {lags[-1] * 1e3:.2f} ms ({len(lags)} turns)")
    print("\n".join(busy))


if __name__ == "__main__":
    asyncio.run(main())
