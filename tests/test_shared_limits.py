"""Per-key limits shared by several fronts (``--state-url redis://...``, ``api/shared_state.py``):
two ``vllama serve --upstream`` fronts and a real ``redis-server`` started here (skipped where
none is installed: ``apt-get install redis-server``; ``.ci/run`` installs it)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import httpx
import pytest

from conftest import ALIAS, free_port, start_fake, start_proxy, stop

pytest.importorskip("redis", reason="the redis package (pip install 'vllama-proxy[redis]')")
REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="no redis-server (apt-get install redis-server)")


@pytest.fixture
def redis_url(tmp_path):
    port = free_port()
    proc = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, check=False).stdout.strip() != "PONG":
        assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    stop(proc)


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
    from vllama_proxy.api.shared_state import RedisKeyState

    a, b = RedisKeyState(redis_url, holder_ttl=1), RedisKeyState(redis_url, holder_ttl=1)
    try:
        assert await a.enter("k", 2) == 0 and await b.enter("k", 2) == 1
        assert await a.enter("k", 2) is None and await b.enter("k", 2) is None
        assert await a.enter("other", 2) == 0 and await a.enter("k", None) == 2  # no limit: counted, never refused
        await a.leave("k"), await a.leave("k")
        assert await b.enter("k", 2) == 1
        # b dies without leaving (no heartbeat): its 2 requests of k come back once its hash expires
        deadline = time.monotonic() + 10
        while await a.enter("k", 2) is None:
            assert time.monotonic() < deadline, "a dead process's requests were never given back"
            await asyncio.sleep(0.1)
        assert await a.rate("r", 2, None) == (None, 1, 0, pytest.approx(30, abs=30))
        assert (await b.rate("r", 2, None))[:3] == (None, 2, 0)
        assert (await a.rate("r", 2, None))[:3] == ("rpm", 2, 0)  # rpm 2 over both
        await b.spend("t", 100)
        assert (await a.rate("t", None, 100))[:3] == ("tpm", 0, 100)  # tpm spent on b refuses on a
        assert (await a.rate("free", None, None))[0] is None
    finally:
        await a.close()
        await b.close()
