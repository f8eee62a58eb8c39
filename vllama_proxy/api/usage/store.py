"""Where the usage ledger's rows are kept: an SQLite file (the default) or a PostgreSQL database.

Both speak the same few statements through a blocking DB-API connection that only ever runs in a
worker thread (``asyncio.to_thread``, from ``ledger.py``), never on the event loop; each call holds
the store's lock, so one connection serves the flush task and the ``/api/usage`` queries alike.
A batch goes to SQLite as one JSON array in one ``INSERT ... SELECT ... FROM json_each(?)``, so the
writer holds the GIL a few times per batch, not per row (why: ``docs/decisions.md``); PostgreSQL
keeps ``executemany`` (psycopg pipelines it). SQLite: WAL (every worker writes the same file,
``busy_timeout`` 10 s, readers never wait), ``synchronous = NORMAL`` (a committed batch survives a
killed process; a power cut may lose the last commits). PostgreSQL (psycopg 3, the ``postgres``
extra): several fronts share one database, each row naming its host. Times are UTC epoch seconds.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any, Literal, NamedTuple

import orjson

#: One answered request. Never the prompt, the answer or the key's secret: its name only.
COLUMNS = ("ts", "host", "key", "model", "route", "status", "prompt_tokens", "output_tokens", "duration_ms", "error")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS vllama_usage (
    id {id},
    ts DOUBLE PRECISION NOT NULL,
    host TEXT NOT NULL,
    key TEXT NOT NULL,
    model TEXT NOT NULL,
    route TEXT NOT NULL,
    status INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    duration_ms DOUBLE PRECISION NOT NULL,
    error TEXT
)"""
_INDEXES = ("CREATE INDEX IF NOT EXISTS vllama_usage_ts ON vllama_usage (ts)",
            "CREATE INDEX IF NOT EXISTS vllama_usage_key_ts ON vllama_usage (key, ts)")


class Row(NamedTuple):
    """One ledger row (:data:`COLUMNS`, in their order): ``ts`` seconds since the epoch when the answer
    ended, ``duration_ms`` from the request's arrival, ``status`` the HTTP status (a stream that failed
    midway keeps its 200 and says why in ``error``). A named tuple: built on the event loop once per
    request (a third of a frozen dataclass's cost) and written as it is."""

    ts: float
    host: str
    key: str
    model: str
    route: str
    status: int
    prompt_tokens: int
    output_tokens: int
    duration_ms: float
    error: str | None = None


class Store:
    """The ledger table in one database (use :func:`open_store`).

    Args:
        conn: a DB-API connection (sqlite3 or psycopg), used from one thread at a time.
        placeholder: the driver's parameter mark (``?`` or ``%s``).
        day_expr: SQL turning the column ``ts`` into ``YYYY-MM-DD`` (UTC).
        month_expr: the same into ``YYYY-MM``.
        where: the database, in words (logged).
        ordered_ids: whether rows become visible in the order of their ``id`` (SQLite: one writer at
            a time; not PostgreSQL, where a transaction holding a lower id may commit later).
        insert_json: an INSERT taking a whole batch as one JSON array of rows (SQLite's
            :data:`_INSERT_JSON`); ``None``: ``executemany``, a row at a time.
    """

    def __init__(self, conn: Any, placeholder: str, day_expr: str, month_expr: str, where: str, *, ordered_ids: bool,
                 insert_json: str | None = None) -> None:
        self._conn = conn
        self.ordered_ids = ordered_ids
        self._insert_json = insert_json
        self._p = placeholder
        self._period = {"day": day_expr, "month": month_expr}
        self._lock = threading.Lock()
        self.where = where

    def write(self, rows: list[Row]) -> None:
        """Insert ``rows`` in one transaction (a batch is all there or not at all), in their order.

        Raises:
            orjson.JSONEncodeError: a text that is not valid UTF-8 (SQLite).
            sqlite3.Error, psycopg.Error: the database refused or is away.
        """
        with self._lock:
            cur = self._conn.cursor()
            if self._insert_json is not None:  # one statement: SQLite runs the batch with the GIL released
                cur.execute(self._insert_json, (orjson.dumps(rows, default=tuple).decode(),))
            else:
                marks = ", ".join([self._p] * len(COLUMNS))
                cur.executemany(f"INSERT INTO vllama_usage ({', '.join(COLUMNS)}) VALUES ({marks})", rows)
            self._conn.commit()

    def tokens(self, day: float, month: float, after_id: int) -> tuple[dict[str, int], dict[str, int], int]:
        """Prompt + output tokens per key of the rows with an ``id`` above ``after_id``: ``(since
        month, since day, the highest id read)``, both sums from one scan (``day`` >= ``month``).
        ``after_id`` 0 counts them all; the budgets' refresh passes the last id it read, so it reads
        only the rows written since (``ledger.py``)."""
        p = self._p
        with self._lock:
            cur = self._conn.cursor()
            cur.execute("SELECT COALESCE(MAX(id), 0) FROM vllama_usage")
            hi = int(cur.fetchone()[0])
            cur.execute(f"SELECT key, SUM(prompt_tokens + output_tokens), "
                        f"SUM(CASE WHEN ts >= {p} THEN prompt_tokens + output_tokens ELSE 0 END) FROM vllama_usage "
                        f"WHERE id > {p} AND id <= {p} AND ts >= {p} GROUP BY key", (day, after_id, hi, month))
            rows = cur.fetchall()
            self._conn.commit()
        return ({k: int(m or 0) for k, m, _ in rows if m}, {k: int(d or 0) for k, _, d in rows if d}, hi)

    def summary(self, since: float, by: Literal["day", "month"], key: str | None = None) -> list[dict[str, Any]]:
        """Per key, model and ``by`` period from ``since`` on: ``requests``, ``errors`` (status >= 400
        or a stream that failed), ``prompt_tokens``, ``output_tokens``, ``duration_ms`` (their sum);
        only ``key``'s rows when given. Sorted by period, key, model."""
        period = self._period[by]
        args: list[Any] = [since]
        where = f"ts >= {self._p}"
        if key is not None:
            where += f" AND key = {self._p}"
            args.append(key)
        sql = (f"SELECT {period} AS period, key, model, COUNT(*), "
               "SUM(CASE WHEN status >= 400 OR error IS NOT NULL THEN 1 ELSE 0 END), "
               "SUM(prompt_tokens), SUM(output_tokens), SUM(duration_ms) "
               f"FROM vllama_usage WHERE {where} GROUP BY 1, 2, 3 ORDER BY 1, 2, 3")
        with self._lock:
            cur = self._conn.cursor()
            cur.execute(sql, args)
            rows = cur.fetchall()
            self._conn.commit()
        return [{"period": p, "key": k, "model": m, "requests": int(n), "errors": int(e or 0), "prompt_tokens": int(pt or 0),
                 "output_tokens": int(ot or 0), "duration_ms": round(float(d or 0), 1)} for p, k, m, n, e, pt, ot, d in rows]

    def recent_errors(self, limit: int, key: str | None = None) -> list[dict[str, Any]]:
        """The last ``limit`` rows that failed (status >= 400, or a stream that failed), newest first."""
        args: list[Any] = []
        where = "(status >= 400 OR error IS NOT NULL)"
        if key is not None:
            where += f" AND key = {self._p}"
            args.append(key)
        with self._lock:
            cur = self._conn.cursor()
            cur.execute(f"SELECT {', '.join(COLUMNS)} FROM vllama_usage WHERE {where} ORDER BY ts DESC LIMIT {int(limit)}", args)
            rows = cur.fetchall()
            self._conn.commit()
        return [dict(zip(COLUMNS, r, strict=True)) for r in rows]

    def count(self) -> int:
        """Rows in the ledger (tests, the admin page)."""
        with self._lock:
            cur = self._conn.cursor()
            cur.execute("SELECT COUNT(*) FROM vllama_usage")
            n = int(cur.fetchone()[0])
            self._conn.commit()
            return n

    def prune(self, before: float) -> int:
        """Delete the rows older than ``before`` (retention). Rows deleted."""
        with self._lock:
            cur = self._conn.cursor()
            cur.execute(f"DELETE FROM vllama_usage WHERE ts < {self._p}", (before,))
            n = cur.rowcount
            self._conn.commit()
            return int(n or 0)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


#: SQLite's batch insert: one text parameter, a JSON array of rows, each an array in :data:`COLUMNS`'
#: order (a BLOB would read as JSONB from SQLite 3.45 on: the text is passed as ``str``).
_INSERT_JSON = (f"INSERT INTO vllama_usage ({', '.join(COLUMNS)}) SELECT "
                + ", ".join(f"json_extract(value, '$[{i}]')" for i in range(len(COLUMNS))) + " FROM json_each(?) ORDER BY key")


def _sqlite(path: Path) -> Store:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(_SCHEMA.format(id="INTEGER PRIMARY KEY"))
    for sql in _INDEXES:
        conn.execute(sql)
    conn.commit()
    return Store(conn, "?", "strftime('%Y-%m-%d', ts, 'unixepoch')", "strftime('%Y-%m', ts, 'unixepoch')", str(path),
                 ordered_ids=True, insert_json=_INSERT_JSON)


def _postgres(url: str) -> Store:
    try:
        import psycopg
    except ModuleNotFoundError:
        raise ValueError("a postgresql:// --usage-db needs psycopg: pip install 'vllama-proxy[postgres]'") from None
    conn = psycopg.connect(url, connect_timeout=10)
    conn.execute("SET client_encoding TO 'UTF8'")  # text, not bytes, even from an SQL_ASCII database
    with conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(398639)")  # several fronts may create the table at once
        cur.execute(_SCHEMA.format(id="BIGSERIAL PRIMARY KEY"))
        for sql in _INDEXES:
            cur.execute(sql)
    conn.commit()
    utc = "(to_timestamp(ts) AT TIME ZONE 'UTC')"
    host = conn.info.host or "local socket"
    return Store(conn, "%s", f"to_char({utc}, 'YYYY-MM-DD')", f"to_char({utc}, 'YYYY-MM')", f"postgresql on {host}, database {conn.info.dbname}",
                 ordered_ids=False)


def open_store(db: str | None, state_dir: Path) -> Store:
    """The ledger's store for ``--usage-db`` (blocking: call it in a thread).

    Args:
        db: ``None``: ``<state_dir>/usage.sqlite3``; ``postgresql://...`` (or ``postgres://``): that
            database; anything else: the path of an SQLite file.
        state_dir: vllama's state directory.

    Raises:
        ValueError: PostgreSQL asked without psycopg installed.
        sqlite3.Error, psycopg.Error, OSError: the database cannot be opened or its table made.
    """
    if db is not None and db.startswith(("postgresql://", "postgres://")):
        return _postgres(db)
    return _sqlite(Path(db) if db else state_dir / "usage.sqlite3")
