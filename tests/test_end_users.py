"""End users as sub-tenants of a trusted front's key (``api/end_users.py``), through ``vllama serve`` on the
stand-in vLLM, and the ledger's migration to its ``end_user`` column.

The fair-share test uses the stand-in for what the real vLLM on CPU cannot show quickly: a flood that holds every one of
vLLM's running slots (``FAKE_VLLM_MAX_NUM_SEQS``) while the order in which requests reach it (``/_fake/requests``) is
the order vllama's fair queue let them go.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import sqlite3
import time

import asyncio
import os
import subprocess
import sys

import httpx
import orjson
from conftest import ROOT, log_events, metric, place

from vllama_proxy.api.policy.fair_queue import FairQueue
from vllama_proxy.api.usage.store import Row, open_store

FRONT = """
[[keys]]
name = "webui"
key = "sk-webui"
trusted_front = {trusted}
{extra}

[[keys]]
name = "plain"
key = "sk-plain"
{extra}

[[keys]]
name = "boss"
key = "sk-boss"
role = "admin"
"""


def _keys(tmp_path, *, trusted: bool = True, extra: str = ""):
    keys = tmp_path / "keys.toml"
    keys.write_text(FRONT.format(trusted="true" if trusted else "false", extra=extra))
    return keys


def _port(s) -> str:
    argv = s.launched()[0]
    return argv[argv.index("--port") + 1]


def _sent(s) -> list[dict]:
    return [r for r in httpx.get(f"http://127.0.0.1:{_port(s)}/_fake/requests").json() if isinstance(r.get("body"), dict)]


def _in_flight(s) -> float:
    """vllama's ``vllama_requests_in_flight``: requests admitted, running or queued."""
    return metric(httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sk-boss"}).text, "vllama_requests_in_flight")


def _stats(s) -> dict:
    return httpx.get(f"http://127.0.0.1:{_port(s)}/_fake/stats").json()


def _wait(cond, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _ask(s, user: str | None, prompt: str, n: int, key: str = "sk-webui", rid: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"X-Request-ID": rid} if rid else {})}
    if user is not None:
        headers["X-OpenWebUI-User-Id"] = user  # as Open WebUI sends it with ENABLE_FORWARD_USER_INFO_HEADERS=true
    return httpx.post(s.url + "/api/generate", headers=headers, timeout=120,
                      json={"model": "prod", "prompt": prompt, "stream": False, "options": {"num_predict": n}})


def _serve(serve, hub, tmp_path, keys, places: int = 4, *more: str):
    place(hub, "acme/tiny-prod")
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(keys),
              "--max-running", str(places), "--max-queue", "64", *more,
              env={"FAKE_VLLM_TOKEN_DELAY": "0.05", "FAKE_VLLM_MAX_NUM_SEQS": str(places)})
    s.wait_ready()
    return s


def _flood_then_other(s) -> tuple[int, int, float]:
    """alice floods the key with 10 requests (3 to 7.5 s each) over 4 places; once they fill every place, bob asks
    once. Returns (bob's place in the order vLLM got the requests, alice's requests that vLLM got after bob had
    reached vllama and before bob, bob's wait in seconds). When bob reached vllama: his access-log line's end less
    its duration, on this test's clock (the stand-in's ``arrived`` is ``time.monotonic()``): on a busy machine his
    request took seconds to arrive, while alice's ended and their places went to her next."""
    with cf.ThreadPoolExecutor(16) as ex:
        flood = [ex.submit(_ask, s, "alice", f"flood{i} [[tokens:{60 + 10 * i}]]", 60 + 10 * i) for i in range(10)]
        _wait(lambda: _stats(s)["running"] == 4, "alice's flood did not fill the 4 running slots")
        _wait(lambda: _in_flight(s) == 10, "alice's 10 requests did not all reach vllama")  # 6 of them queued
        wall0, t0 = time.time(), time.monotonic()
        other = _ask(s, "bob", "bob [[tokens:2]]", 2, rid="bobs-one")
        waited = time.monotonic() - t0
        assert other.status_code == 200, other.text
        assert all(f.result().status_code == 200 for f in flood)
    sent = _sent(s)
    order = [r["body"]["messages"][0]["content"].split()[0] for r in sent]
    bob = order.index("bob")
    (line,) = [e for e in log_events(s.log) if e.get("event") == "request" and e.get("client_request_id") == "bobs-one"]
    ended = datetime.datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()
    reached = ended - line["duration_ms"] / 1000 - wall0 + t0
    overtook = sum(reached < r["arrived"] < sent[bob]["arrived"] for r in sent[:bob])
    return bob, overtook, waited


def test_one_end_users_flood_does_not_stall_another_users_request_behind_one_key(serve, hub, tmp_path):
    """Two end users behind one trusted front's key: bob's one request goes upstream at the first place alice's flood
    frees, ahead of her 6 waiting requests (the key's FIFO put it last, after all 10); the ledger names both."""
    s = _serve(serve, hub, tmp_path, _keys(tmp_path))
    place_of_bob, overtook, waited = _flood_then_other(s)
    print(f"bob's wait behind alice's flood, one key as a trusted front: {waited:.2f} s, place {place_of_bob}")
    # none of alice's waiting requests went before him (one may have, in the moment between his access line's
    # start and his place in the queue); a first come, first served queue sends all 6 first
    assert overtook <= 1 and place_of_bob < 10, (place_of_bob, overtook)
    usage = httpx.get(s.url + "/api/usage?by=user", headers={"Authorization": "Bearer sk-boss"}).json()["usage"]
    by_user = {(r["key"], r["end_user"]): r["requests"] for r in usage}
    assert by_user == {("webui", "alice"): 10, ("webui", "bob"): 1}, usage
    only_bob = httpx.get(s.url + "/api/usage?user=bob", headers={"Authorization": "Bearer sk-webui"}).json()["usage"]
    assert [(r["end_user"], r["requests"]) for r in only_bob] == [("bob", 1)]
    assert '"end_user": "bob"' in s.log.read_text() or '"end_user":"bob"' in s.log.read_text()


def test_an_untrusted_keys_user_header_is_ignored_its_users_are_one_tenant(serve, hub, tmp_path):
    """The same flood through a key that is not a trusted front: the header names nobody (no end user in the ledger or
    the access log) and bob's request waits in the key's FIFO behind alice's, as every request of one key does. Its
    wait is the measurement to set beside the trusted front's."""
    s = _serve(serve, hub, tmp_path, _keys(tmp_path, trusted=False))
    place_of_bob, overtook, waited = _flood_then_other(s)
    print(f"bob's wait behind alice's flood, one key not a trusted front: {waited:.2f} s, place {place_of_bob}")
    assert place_of_bob == 10, place_of_bob  # last: the key's own queue is first come, first served
    usage = httpx.get(s.url + "/api/usage?by=user", headers={"Authorization": "Bearer sk-boss"}).json()["usage"]
    assert {(r["key"], r["end_user"]) for r in usage} == {("webui", None)}, usage
    assert "end_user" not in s.log.read_text()


def test_per_user_limits_refuse_one_user_naming_the_user_limit_and_not_the_other(serve, hub, tmp_path):
    extra = "user_rpm = 2\nuser_max_in_flight = 1"
    s = _serve(serve, hub, tmp_path, _keys(tmp_path, extra=extra))
    for user in ("alice", "alice2"):  # user_rpm counts in the wall clock's minute: a run across its end goes again
        minute = time.time() // 60
        assert _ask(s, user, "one [[tokens:2]]", 2).status_code == 200
        assert _ask(s, user, "two [[tokens:2]]", 2).status_code == 200
        third = _ask(s, user, "three [[tokens:2]]", 2)
        if time.time() // 60 == minute:
            break
    assert third.status_code == 429 and "user_rpm of 2" in third.json()["error"] and f"end user '{user}'" in third.json()["error"]
    assert int(third.headers["Retry-After"]) >= 1
    assert _ask(s, "bob", "bob [[tokens:2]]", 2).status_code == 200  # bob's own minute
    # a key not a trusted front has no end users: its header changes nothing, the user limits do not apply
    assert all(_ask(s, "alice", f"p{i} [[tokens:2]]", 2, key="sk-plain").status_code == 200 for i in range(3))
    # user_max_in_flight: carol's second request while her first still runs
    with cf.ThreadPoolExecutor(2) as ex:
        long = ex.submit(_ask, s, "carol", "long [[tokens:400]]", 400)
        _wait(lambda: _stats(s)["running"] == 1, "carol's first request did not start")
        second = _ask(s, "carol", "again [[tokens:2]]", 2)
        assert second.status_code == 429 and "user_max_in_flight" in second.json()["error"], second.text
        assert _ask(s, "dave", "dave [[tokens:2]]", 2).status_code == 200
        assert long.result().status_code == 200


def test_a_users_budget_refuses_that_user_once_spent(serve, hub, tmp_path):
    s = _serve(serve, hub, tmp_path, _keys(tmp_path, extra="user_budget_tokens = 20"))
    assert _ask(s, "alice", "spend [[tokens:30]]", 30).status_code == 200  # 30 output tokens: over alice's 20
    refused = _ask(s, "alice", "more [[tokens:2]]", 2)
    assert refused.status_code == 429 and "user_budget_tokens of 20" in refused.json()["error"], refused.text
    assert _ask(s, "bob", "bob [[tokens:2]]", 2).status_code == 200


def test_the_access_log_hashes_end_users_where_the_key_asks(serve, hub, tmp_path):
    s = _serve(serve, hub, tmp_path, _keys(tmp_path, extra="hash_end_users = true"))
    assert _ask(s, "alice@example.com", "hi [[tokens:2]]", 2).status_code == 200
    # the OpenAI body's `user` names the end user on /v1 when no header does
    r = httpx.post(s.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-webui"}, timeout=60,
                   json={"model": "prod", "messages": [{"role": "user", "content": "x [[tokens:2]]"}], "max_tokens": 2,
                         "user": "bob@example.com"})
    assert r.status_code == 200, r.text
    # the access-log line is written once the answer went out: wait for the second
    _wait(lambda: s.log.read_text().count('"end_user"') >= 2, "the /v1 request's access-log line")
    log = s.log.read_text()
    assert "alice@example.com" not in log and "bob@example.com" not in log, log[-3000:]
    hashed = [orjson.loads(line)["end_user"] for line in log.splitlines() if '"end_user"' in line and '"request"' in line]
    assert len(hashed) == 2 and all(len(h) == 16 and int(h, 16) >= 0 for h in hashed), (hashed, log[-3000:])
    usage = httpx.get(s.url + "/api/usage?by=user", headers={"Authorization": "Bearer sk-boss"}).json()["usage"]
    assert {r["end_user"] for r in usage} == {"alice@example.com", "bob@example.com"}  # the ledger keeps the id
    env = {**os.environ, "OLLAMA_HOST": s.url, "OLLAMA_API_KEY": "sk-boss", "PYTHONPATH": str(ROOT)}
    table = subprocess.run([sys.executable, "-m", "vllama_proxy", "usage", "--by", "user"], env=env, capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert table.splitlines()[0].split()[:4] == ["MONTH", "KEY", "END", "USER"], table
    assert any(line.split()[1:3] == ["webui", "bob@example.com"] for line in table.splitlines()), table


def test_a_ledger_made_before_end_users_gets_the_column_and_keeps_its_rows(tmp_path):
    path = tmp_path / "usage.sqlite3"
    conn = sqlite3.connect(path)  # the table as vllama made it before the end_user column
    conn.execute("CREATE TABLE vllama_usage (id INTEGER PRIMARY KEY, ts DOUBLE PRECISION NOT NULL, host TEXT NOT NULL, "
                 "key TEXT NOT NULL, model TEXT NOT NULL, route TEXT NOT NULL, status INTEGER NOT NULL, "
                 "prompt_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, duration_ms DOUBLE PRECISION NOT NULL, "
                 "error TEXT)")
    conn.execute("INSERT INTO vllama_usage (ts, host, key, model, route, status, prompt_tokens, output_tokens, duration_ms) "
                 "VALUES (1000, 'h', 'old', 'm', '/api/chat', 200, 3, 4, 1.0)")
    conn.commit()
    conn.close()
    store = open_store(str(path), tmp_path)
    store.write([Row(2000, "h", "webui", "m", "/api/chat", 200, 5, 6, 1.0, None, "alice")])
    rows = {(r["key"], r["end_user"]): r["prompt_tokens"] + r["output_tokens"] for r in store.summary(0, "month", by_user=True)}
    assert rows == {("old", None): 7, ("webui", "alice"): 11}
    month, _, _ = store.tokens(0, 0, 0)
    assert month == {"old": 7, "webui": 11, "webui\0alice": 11}
    store.close()
    open_store(str(path), tmp_path).close()  # opened again: the column is there, nothing to add


def test_a_fronts_users_split_its_weight_the_key_keeps_its_share_against_another_key():
    """One place; key 1 (a trusted front) has three end users flooding, key 2 one flood, equal weights and outputs:
    VTC within the front gives each user a third of the front's half, and the front as a whole half, not three
    quarters (three counters of full weight would)."""
    async def run() -> list[int]:
        q = FairQueue(1, workers=1, keys=64)
        served: list[int] = []

        async def one(counter: int, parent: int) -> None:
            await q.turn(0, counter, parent=parent)
            served.append(counter)
            await asyncio.sleep(0)
            q.done(0, counter, output=10)

        # every counter backlogged from the start: 40 requests each, waiting at once
        await asyncio.gather(*(one(c, p) for _ in range(40) for c, p in ((2, -1), (40, 1), (41, 1), (42, 1))))
        return served

    served = asyncio.run(run())[:60]  # while all four flood
    front = sum(1 for c in served if c >= 40)
    assert 27 <= front <= 33, (front, served)
    per_user = [served.count(40 + u) for u in range(3)]
    assert max(per_user) - min(per_user) <= 2, per_user


def test_a_key_minted_through_the_api_as_a_trusted_front_limits_each_end_user(serve, hub, tmp_path):
    """A key minted through ``/api/keys`` can be all a keys-file key can (one model of a key's settings,
    ``policy/keys.py``'s ``KeySettings``): minted as a trusted front with ``user_max_in_flight``, its end users each get
    the limit, as the keys file's ``webui`` does in the test above."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "boss"\nkey = "sk-boss"\nrole = "admin"\n')
    s = _serve(serve, hub, tmp_path, keys)
    made = httpx.post(s.url + "/api/keys", headers={"Authorization": "Bearer sk-boss"}, timeout=30,
                      json={"name": "webui", "trusted_front": True, "user_max_in_flight": 1, "note": "Open WebUI"})
    assert made.status_code == 200, made.text
    entry, secret = made.json()["key"], made.json()["secret"]
    assert entry["trusted_front"] is True and entry["user_max_in_flight"] == 1 and entry["user_header"] == "X-OpenWebUI-User-Id"
    listed = {k["name"]: k for k in httpx.get(s.url + "/api/keys", headers={"Authorization": "Bearer sk-boss"}).json()["keys"]}
    assert listed["webui"]["user_max_in_flight"] == 1 and listed["boss"]["trusted_front"] is False
    with cf.ThreadPoolExecutor(2) as ex:
        long = ex.submit(_ask, s, "carol", "long [[tokens:400]]", 400, secret)
        _wait(lambda: _stats(s)["running"] == 1, "carol's first request did not start")
        second = _ask(s, "carol", "again [[tokens:2]]", 2, key=secret)
        assert second.status_code == 429 and "user_max_in_flight" in second.json()["error"], second.text
        assert "end user 'carol'" in second.json()["error"]
        assert _ask(s, "dave", "dave [[tokens:2]]", 2, key=secret).status_code == 200  # another end user: his own limit
        assert long.result().status_code == 200
    usage = httpx.get(s.url + "/api/usage?by=user", headers={"Authorization": "Bearer sk-boss"}).json()["usage"]
    assert {(r["key"], r["end_user"]) for r in usage} >= {("webui", "carol"), ("webui", "dave")}, usage
