"""The usage ledger in PostgreSQL (``--usage-db postgresql://...``, issue 39): a real server started
here (Debian's ``postgresql``: ``initdb`` and ``pg_ctl`` from ``/usr/lib/postgresql/*/bin``, run as
the ``postgres`` user when the tests run as root), two vllama fronts writing to it, each seeing the
other's rows (that rows survive a restart is ``test_usage_ledger.py``'s, with SQLite).

Skipped, saying why, where no PostgreSQL server or no psycopg is installed (``.ci/run`` installs
both: ``apt-get install postgresql``, and the ``[postgres]`` extra).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import pytest

from conftest import SERVED, free_port, start_proxy, stop

BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
pytestmark = [
    pytest.mark.skipif(not BIN, reason="no PostgreSQL server (apt-get install postgresql)"),
    pytest.mark.skipif(importlib.util.find_spec("psycopg") is None, reason="no psycopg (pip install 'vllama-proxy[postgres]')"),
]


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A throwaway PostgreSQL server on a free loopback port; its URL."""
    bindir = Path(BIN[-1])
    as_user: list[str] = []
    data = Path(tempfile.mkdtemp(prefix="vllama-pg-"))
    if os.geteuid() == 0:  # postgres refuses to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user to run PostgreSQL as")
        os.chown(data, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    env = {**os.environ, "LC_ALL": "C"}
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data / "db"), "--auth=trust", "-U", "postgres", "-E", "UTF8", "--no-sync"],
                   check=True, capture_output=True, env=env, timeout=120)
    subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data / "db"), "-w", "-t", "60", "-l", str(data / "log"),
                    "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                   check=True, capture_output=True, env=env, timeout=90)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop"],
                       capture_output=True, env=env, timeout=60)
        shutil.rmtree(data, ignore_errors=True)


def _usage(url: str) -> dict[str, int]:
    body = httpx.get(url + "/api/usage", timeout=10).json()
    out: dict[str, int] = {}
    for r in body["usage"]:
        out[r["key"]] = out.get(r["key"], 0) + r["requests"]
    return out


def test_two_fronts_share_one_postgresql_ledger(fake, postgres, tmp_path):
    flags = ("--usage-db", postgres, "--workers", "1", "--usage-flush-interval", "0.1")
    with ThreadPoolExecutor(2) as pool:  # both start at once
        a, b = pool.map(lambda name: start_proxy(fake.url, *flags, env={"VLLAMA_STATE_DIR": str(tmp_path / name)},
                                                 log=tmp_path / f"{name}.log"), ["a", "b"])
    try:
        for _ in range(3):
            ollama.Client(host=a.url).generate(model=SERVED, prompt="hi", stream=False)
        ollama.Client(host=b.url).chat(model=SERVED, messages=[{"role": "user", "content": "hi"}])
        deadline = time.monotonic() + 15  # each front writes its own rows within --usage-flush-interval
        while (seen := _usage(b.url)) != {"-": 4} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == {"-": 4}  # an open server: every caller is "-"
        assert _usage(a.url) == {"-": 4}
        assert not (tmp_path / "a" / "usage.sqlite3").exists()
    finally:
        stop(a.proc)
        stop(b.proc)


def test_a_postgresql_ledger_made_before_end_users_gets_the_column_and_keeps_its_rows(postgres):
    """A database whose ``vllama_usage`` has no ``end_user`` column (as vllama made it before): opening it adds the
    nullable column; its old rows read as a key's own, new rows carry their end user, ``tokens`` counts both."""
    import psycopg

    from vllama_proxy.api.usage.store import Row, open_store

    with psycopg.connect(postgres, autocommit=True) as conn:
        conn.execute("CREATE DATABASE old_ledger")
    url = postgres.rsplit("/", 1)[0] + "/old_ledger"
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE vllama_usage (id BIGSERIAL PRIMARY KEY, ts DOUBLE PRECISION NOT NULL, host TEXT NOT NULL, "
                     "key TEXT NOT NULL, model TEXT NOT NULL, route TEXT NOT NULL, status INTEGER NOT NULL, "
                     "prompt_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, duration_ms DOUBLE PRECISION NOT NULL, "
                     "error TEXT)")
        conn.execute("INSERT INTO vllama_usage (ts, host, key, model, route, status, prompt_tokens, output_tokens, "
                     "duration_ms) VALUES (1000, 'h', 'old', 'm', '/api/chat', 200, 3, 4, 1.0)")
    store = open_store(url, Path(tempfile.gettempdir()))
    try:
        store.write([Row(2000, "h", "webui", "m", "/api/chat", 200, 5, 6, 1.0, None, "alice")])
        rows = {(r["key"], r["end_user"]): r["prompt_tokens"] + r["output_tokens"]
                for r in store.summary(0, "month", by_user=True)}
        assert rows == {("old", None): 7, ("webui", "alice"): 11}
        assert store.tokens(0, 0, 0)[0] == {"old": 7, "webui": 11, "webui\0alice": 11}
    finally:
        store.close()
    open_store(url, Path(tempfile.gettempdir())).close()  # again: the column is there, nothing to add
