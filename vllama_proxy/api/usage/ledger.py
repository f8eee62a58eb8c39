"""The usage ledger: one row per inference request of a known key (answered or refused), kept in a database.

The settler appends a :class:`~vllama_proxy.api.usage.store.Row` to this process's list
(:meth:`Ledger.record`: no lock, no I/O, no await); a task writes the list in one transaction every
``--usage-flush-interval`` s or ``--usage-flush-rows`` rows, in a worker thread (``store.py``). Each
worker has its own ledger and connection to the shared database. A clean stop writes every row first;
a ``kill -9`` loses at most the last flush interval's rows. Budgets read usage with no round trip
(:meth:`Ledger.used`): per-key day and month totals refreshed every ``--usage-refresh-interval`` s from
the rows since the last (by row id), plus unwritten rows; recounted whole at start, when a period
begins, and with PostgreSQL every :data:`RECOUNT_INTERVAL` s (a row may become visible after higher ids).
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import socket
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Literal

from vllama_proxy.logs import get_logger
from .store import Row, Store, user_total

log = get_logger("vllama.ledger")

Period = Literal["day", "month"]


#: Batches of rows kept while the database cannot be written (beyond, the oldest are dropped, logged).
MAX_PENDING_BATCHES = 100
#: Seconds between full recounts of the totals where row ids may become visible out of order
#: (PostgreSQL: a row missed by the reads after it is counted by the next recount).
RECOUNT_INTERVAL = 300.0


def period_bounds(period: Period, now: float) -> tuple[float, float]:
    """``(start, end)`` in seconds since the epoch of the UTC ``period`` (``day``, ``month``) holding ``now``."""
    t = time.gmtime(now)
    if period == "day":
        start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
        return float(start), float(start + 86400)
    start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(start), float(calendar.timegm((year, month, 1, 0, 0, 0)))


def iso(ts: float) -> str:
    """``2026-12-01T00:00:00Z``."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Ledger:
    """This process's writer of usage rows, and the running totals budgets read.

    Args:
        opener: opens the database (``api/usage/store.py``'s ``open_store``; blocking, run in a thread by :meth:`start`).
        flush_interval: seconds between writes of the rows that wait.
        flush_rows: write at once when this many rows wait.
        refresh_interval: seconds between reads of each key's day and month totals.
        retention_days: rows older than this are deleted (at start and daily) by the process
            that ``prunes`` (worker 0); 0 keeps every row.
        clock: seconds since the epoch (tests inject their own: budgets reset at a period's end).
    """

    def __init__(self, opener: Callable[[], Store], *, flush_interval: float = 1.0, flush_rows: int = 1000, refresh_interval: float = 5.0,
                 retention_days: int = 0, prunes: bool = False, clock: Callable[[], float] = time.time) -> None:
        self._opener = opener
        self.store: Store | None = None
        self.host = socket.gethostname()
        self.clock = clock
        self._interval = flush_interval
        self._rows = flush_rows
        self._refresh_interval = refresh_interval
        self._retention = retention_days * 86400.0
        self._prunes = prunes and retention_days > 0
        self._pending: list[Row] = []
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        # tokens per (key, period, period start): as the database said at the last refresh; written since; in the
        # database's hands now (their requests gave their budget reservations back: counted until written); still pending
        self._db: dict[tuple[str, str, float], int] = {}
        self._written: dict[tuple[str, str, float], int] = {}
        self._writing: dict[tuple[str, str, float], int] = {}
        self._queued: dict[tuple[str, str, float], int] = {}
        self._refreshed_at = float("-inf")
        self._last_id = 0  # the highest row id the totals hold: each refresh reads only the rows after it
        self._counted_periods: tuple[float, float] = (0.0, 0.0)
        self._counted_at = float("-inf")
        self._pruned_at = float("-inf")
        self._bounds: dict[str, tuple[float, float]] = {}

    # -- the request path ------------------------------------------------------------------------

    def record(self, row: Row) -> None:
        """Queue ``row`` (O(1), no I/O); the flush task writes it."""
        self._pending.append(row)
        tokens = row.prompt_tokens + row.output_tokens
        if tokens:
            for name in (row.key, user_total(row.key, row.end_user)) if row.end_user is not None else (row.key,):
                for period in ("day", "month"):
                    k = (name, period, self._start(period, row.ts))
                    self._queued[k] = self._queued.get(k, 0) + tokens
        if len(self._pending) >= self._rows:
            self._wake.set()

    def used(self, key: str, period: Period, now: float | None = None) -> int:
        """Tokens (prompt + output) ``key`` used in the current ``period`` (as of ``now``): the
        database's total at the last refresh, plus this process's rows since. No I/O."""
        k = (key, period, self._start(period, self.clock() if now is None else now))
        return self._db.get(k, 0) + self._written.get(k, 0) + self._writing.get(k, 0) + self._queued.get(k, 0)

    def _start(self, period: str, ts: float) -> float:
        bounds = self._bounds.get(period)
        if bounds is None or not bounds[0] <= ts < bounds[1]:
            bounds = period_bounds(period, ts)  # type: ignore[arg-type]
            self._bounds[period] = bounds
        return bounds[0]

    # -- the writer ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the database, read the current totals, prune old rows, start the flush task.

        Raises:
            as ``api/usage/store.py``'s ``open_store``.
        """
        self.store = await asyncio.to_thread(self._opener)
        log.info("usage_ledger", where=self.store.where, flush_interval_s=self._interval, flush_rows=self._rows,
                 retention_days=self._retention / 86400 or "forever")
        await self._cycle(force_refresh=True)
        self._task = asyncio.create_task(self._run(), name="usage-ledger")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            try:
                await self._cycle()
            except Exception as e:  # the database is away: keep the rows, open it again, retry next time
                log.warning("usage_ledger_write_failed", error=repr(e), waiting=len(self._pending))
                self._bound_pending()
                await self._reopen()

    def _bound_pending(self) -> None:
        """While the database is away rows pile up: keep the newest :data:`MAX_PENDING_BATCHES` batches'
        worth, drop (and log) the oldest, so an outage costs rows, never the process's memory."""
        cap = MAX_PENDING_BATCHES * self._rows
        if len(self._pending) > cap:
            dropped, self._pending = self._pending[:-cap], self._pending[-cap:]
            log.error("usage_ledger_rows_dropped", rows=len(dropped), reason="the database is unreachable")

    async def _reopen(self) -> None:
        """A new connection for the next cycle (PostgreSQL restarted, a network blip)."""
        old, self.store = self.store, None
        if old is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(old.close)
        try:
            self.store = await asyncio.to_thread(self._opener)
        except Exception as e:
            log.warning("usage_ledger_reopen_failed", error=repr(e))

    async def _connected(self) -> Store:
        """The open connection, or a new one where the last was dropped (:meth:`_reopen`, or a
        failed one). Raises what the opener raises while the database is still away."""
        if self.store is None:
            self.store = await asyncio.to_thread(self._opener)
        return self.store

    async def flush(self) -> None:
        """Write every row that waits now, and read the totals again (``/api/usage`` calls it first,
        so this process's own rows are in its answer)."""
        await self._cycle(force_refresh=True)

    async def _cycle(self, force_refresh: bool = False) -> None:
        async with self._flush_lock:
            await self._connected()
            batch, self._pending = self._pending, []
            if batch:
                self._writing, self._queued = self._queued, {}
                try:
                    await asyncio.to_thread(self.store.write, batch)
                except BaseException:
                    self._pending[:0] = batch  # not written: first in the next batch
                    for k, n in self._writing.items():
                        self._queued[k] = self._queued.get(k, 0) + n
                    raise
                else:
                    for k, n in self._writing.items():
                        self._written[k] = self._written.get(k, 0) + n
                finally:
                    self._writing = {}
            now = self.clock()
            if self._prunes and now - self._pruned_at >= 86400:
                self._pruned_at = now
                gone = await asyncio.to_thread(self.store.prune, now - self._retention)
                if gone:
                    log.info("usage_ledger_pruned", rows=gone, older_than_days=self._retention / 86400)
            if force_refresh or now - self._refreshed_at >= self._refresh_interval:
                await self._refresh(now)

    async def _refresh(self, now: float) -> None:
        day, month = self._start("day", now), self._start("month", now)
        assert self.store is not None
        full = ((day, month) != self._counted_periods or
                (not self.store.ordered_ids and now - self._counted_at >= RECOUNT_INTERVAL))
        by_month, by_day, last = await asyncio.to_thread(self.store.tokens, day, month, 0 if full else self._last_id)
        totals = {} if full else {k: n for k, n in self._db.items() if k[1:] in (("day", day), ("month", month))}
        for k, n in by_month.items():
            totals[(k, "month", month)] = totals.get((k, "month", month), 0) + n
        for k, n in by_day.items():
            totals[(k, "day", day)] = totals.get((k, "day", day), 0) + n
        if full:
            self._counted_periods, self._counted_at = (day, month), now
        # every row written before this read is in it: only what is still queued stays on top
        self._db, self._written, self._refreshed_at, self._last_id = totals, {}, now, last

    async def close(self) -> None:
        """Stop the task and write every row left (a clean stop loses none)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            async with self._flush_lock:
                batch, self._pending = self._pending, []
                if batch:  # a connection even when the stop cut the task between a failed write and its reopen
                    await asyncio.to_thread((await self._connected()).write, batch)
            log.info("usage_ledger_closed", written=len(batch))
        except Exception as e:
            log.error("usage_ledger_lost", rows=len(batch), error=repr(e))
        finally:
            if self.store is not None:
                await asyncio.to_thread(self.store.close)
