"""Keys minted through the admin API (``/api/keys``, ``routes/keys.py``) and the ``/admin`` page, kept in the
usage database beside the ledger (``usage/store.py``'s choice: SQLite by default, PostgreSQL for several fronts).

A minted secret is ``vk-<8 hex>-<43 URL-safe chars>`` (256 random bits), shown once; the database keeps its
SHA-256 and its 8-hex ``prefix``, never the secret. Every change bumps one counter row (``vllama_keys_version``)
in the same transaction, and each action is written to ``vllama_keys_audit`` (never a secret). Invariant: every
worker of every front reads that row every :data:`POLL_SECONDS` and reloads the keys when it moved
(:func:`follow`), so a revoke reaches every front within about a second with no ``SIGHUP``; the worker that made
a change reloads at once; an expiry needs no reload (``KeyRing.find`` compares it with the clock). How to use it:
``docs/operations.md`` "Keys without editing a file"; why an unsalted SHA-256 and why polling:
``docs/decisions.md``.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from vllama_proxy.logs import get_logger
from .keys import KeySettings

log = get_logger("vllama.keys")

#: Seconds between two reads of the version counter (each worker).
POLL_SECONDS = 1.0
#: The fields of a minted key's ``spec`` column: its :class:`~.keys.KeySettings` but those with a column of their own
#: (``name``, ``expires_at``, ``note``). A row stored before a field existed reads it as its default (``keys.settings_of_row``).
SPEC_FIELDS = tuple(f for f in KeySettings.model_fields if f not in ("name", "expires_at", "note"))

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS vllama_keys (
        name TEXT PRIMARY KEY,
        prefix TEXT NOT NULL,
        sha256 TEXT NOT NULL UNIQUE,
        spec TEXT NOT NULL,
        expires_at DOUBLE PRECISION,
        revoked_at DOUBLE PRECISION,
        note TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        created_by TEXT NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        updated_by TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS vllama_keys_audit (
        id {id},
        ts DOUBLE PRECISION NOT NULL,
        who TEXT NOT NULL,
        action TEXT NOT NULL,
        key TEXT NOT NULL,
        detail TEXT NOT NULL)""",
    "CREATE TABLE IF NOT EXISTS vllama_keys_version (id INTEGER PRIMARY KEY, version BIGINT NOT NULL)",
)
_COLUMNS = ("name", "prefix", "sha256", "spec", "expires_at", "revoked_at", "note", "created_at", "created_by", "updated_at",
            "updated_by")


def new_secret() -> tuple[str, str]:
    """A fresh secret and its lookup prefix: ``("vk-1a2b3c4d-<43 chars>", "1a2b3c4d")``."""
    prefix = secrets.token_hex(4)
    return f"vk-{prefix}-{secrets.token_urlsafe(32)}", prefix


def digest_of(secret: str) -> str:
    """SHA-256 hex of ``secret`` (as ``KeyRing.find`` hashes what a client sends)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


class KeyConflict(Exception):
    """A name already taken (by a minted key, or the keys file's)."""


class KeyMissing(Exception):
    """No minted key of that name."""


class KeyStore:
    """The minted keys' tables in one database (:func:`open_key_store`); blocking calls, for a thread.

    Args:
        conn: a DB-API connection (sqlite3 or psycopg), used under the store's lock.
        placeholder: the driver's parameter mark.
        where: the database, in words.
    """

    def __init__(self, conn: Any, placeholder: str, where: str) -> None:
        self._conn = conn
        self._p = placeholder
        self._lock = threading.Lock()
        self.where = where

    def _run(self, sql: str, args: tuple = (), fetch: bool = False) -> list[tuple]:
        cur = self._conn.cursor()
        cur.execute(sql.replace("?", self._p), args)
        return cur.fetchall() if fetch else []

    def version(self) -> int:
        """The change counter (moves on every change)."""
        with self._lock:
            rows = self._run("SELECT version FROM vllama_keys_version WHERE id = 1", fetch=True)
            self._conn.commit()
        return int(rows[0][0]) if rows else 0

    def rows(self) -> list[dict[str, Any]]:
        """Every minted key, revoked ones too: the columns, ``spec`` as a dict."""
        with self._lock:
            found = self._run(f"SELECT {', '.join(_COLUMNS)} FROM vllama_keys ORDER BY name", fetch=True)
            self._conn.commit()
        out = []
        for r in found:
            d = dict(zip(_COLUMNS, r, strict=True))
            d["spec"] = orjson.loads(d["spec"])
            out.append(d)
        return out

    def _change(self, who: str, action: str, name: str, detail: dict[str, Any], now: float) -> None:
        self._run("UPDATE vllama_keys_version SET version = version + 1 WHERE id = 1")
        self._run("INSERT INTO vllama_keys_audit (ts, who, action, key, detail) VALUES (?, ?, ?, ?, ?)",
                  (now, who, action, name, orjson.dumps(detail).decode()))
        self._conn.commit()

    def _one(self, name: str) -> dict[str, Any] | None:
        rows = self._run(f"SELECT {', '.join(_COLUMNS)} FROM vllama_keys WHERE name = ?", (name,), fetch=True)
        if not rows:
            return None
        d = dict(zip(_COLUMNS, rows[0], strict=True))
        d["spec"] = orjson.loads(d["spec"])
        return d

    def create(self, settings: KeySettings, who: str) -> tuple[str, dict[str, Any]]:
        """Mint a key with ``settings``: ``(its secret, its row)``.

        Raises:
            KeyConflict: the name is taken (a revoked key keeps its name, for the audit log).
        """
        secret, prefix = new_secret()
        now = time.time()
        name, note = settings.name, settings.note
        expires_at = settings.expires_at.timestamp() if settings.expires_at is not None else None
        spec = settings.model_dump(include=set(SPEC_FIELDS))
        with self._lock:
            try:
                self._run(f"INSERT INTO vllama_keys ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                          (name, prefix, digest_of(secret), orjson.dumps(spec).decode(), expires_at, None, note,
                           now, who, now, who))
            except Exception as e:  # sqlite3.IntegrityError, psycopg.errors.UniqueViolation
                self._conn.rollback()
                if "unique" in str(e).lower() or "duplicate" in str(e).lower():
                    raise KeyConflict(name) from None
                raise
            self._change(who, "create", name, {**settings.model_dump(include=set(SPEC_FIELDS), exclude_defaults=True),
                                               "role": settings.role, "expires_at": expires_at, "note": note}, now)
            row = self._one(name)
            self._conn.commit()
        return secret, row  # type: ignore[return-value]

    def _live(self, name: str) -> dict[str, Any]:
        """``name``'s row if it is live (under the lock); else the transaction is ended and :class:`KeyMissing` raised."""
        row = self._one(name)
        if row is None or row["revoked_at"] is not None:
            self._conn.rollback()
            raise KeyMissing(name)
        return row

    def update(self, name: str, changes: dict[str, Any], who: str) -> dict[str, Any]:
        """Change a key's :data:`SPEC_FIELDS`, ``expires_at`` (seconds since the epoch, or ``None``) or ``note``
        (``changes`` holds only those given).

        Raises:
            KeyMissing: no live key of that name.
        """
        now = time.time()
        with self._lock:
            row = self._live(name)
            merged = KeySettings.model_validate({**row["spec"], **{k: v for k, v in changes.items() if k in SPEC_FIELDS},
                                                 "name": name})
            spec = merged.model_dump(include=set(SPEC_FIELDS))
            expires_at = changes.get("expires_at", row["expires_at"])
            note = changes.get("note", row["note"])
            self._run("UPDATE vllama_keys SET spec = ?, expires_at = ?, note = ?, updated_at = ?, updated_by = ? WHERE name = ?",
                      (orjson.dumps(spec).decode(), expires_at, note, now, who, name))
            self._change(who, "update", name, changes, now)
            row = self._one(name)
            self._conn.commit()
        return row  # type: ignore[return-value]

    def rotate(self, name: str, who: str) -> tuple[str, dict[str, Any]]:
        """A new secret for ``name`` (the old one refused from now on): ``(secret, row)``.

        Raises:
            KeyMissing: no live key of that name.
        """
        secret, prefix = new_secret()
        now = time.time()
        with self._lock:
            row = self._live(name)
            self._run("UPDATE vllama_keys SET prefix = ?, sha256 = ?, updated_at = ?, updated_by = ? WHERE name = ?",
                      (prefix, digest_of(secret), now, who, name))
            self._change(who, "rotate", name, {"prefix": prefix}, now)
            row = self._one(name)
            self._conn.commit()
        return secret, row  # type: ignore[return-value]

    def revoke(self, name: str, who: str) -> dict[str, Any]:
        """Revoke ``name`` for good (its row stays, for the list and the audit log).

        Raises:
            KeyMissing: no live key of that name.
        """
        now = time.time()
        with self._lock:
            row = self._live(name)
            self._run("UPDATE vllama_keys SET revoked_at = ?, updated_at = ?, updated_by = ? WHERE name = ?", (now, now, who, name))
            self._change(who, "revoke", name, {}, now)
            row = self._one(name)
            self._conn.commit()
        return row  # type: ignore[return-value]

    def audit(self, limit: int = 100) -> list[dict[str, Any]]:
        """The last ``limit`` actions, newest first: ``ts``, ``who``, ``action``, ``key``, ``detail`` (a dict)."""
        with self._lock:
            rows = self._run(f"SELECT ts, who, action, key, detail FROM vllama_keys_audit ORDER BY id DESC LIMIT {int(limit)}",
                             fetch=True)
            self._conn.commit()
        return [{"ts": ts, "who": who, "action": a, "key": k, "detail": orjson.loads(d)} for ts, who, a, k, d in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def open_key_store(db: str | None, state_dir: Path) -> KeyStore:
    """The minted keys' store in ``--usage-db``'s database (blocking: call it in a thread; ``usage.store.open_store``'s
    choice of database: ``None`` ``<state_dir>/usage.sqlite3``, ``postgresql://...``, or an SQLite path).

    Raises:
        ValueError: PostgreSQL asked without psycopg installed.
        sqlite3.Error, psycopg.Error, OSError: the database cannot be opened or its tables made.
    """
    if db is not None and db.startswith(("postgresql://", "postgres://")):
        try:
            import psycopg
        except ModuleNotFoundError:
            raise ValueError("a postgresql:// --usage-db needs psycopg: pip install 'vllama-proxy[postgres]'") from None
        conn = psycopg.connect(db, connect_timeout=10)
        with conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(398640)")  # several fronts may create the tables at once
            for sql in _SCHEMA:
                cur.execute(sql.format(id="BIGSERIAL PRIMARY KEY"))
            cur.execute("INSERT INTO vllama_keys_version (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING")
        conn.commit()
        return KeyStore(conn, "%s", f"postgresql on {conn.info.host or 'local socket'}, database {conn.info.dbname}")
    path = Path(db) if db else state_dir / "usage.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    for sql in _SCHEMA:
        conn.execute(sql.format(id="INTEGER PRIMARY KEY"))
    conn.execute("INSERT OR IGNORE INTO vllama_keys_version (id, version) VALUES (1, 0)")
    conn.commit()
    return KeyStore(conn, "?", str(path))


async def follow(store: KeyStore, apply: Any, interval: float = POLL_SECONDS) -> None:
    """Call ``apply(store.rows())`` whenever the version counter moves (every ``interval`` s, until cancelled);
    a read that fails is logged and tried again (the keys stay as they were)."""
    seen: int | None = None
    failing = False
    while True:
        try:
            v = await asyncio.to_thread(store.version)
            if v != seen:
                apply(await asyncio.to_thread(store.rows))
                seen = v
            if failing:
                log.info("keys_store_back", where=store.where)
            failing = False
        except Exception as e:  # the database away: keep the keys as they were, say so once
            if not failing:
                log.error("keys_store_read_failed", where=store.where, error=repr(e))
            failing = True
        await asyncio.sleep(interval)
