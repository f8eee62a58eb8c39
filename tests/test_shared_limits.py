"""Per-key limits shared by several fronts (``--state-url redis://...``, ``api/policy/fleet_counters.py``):
two ``vllama serve --upstream`` fronts and a real ``redis-server`` started here (skipped where
none is installed: ``apt-get install redis-server``; ``.ci/run`` installs it)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from conftest import ALIAS, free_port, in_one_minute, start_fake, start_proxy, stop

pytest.importorskip("redis", reason="the redis package (pip install 'vllama-proxy[redis]')")
REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="no redis-server (apt-get install redis-server)")


class Redis:
    """A real ``redis-server`` on a free port (no persistence), stopped with the test."""

    def __init__(self, tmp_path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.cli("ping") != "PONG":
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def cli(self, *args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, check=False).stdout.strip()


@pytest.fixture
def redis_server(tmp_path):
    r = Redis(tmp_path)
    yield r
    stop(r.proc)


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


def test_two_fronts_share_a_keys_max_in_flight(tmp_path, model_dir, redis_url):
    """A key with ``max_in_flight = 2`` gets 2 requests in flight over both fronts, not 2 on each;
    a place freed on one front is taken on the other."""
    fake = start_fake(model_dir, env={"FAKE_VLLM_TOKEN_DELAY": "0.02"})
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "bob"\nkey = "bob-key"\nmax_in_flight = 2\n')
    fronts = [start_proxy(fake.url, "--api-key-file", str(keys), "--state-url", redis_url, "--fair-share", "off",
                          log=tmp_path / f"front{i}.log") for i in range(2)]
    bob = {"Authorization": "Bearer bob-key"}
    long = {"model": ALIAS, "messages": [{"role": "user", "content": "long [[tokens:2000]]"}]}
    short = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    try:
        with httpx.Client(timeout=30) as http:
            held = []
            for front in fronts:  # one stream held open on each front: 2 in flight in all
                ctx = http.stream("POST", front.url + "/api/chat", json=long, headers=bob)
                resp = ctx.__enter__()
                assert resp.status_code == 200
                lines = resp.iter_lines()
                next(lines)
                held.append((ctx, lines))  # the iterator too: collected, it would close the stream
            for front in fronts:
                r = http.post(front.url + "/api/chat", json=short, headers=bob)
                assert r.status_code == 429 and "every front" in r.json()["error"], (r.status_code, r.text)
                assert int(r.headers["Retry-After"]) >= 1
            held.pop(0)[0].__exit__(None, None, None)  # front 0's stream ends: its place goes back to the store
            deadline = time.monotonic() + 10
            while (r := http.post(fronts[1].url + "/api/chat", json=short, headers=bob)).status_code == 429:
                assert time.monotonic() < deadline, "the place freed on front 0 never reached front 1"
                time.sleep(0.05)
            assert r.status_code == 200, r.text
            held.pop()[0].__exit__(None, None, None)
    finally:
        for s in (*fronts, fake):
            stop(s.proc)


async def test_store_counts_over_processes(redis_url):
    """The store itself: two processes' counters (two fronts' workers) against one Redis: in flight,
    requests and tokens per minute, and a dead process's requests given back after its TTL."""
    from vllama_proxy.api.policy.fleet_counters import RedisKeyState

    a, b = RedisKeyState(redis_url, holder_ttl=1), RedisKeyState(redis_url, holder_ttl=1)

    async def enter(s, key: str, most: int | None) -> int | None:  # in flight only: its count before, or None
        got = await s.admit(key, None, None, most, count=True)
        return None if got.refused else got.before

    async def rate(s, key: str, rpm: int | None, tpm: int | None) -> tuple[str | None, int, int]:
        got = await s.admit(key, rpm, tpm, None, count=False)
        assert 0 < got.reset <= 60
        return got.refused, got.used, got.spent

    try:
        assert await enter(a, "k", 2) == 0 and await enter(b, "k", 2) == 1
        assert await enter(a, "k", 2) is None and await enter(b, "k", 2) is None
        assert await enter(a, "other", 2) == 0 and await enter(a, "k", None) == 2  # no limit: counted, never refused
        await a.finish("k", leave=True), await a.finish("k", leave=True)
        assert await enter(b, "k", 2) == 1
        # b dies without leaving (no heartbeat): its 2 requests of k come back once its hash expires
        deadline = time.monotonic() + 10
        while await enter(a, "k", 2) is None:
            assert time.monotonic() < deadline, "a dead process's requests were never given back"
            await asyncio.sleep(0.1)
        assert await rate(a, "r", 2, None) == (None, 1, 0)
        assert await rate(b, "r", 2, None) == (None, 2, 0)
        assert await rate(a, "r", 2, None) == ("rpm", 2, 0)  # rpm 2 over both
        await b.finish("t", tokens=100)
        assert await rate(a, "t", None, 100) == ("tpm", 0, 100)  # tpm spent on b refuses on a
        # both in one round trip: the minute first (a refusal there counts nothing in flight), then in flight
        both = await a.admit("both", 1, None, 1, count=True)
        assert (both.refused, both.used, both.before) == (None, 1, 0)
        assert (await b.admit("both", 2, None, 1, count=True))[:2] == ("max_in_flight", 2)
        assert (await b.admit("both", 2, None, 5, count=True)).refused == "rpm"
        assert (await a.admit("free", None, None, None, count=False)).refused is None
    finally:
        await a.close()
        await b.close()


RATED = """
[[keys]]
name = "capped"
key = "sk-capped"
rpm = 3

[[keys]]
name = "tokens"
key = "sk-tokens"
tpm = 30
"""


def test_two_fronts_share_a_keys_rpm_and_tpm_and_fail_open_to_their_own(tmp_path, model_dir, redis_server):
    """rpm 3 is 3 requests a minute over both fronts, not 3 on each; tpm 30 spent on one front
    refuses on the other; the 429 carries ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers as on
    one front. Redis stopped: each front goes on with its own minute (what it admitted already
    counts), and answers; no 500, no refusal for the store's sake."""
    fake = start_fake(model_dir)
    keys = tmp_path / "keys.toml"
    keys.write_text(RATED)
    fronts = [start_proxy(fake.url, "--api-key-file", str(keys), "--state-url", redis_server.url, "--fair-share", "off",
                          log=tmp_path / f"front{i}.log") for i in range(2)]

    def ask(front, key: str, content: str = "x", n: int = 1) -> httpx.Response:
        return httpx.post(front.url + "/api/chat", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                          json={"model": ALIAS, "messages": [{"role": "user", "content": content}], "stream": False,
                                "options": {"num_predict": n}})

    try:
        in_one_minute(20)
        answers = [ask(fronts[0], "sk-capped"), ask(fronts[1], "sk-capped"), ask(fronts[0], "sk-capped")]
        assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
        assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["2", "1", "0"]
        for front in fronts:  # the fourth, on either front: the key's minute is spent over both
            over = ask(front, "sk-capped")
            assert over.status_code == 429 and "rpm" in over.json()["error"], (over.status_code, over.text)
            assert 1 <= int(over.headers["Retry-After"]) <= 60
            assert over.headers["x-ratelimit-limit-requests"] == "3" and over.headers["x-ratelimit-remaining-requests"] == "0"
        first = ask(fronts[0], "sk-tokens", "one two three [[tokens:40]]", 40)
        assert first.status_code == 200 and first.headers["x-ratelimit-remaining-tokens"] == "30"
        spent = ask(fronts[1], "sk-tokens")  # spent on front 0, refused on front 1
        assert spent.status_code == 429 and "tpm" in spent.json()["error"], spent.text
        assert spent.headers["x-ratelimit-remaining-tokens"] == "0" and int(spent.headers["Retry-After"]) >= 1

        stop(redis_server.proc)  # fail open: each front on its own minute, which counted what it admitted
        assert ask(fronts[1], "sk-capped").status_code == 200  # front 1 admitted one of the three
        assert ask(fronts[1], "sk-capped").status_code == 200
        assert ask(fronts[1], "sk-capped").status_code == 429
        assert ask(fronts[0], "sk-capped").status_code == 200  # front 0 admitted two
        assert ask(fronts[0], "sk-capped").status_code == 429
        assert ask(fronts[1], "sk-tokens").status_code == 200  # front 1 spent none of the 40 tokens
        assert ask(fronts[0], "sk-tokens").status_code == 429
        assert "state_store_unreachable" in (tmp_path / "front0.log").read_text()
    finally:
        for s in (*fronts, fake):
            stop(s.proc)


async def test_a_place_given_back_while_the_store_is_down_reaches_it_later(redis_server):
    """A request counted in Redis whose end comes while Redis does not answer: its place is given back
    once it answers again (else the key would lose a place for good: the holder's heartbeat keeps its
    hash alive); meanwhile the store is not asked again for a while (one timeout, not one per request)."""
    from vllama_proxy.api.policy import fleet_counters

    a, b = fleet_counters.RedisKeyState(redis_server.url, holder_ttl=3), fleet_counters.RedisKeyState(redis_server.url, holder_ttl=3)
    await a.start()
    try:
        assert (await a.admit("k", None, None, 1, count=True)).refused is None
        assert (await b.admit("k", None, None, 1, count=True)).refused == "max_in_flight"
        redis_server.cli("client", "pause", str(int(fleet_counters.TIMEOUT * 1000 + 1500)), "all")
        await a.finish("k", leave=True)  # times out: owed
        started = time.monotonic()
        assert await a.admit("k", None, None, 1, count=True) is None  # not asked: this front's own count only
        assert time.monotonic() - started < 0.5
        deadline = time.monotonic() + 15
        while (await b.admit("k", None, None, 1, count=True)).refused:
            assert time.monotonic() < deadline, "the place given back while the store was down never reached it"
            await asyncio.sleep(0.2)
    finally:
        await a.close()
        await b.close()


FAIR = """
[[keys]]
name = "heavy"
key = "sk-heavy"

[[keys]]
name = "light"
key = "sk-light"
"""


def test_a_key_flooding_two_fronts_is_counted_once_in_the_fair_share(tmp_path, model_dir, redis_url):
    """Two fronts, each sending at most 4 requests upstream (its fair queue's capacity): ``heavy``
    keeps 12 requests waiting on each front, ``light`` 12 on front 0 only. Each front alone would
    split its 4 places evenly between the keys it sees, so heavy would get front 0's 2 and front 1's
    4: 3x light. With the store, front 0 counts heavy's service on front 1 in heavy's counter, and
    gives light what heavy already got elsewhere: over both fronts heavy gets less than 2x light."""
    fake = start_fake(model_dir, env={"FAKE_VLLM_TOKEN_DELAY": "0.02"})
    keys = tmp_path / "keys.toml"
    keys.write_text(FAIR)
    fronts = [start_proxy(fake.url, "--api-key-file", str(keys), "--state-url", redis_url, "--fair-share", "on",
                          "--max-running", "4", "--max-queue", "64", "--fair-reserve", "0", "--workers", "1",
                          log=tmp_path / f"front{i}.log") for i in range(2)]
    done: list[tuple[str, float]] = []
    halt = threading.Event()

    def loop(front, key: str) -> None:
        with httpx.Client(timeout=60) as http:
            while not halt.is_set():
                r = http.post(front.url + "/api/generate", headers={"Authorization": f"Bearer sk-{key}"},
                              json={"model": ALIAS, "prompt": f"{key} [[tokens:20]]", "stream": False,
                                    "options": {"num_predict": 20}})
                assert r.status_code == 200, r.text
                done.append((key, time.monotonic()))

    work = [(f, "heavy") for f in fronts for _ in range(12)] + [(fronts[0], "light")] * 12
    threads = [threading.Thread(target=loop, args=w, daemon=True) for w in work]
    try:
        for t in threads:
            t.start()
        time.sleep(3)  # every loop has a request waiting, and each front has read heavy's counter once
        start = time.monotonic()
        time.sleep(8)
        end = time.monotonic()
        halt.set()
        for t in threads:
            t.join(60)
        got = {k: sum(1 for key, at in done if key == k and start <= at < end) for k in ("heavy", "light")}
        assert got["light"] > 0 and got["heavy"] < 2 * got["light"], got
    finally:
        halt.set()
        for s in (*fronts, fake):
            stop(s.proc)


async def test_the_other_fronts_service_counts_while_the_key_contends_here():
    """``FairQueue.absorb``: what a key got on the other fronts since this front last read it is added
    to its counter here; the first read after the key became active here only sets the baseline; an
    older (lower) read, from another worker of this front, changes nothing."""
    from vllama_proxy.api.policy.fair_queue import FairQueue

    q = FairQueue(1, 1, 4)
    q.absorb(0, 500.0)  # never active here: a baseline, no debt for what it got before
    assert q.counter(0) == 0
    q.absorb(0, 530.0)
    assert q.counter(0) == 30
    q.absorb(0, 510.0)  # an older read, answered late: nothing (not a new baseline, which would count 20 twice)
    q.absorb(0, 545.0)
    assert q.counter(0) == 45
    await q.turn(0, 1, cost=4.0)  # key 1 becomes active here
    start = q.counter(1)
    q.absorb(1, 1000.0)  # its first read since: the baseline
    assert q.counter(1) == start
    q.absorb(1, 1100.0)
    assert q.counter(1) == start + 100
    q.done(0, 1)
    await q.turn(0, 1, cost=4.0)  # idle here meanwhile, active again: served elsewhere since is no debt
    again = q.counter(1)
    q.absorb(1, 5000.0)
    assert q.counter(1) == again
    q.done(0, 1)


RESERVING = """
[[keys]]
name = "thrifty"
key = "sk-thrifty"
budget_tokens = 100
budget_period = "day"

[[keys]]
name = "minute"
key = "sk-minute"
tpm = 100
"""


@pytest.mark.parametrize("key", ["thrifty", "minute"])
def test_requests_sent_at_once_to_two_fronts_cannot_overspend_a_budget_or_a_tpm(tmp_path, model_dir, redis_url, key):
    """16 requests at once, 8 to each front, of a key with 100 tokens (a day's budget, or a minute's tpm), the
    ledger in one database: each request reserves its worst case (its prompt by size + 100, more than the key
    has) in Redis at admission, so one request is answered over both fronts, not one on each (before: all 16)."""
    fake = start_fake(model_dir, env={"FAKE_VLLM_TOKEN_DELAY": "0.02"})
    keys = tmp_path / "keys.toml"
    keys.write_text(RESERVING)
    db = tmp_path / "usage.sqlite3"
    fronts = [start_proxy(fake.url, "--api-key-file", str(keys), "--state-url", redis_url, "--usage-db", str(db),
                          log=tmp_path / f"front{i}.log") for i in range(2)]
    body = {"model": ALIAS, "max_tokens": 100, "messages": [{"role": "user", "content": "hi [[tokens:100]]"}]}

    async def at_once() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(fronts[i % 2].url + "/v1/chat/completions", json=body,
                                               headers={"Authorization": f"Bearer sk-{key}"}) for i in range(16)))
        return [r.status_code for r in rs]

    try:
        statuses = asyncio.run(at_once())
        assert statuses.count(200) >= 1 and set(statuses) <= {200, 429}, statuses
        deadline = time.monotonic() + 30
        while True:  # every request's row, both fronts' (each writes its rows within its flush interval)
            rows = httpx.get(fronts[0].url + "/api/usage", params={"key": key}, headers={"Authorization": f"Bearer sk-{key}"},
                             timeout=10).json()["usage"]
            if sum(u["requests"] for u in rows) == 16:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
        used = sum(u["prompt_tokens"] + u["output_tokens"] for u in rows)
        assert statuses.count(200) == 1 and 100 <= used <= 100 + 20, (used, statuses)
    finally:
        for s in (*fronts, fake):
            stop(s.proc)


FRONT_USERS = """
[[keys]]
name = "webui"
key = "sk-webui"
trusted_front = true
user_rpm = 2

[[keys]]
name = "webui-2"
key = "sk-webui-2"
trusted_front = true
user_max_in_flight = 1

[[keys]]
name = "webui-3"
key = "sk-webui-3"
trusted_front = true
user_tpm = 30
"""


def test_an_end_users_limits_hold_over_two_fronts(tmp_path, model_dir, redis_url):
    """One Open WebUI user behind a trusted-front key with ``user_rpm = 2`` gets 2 requests a minute over both
    fronts, not 2 on each; another user of the same key is not touched by it; ``user_max_in_flight = 1`` (a second
    key) is one request over both fronts, and a place freed on one front is taken on the other; ``user_tpm = 30`` (a third key) spent
    on one front refuses on the other (``end_users.store_name`` in the store)."""
    fake = start_fake(model_dir, env={"FAKE_VLLM_TOKEN_DELAY": "0.02"})
    keys = tmp_path / "keys.toml"
    keys.write_text(FRONT_USERS)
    fronts = [start_proxy(fake.url, "--api-key-file", str(keys), "--state-url", redis_url, "--fair-share", "off",
                          log=tmp_path / f"front{i}.log") for i in range(2)]

    def ask(http, front, user: str, content: str = "hi", key: str = "sk-webui", n: int = 1) -> httpx.Response:
        return http.post(front.url + "/api/chat", headers={"Authorization": f"Bearer {key}", "X-OpenWebUI-User-Id": user},
                         json={"model": ALIAS, "messages": [{"role": "user", "content": content}], "stream": False,
                               "options": {"num_predict": n}})

    try:
        with httpx.Client(timeout=30) as http:
            in_one_minute(25)
            assert ask(http, fronts[0], "alice").status_code == 200
            assert ask(http, fronts[1], "alice").status_code == 200
            for front in fronts:  # her third, on either front: her minute is spent over both
                over = ask(http, front, "alice")
                assert over.status_code == 429, (over.status_code, over.text)
                assert "user_rpm" in over.json()["error"] and "every front" in over.json()["error"], over.text
                assert 1 <= int(over.headers["Retry-After"]) <= 60
            assert ask(http, fronts[1], "bob").status_code == 200  # the key's other user has his own minute

            # user_max_in_flight = 1 over both fronts: carol's stream held open on front 0 refuses her on front 1
            long = {"model": ALIAS, "messages": [{"role": "user", "content": "long [[tokens:2000]]"}]}
            with http.stream("POST", fronts[0].url + "/api/chat", json=long,
                             headers={"Authorization": "Bearer sk-webui-2", "X-OpenWebUI-User-Id": "carol"}) as held:
                assert held.status_code == 200
                lines = held.iter_lines()
                next(lines)
                busy = ask(http, fronts[1], "carol", key="sk-webui-2")
                assert ask(http, fronts[1], "dave", key="sk-webui-2").status_code == 200  # his own place
                assert busy.status_code == 429 and "user_max_in_flight" in busy.json()["error"], busy.text
                assert "every front" in busy.json()["error"], busy.text
            deadline = time.monotonic() + 10  # her stream ended: the place goes back to the store
            while (r := ask(http, fronts[1], "carol", key="sk-webui-2")).status_code == 429:
                assert time.monotonic() < deadline, "carol's place freed on front 0 never reached front 1"
                time.sleep(0.05)
            assert r.status_code == 200, r.text

            # user_tpm = 30: erin's 40 tokens on front 0 spend her minute on front 1 too (added at the request's end)
            assert ask(http, fronts[0], "erin", "one two three [[tokens:40]]", key="sk-webui-3", n=40).status_code == 200
            spent = ask(http, fronts[1], "erin", key="sk-webui-3")
            assert spent.status_code == 429 and "user_tpm" in spent.json()["error"], spent.text
            assert spent.headers["x-ratelimit-remaining-tokens"] == "0"
    finally:
        for s in (*fronts, fake):
            stop(s.proc)
