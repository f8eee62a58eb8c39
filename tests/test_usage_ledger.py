"""The usage ledger, budgets, ``GET /api/usage`` and ``vllama usage`` (issue 39), against the stand-in vLLM.

``vllama serve --upstream`` runs as a real process with a keys file (an admin, two users, one with a
budget); the real ``ollama`` and ``openai`` clients send a mixed workload. The ledger's rows must
match the per-key Prometheus counters, survive a restart, lose nothing on a clean stop and, on a
``kill -9``, only the rows not yet written. Budgets reset at their period with an injected clock
(``Ledger(clock=...)``), never a sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ollama
import pytest

from conftest import ROOT, SERVED, metric, start_proxy, stop

ADMIN, ALICE, BOB = "sk-admin-ledger", "sk-alice-ledger", "sk-bob-ledger"
KEYS = f"""
[[keys]]
name = "ops"
key = "{ADMIN}"
role = "admin"

[[keys]]
name = "alice"
key = "{ALICE}"

[[keys]]
name = "bob"
key = "{BOB}"
budget_tokens = 20
budget_period = "day"
"""


def _start(fake, tmp_path: Path, *flags: str, state: Path | None = None):
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    state = state or tmp_path / "state"
    return start_proxy(fake.url, "--api-key-file", str(keys), *flags, env={"VLLAMA_STATE_DIR": str(state)},
                       log=tmp_path / f"vllama-{time.monotonic_ns()}.log")


def _usage(url: str, key: str = ADMIN, **params) -> dict:
    r = httpx.get(url + "/api/usage", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _totals(body: dict) -> dict[str, tuple[int, int, int]]:
    out: dict[str, tuple[int, int, int]] = {}
    for r in body["usage"]:
        n, p, o = out.get(r["key"], (0, 0, 0))
        out[r["key"]] = (n + r["requests"], p + r["prompt_tokens"], o + r["output_tokens"])
    return out


def _ollama(url: str, key: str) -> ollama.Client:
    return ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"})


def _generate(url: str, key: str, n: int) -> None:
    for _ in range(n):
        _ollama(url, key).generate(model=SERVED, prompt="hi", stream=False)


def test_rows_match_the_metrics_survive_a_restart_and_a_kill_9_loses_only_what_was_not_written(fake, tmp_path):
    """Two workers (each its own writer to the one SQLite file) and a mixed workload, with a flush
    interval too long to pass: rows are written only on a clean stop or when /api/usage asks (it
    writes its own process's rows first). After the stop the rows are the per-key counters (nothing
    lost); a kill -9 then loses exactly the rows written neither way, and no others."""
    flags = ("--usage-flush-interval", "3600")
    p = _start(fake, tmp_path, "--workers", "2", *flags)
    try:
        import openai

        alice, bob = _ollama(p.url, ALICE), _ollama(p.url, BOB)
        for _ in range(3):
            list(alice.generate(model=SERVED, prompt="stream me", stream=True))
        alice.chat(model=SERVED, messages=[{"role": "user", "content": "hello"}])
        oa = openai.OpenAI(base_url=p.url + "/v1", api_key=BOB)
        oa.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        with pytest.raises(ollama.ResponseError):  # vLLM's 400: an error row, counted 4xx by the metrics too
            bob.generate(model=SERVED, prompt="[[fault:http400]]", stream=False)
        metrics = httpx.get(p.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    finally:
        stop(p.proc)  # a clean stop: every worker writes what waits
    assert p.proc.returncode == 0
    want = {k: (int(metric(metrics, "vllama_key_requests_total", key=k)),
                int(metric(metrics, "vllama_key_prompt_tokens_total", key=k)),
                int(metric(metrics, "vllama_key_output_tokens_total", key=k))) for k in ("alice", "bob")}
    assert want["alice"][0] == 4 and want["alice"][2] > 0 and want["bob"][0] == 2

    p = _start(fake, tmp_path, "--workers", "1", *flags)
    assert _totals(_usage(p.url)) == want  # the rows of both workers, after a restart
    errors = [(r["key"], r["errors"]) for r in _usage(p.url)["usage"] if r["errors"]]
    assert errors == [("bob", 1)] == [("bob", int(metric(metrics, "vllama_key_requests_total", key="bob", status="4xx")))]
    _generate(p.url, ALICE, 2)
    assert _totals(_usage(p.url))["alice"][0] == 6  # written now
    _generate(p.url, ALICE, 2)  # queued, not written
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait(10)
    p = _start(fake, tmp_path, "--workers", "1", *flags)
    try:
        assert _totals(_usage(p.url))["alice"][0] == 6  # the unwritten batch lost, nothing more
        assert (tmp_path / "state" / "usage.sqlite3").exists()
    finally:
        stop(p.proc)


class _Store:
    """The ledger's store, in memory: rows written, their tokens per key since a time, after an id."""

    where = "memory"
    ordered_ids = True

    def __init__(self) -> None:
        self.rows: list = []

    def write(self, rows) -> None:
        self.rows += rows

    def tokens(self, day: float, month: float, after_id: int):
        by_month: dict[str, int] = {}
        by_day: dict[str, int] = {}
        for i, r in enumerate(self.rows[after_id:], after_id + 1):
            n = r.prompt_tokens + r.output_tokens
            if r.ts >= month:
                by_month[r.key] = by_month.get(r.key, 0) + n
            if r.ts >= day:
                by_day[r.key] = by_day.get(r.key, 0) + n
        return by_month, by_day, len(self.rows)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("period,before,after", [
    ("day", "2026-11-26T23:59:59", "2026-11-27T00:00:00"),
    ("month", "2026-11-30T23:59:59", "2026-12-01T00:00:00"),
])
def test_a_budget_resets_at_its_period(period, before, after):
    """The clock is injected: the used tokens count in the period that holds them, and a new period starts at 0."""
    from vllama_proxy.api.policy.budgets import refuse_over_budget
    from vllama_proxy.api.policy.keys import Key
    from vllama_proxy.api.usage.ledger import Ledger
    from vllama_proxy.api.usage.store import Row
    from vllama_proxy.errors import BudgetExhausted

    def at(text: str) -> float:
        import calendar

        return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))

    now = [at(before) - 3600]
    key = Key(name="bob", role="user", budget_tokens=100, budget_period=period)

    async def run() -> None:
        ledger = Ledger(_Store, clock=lambda: now[0], refresh_interval=3600)
        await ledger.start()
        ledger.record(Row(now[0], "h", "bob", "m", "/api/generate", 200, 40, 59, 1.0))
        refuse_over_budget(ledger, key)  # 99 of 100: admitted
        await ledger.flush()  # written, and the totals read back from the store
        ledger.record(Row(now[0], "h", "bob", "m", "/api/generate", 200, 1, 0, 1.0))
        now[0] = at(before)
        with pytest.raises(BudgetExhausted) as e:
            refuse_over_budget(ledger, key)
        assert e.value.headers == {"Retry-After": "1"} and f"resets at {after}Z" in e.value.message
        now[0] = at(after)
        refuse_over_budget(ledger, key)  # a new period
        assert ledger.used("bob", period) == 0
        await ledger.close()

    asyncio.run(run())


def test_usage_per_role_and_a_budget_refusing_at_its_limit(fake, tmp_path):
    """``/api/usage`` and ``vllama usage``: everyone's for an admin key, its own for a user key; then
    bob's budget (20 tokens a day) refuses him once his usage reached it, naming when it resets."""
    p = _start(fake, tmp_path, "--workers", "1")
    try:
        _generate(p.url, ALICE, 2)
        _generate(p.url, BOB, 1)
        assert set(_totals(_usage(p.url))) == {"alice", "bob"}  # an admin: everyone's
        assert set(_totals(_usage(p.url, ALICE))) == {"alice"}  # a user: its own
        r = httpx.get(p.url + "/api/usage", params={"key": "bob"}, headers={"Authorization": f"Bearer {ALICE}"})
        assert r.status_code == 403 and "its own usage" in r.json()["error"]
        assert httpx.get(p.url + "/api/usage").status_code == 401
        bad = httpx.get(p.url + "/api/usage", params={"since": "yesterday"}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert bad.status_code == 400 and "YYYY-MM-DD" in bad.json()["error"]
        assert _usage(p.url, by="month")["usage"][0]["period"] == time.strftime("%Y-%m", time.gmtime())

        def cli(key: str, *args: str) -> str:
            env = {**os.environ, "OLLAMA_HOST": p.url, "OLLAMA_API_KEY": key, "PYTHONPATH": str(ROOT)}
            return subprocess.run([sys.executable, "-m", "vllama_proxy", "usage", *args], env=env, capture_output=True,
                                  text=True, timeout=30, check=True).stdout

        table = cli(ADMIN)
        assert table.splitlines()[0].split()[:3] == ["DAY", "KEY", "MODEL"]
        assert any(line.split()[1:4] == ["alice", SERVED, "2"] for line in table.splitlines())
        assert "20 per day" in table  # bob's budget
        mine = json.loads(cli(ALICE, "--json", "--since", time.strftime("%Y-%m")))
        assert {r["key"] for r in mine["usage"]} == {"alice"} and mine["budgets"] == []
        csv_lines = cli(ADMIN, "--csv", "--by", "month").splitlines()
        assert csv_lines[0] == "period,key,model,requests,errors,prompt_tokens,output_tokens"
        assert f"{time.strftime('%Y-%m', time.gmtime())},bob,{SERVED},1,0,1,8" in csv_lines

        bob = _ollama(p.url, BOB)
        used = 9
        while used < 20:  # each answer: 1 prompt + 8 output tokens; the request reaching the budget is served
            r = bob.generate(model=SERVED, prompt="hi", stream=False)
            used += r.prompt_eval_count + r.eval_count
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "hi", "stream": False},
                       headers={"Authorization": f"Bearer {BOB}"})
        assert r.status_code == 429
        tomorrow = time.strftime("%Y-%m-%d", time.gmtime(time.time() + 86400))
        assert r.json()["error"] == (f"key 'bob' used {used} tokens of its budget of 20 tokens per day; "
                                     f"the budget resets at {tomorrow}T00:00:00Z")
        assert 0 < int(r.headers["Retry-After"]) <= 86400
        _ollama(p.url, ALICE).generate(model=SERVED, prompt="hi", stream=False)  # alice is not held by bob's budget
        budgets = _usage(p.url, BOB)["budgets"]
        assert budgets == [{"key": "bob", "budget_tokens": 20, "period": "day", "used": used, "resets_at": f"{tomorrow}T00:00:00Z"}]
    finally:
        stop(p.proc)


def test_rows_older_than_the_retention_are_deleted_at_start(tmp_path):
    """``--usage-retention-days``: the process that prunes (worker 0) deletes older rows when it starts
    (and daily); the others, and a retention of 0, keep them."""
    from vllama_proxy.api.usage.ledger import Ledger
    from vllama_proxy.api.usage.store import Row, open_store

    now = time.time()
    store = open_store(None, tmp_path)
    store.write([Row(now - days * 86400, "h", "alice", "m", "/api/chat", 200, 1, 1, 1.0) for days in (0, 2, 40)])
    store.close()

    async def count_after_start(**kw) -> int:
        ledger = Ledger(lambda: open_store(None, tmp_path), **kw)
        await ledger.start()
        n = await asyncio.to_thread(ledger.store.count)
        await ledger.close()
        return n

    assert asyncio.run(count_after_start(retention_days=30, prunes=False)) == 3
    assert asyncio.run(count_after_start(retention_days=0, prunes=True)) == 3
    assert asyncio.run(count_after_start(retention_days=30, prunes=True)) == 2
    assert asyncio.run(count_after_start(retention_days=1, prunes=True)) == 1


def test_a_database_that_goes_away_costs_no_rows_until_the_cap_and_is_opened_again():
    """Writes that fail keep their rows for the next try on a new connection; beyond the cap
    (``MAX_PENDING_BATCHES`` batches) the oldest are dropped, so an outage never grows memory."""
    from vllama_proxy.api.usage import ledger as ledger_mod
    from vllama_proxy.api.usage.ledger import Ledger
    from vllama_proxy.api.usage.store import Row

    opened: list[_Store] = []
    down = [True]

    class Flaky(_Store):
        def write(self, rows) -> None:
            if down[0]:
                raise OSError("connection lost")
            super().write(rows)

    def opener() -> _Store:
        opened.append(Flaky())
        return opened[-1]

    async def run() -> None:
        ledger = Ledger(opener, flush_interval=0.01, flush_rows=2)
        await ledger.start()
        for i in range(3):
            ledger.record(Row(time.time(), "h", "alice", "m", "/api/chat", 200, 1, i, 1.0))
        deadline = time.monotonic() + 10
        while len(opened) < 3 and time.monotonic() < deadline:  # failed, reopened, failed again
            await asyncio.sleep(0.01)
        assert len(opened) >= 3 and ledger.used("alice", "day") == 6  # the rows wait, still counted for budgets
        down[0] = False
        while not opened[-1].rows and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert [r.output_tokens for r in opened[-1].rows] == [0, 1, 2]
        # the cap: with the database away, only the newest MAX_PENDING_BATCHES x flush_rows rows are kept
        down[0] = True
        for i in range(ledger_mod.MAX_PENDING_BATCHES * 2 + 5):
            ledger.record(Row(time.time(), "h", "bob", "m", "/api/chat", 200, 0, i, 1.0))
        n = len(opened)
        while len(opened) == n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(ledger._pending) == ledger_mod.MAX_PENDING_BATCHES * 2 and ledger._pending[0].output_tokens == 5
        down[0] = False
        await ledger.close()
        assert len(opened[-1].rows) == ledger_mod.MAX_PENDING_BATCHES * 2

    asyncio.run(run())


def test_rows_being_written_still_count_against_a_budget():
    """While a batch is in the database's hands (a write of SQLite's in a thread, long on a busy machine) its tokens
    count for the key's budget as before and after: the requests that made them have given their reservations back
    (``api/request/settler.py``), so a key whose used tokens dipped during each write was admitted past its budget
    (the real gate's 16 requests at once against a budget of 100: 252 tokens answered, in a CI run on 2 busy cores)."""
    import threading

    from vllama_proxy.api.usage.ledger import Ledger
    from vllama_proxy.api.usage.store import Row

    writing, written = threading.Event(), threading.Event()

    class Slow(_Store):
        def write(self, rows) -> None:
            writing.set()
            written.wait(60)
            super().write(rows)

    async def run() -> None:
        ledger = Ledger(Slow, flush_interval=3600, refresh_interval=3600)
        await ledger.start()
        ledger.record(Row(time.time(), "h", "thrifty", "m", "/v1/chat/completions", 200, 12, 30, 1.0))
        assert ledger.used("thrifty", "day") == 42
        flush = asyncio.create_task(ledger.flush())
        try:
            assert await asyncio.to_thread(writing.wait, 60)
            assert ledger.used("thrifty", "day") == 42  # in the database's hands, still counted
            ledger.record(Row(time.time(), "h", "thrifty", "m", "/v1/chat/completions", 200, 12, 30, 1.0))
            assert ledger.used("thrifty", "day") == 84
        finally:
            written.set()
        await flush
        assert ledger.used("thrifty", "day") == 84  # the first written, the second still queued
        await ledger.close()

    asyncio.run(run())


def test_rows_left_at_close_with_the_connection_gone_are_written_on_a_new_one():
    """A stop that cancels the ledger's task between a failed write and its reopen leaves no
    connection: close() opens one for the rows left, as a clean stop loses none (the test above
    lost 200 rows this way once in CI: ``usage_ledger_lost`` with ``'NoneType' ... 'write'``)."""
    from vllama_proxy.api.usage.ledger import Ledger
    from vllama_proxy.api.usage.store import Row

    opened: list[_Store] = []

    def opener() -> _Store:
        opened.append(_Store())
        return opened[-1]

    async def run() -> None:
        ledger = Ledger(opener, flush_interval=3600, flush_rows=1000)
        await ledger.start()
        ledger.record(Row(time.time(), "h", "alice", "m", "/api/chat", 200, 1, 7, 1.0))
        ledger.store = None  # where _reopen leaves it while the opener runs, when the stop cancels it there
        await ledger.close()
        assert [r.output_tokens for r in opened[-1].rows] == [7]

    asyncio.run(run())


def test_a_batch_goes_to_sqlite_as_one_statement_and_comes_back_exact(tmp_path):
    """The writer thread takes the GIL back after each SQLite statement, and each time the event loop,
    busy with a burst, may wait out the 5 ms switch interval: a batch is one INSERT of a JSON array
    (the GIL released while SQLite inserts it), never a statement per row. Every value comes back as
    written, in order (ids ascending): floats to the last bit, NULL, quotes, newlines, non-ASCII."""
    import random
    import sqlite3

    from vllama_proxy.api.usage.store import COLUMNS, Row, open_store

    rng = random.Random(39)
    rows = [Row(time.time() + rng.random() * 1e6, "h", f"key-{i % 3}", "qwen2.5:7b", "/api/chat", 200 if i % 5 else 500, i, 2 * i,
                round(rng.random() * 1e4, 2), None if i % 2 else 'stream "cut" \u00e9\U0001f600 \\ \n') for i in range(1000)]
    store = open_store(None, tmp_path)
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)
    store.write(rows)
    store.close()
    inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1, f"{len(inserts)} INSERT statements for one batch of {len(rows)} rows"
    with sqlite3.connect(tmp_path / "usage.sqlite3") as conn:
        back = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM vllama_usage ORDER BY id").fetchall()
    assert back == [tuple(r) for r in rows]
