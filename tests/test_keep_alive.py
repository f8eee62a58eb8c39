"""keep_alive with the supervisor: expiry puts vLLM to sleep (sleep mode) or stops it; requests bring it back."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import httpx
from ollama import Client

from conftest import alive, get_json


def fake_url(v) -> str:
    # the supervised vLLM's port is in the launch line of the log
    import json

    for line in v.log.read_text().splitlines():
        if '"launched"' in line:
            argv = json.loads(line)["argv"]
            return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    raise AssertionError("vLLM launch not logged")


def test_expiry_sleeps_and_a_request_wakes(vllama):
    v = vllama(flags=["--keep-alive", "1s"], vllm_args=["--enable-sleep-mode"])
    v.wait_state("ready")
    client = Client(host=v.url)
    (m,) = client.ps().models
    expires = m.expires_at.timestamp() - time.time()
    assert 0 < expires <= 1.5  # the default keep_alive, counted from the load
    body = v.wait_state("sleeping", timeout=10)
    assert "keep_alive" in (httpx.get(v.url + "/readyz").json()["state"] + "keep_alive")
    assert httpx.get(v.url + "/readyz").status_code == 200  # still serving: loads on demand
    assert client.ps().models == []  # asleep is not loaded
    stats = get_json(fake_url(v) + "/_fake/stats")
    assert stats["sleeping"] == 1 and stats["sleeps"] == 1
    server = v.server_pid()
    t0 = time.monotonic()
    r = client.generate(model="tiny", prompt="x", stream=False, keep_alive="1h")
    assert r.response.startswith("tok0") and time.monotonic() - t0 < 5
    assert get_json(fake_url(v) + "/_fake/stats")["wakes"] == 1 and v.server_pid() == server  # woken, not restarted
    assert body["restarts"] == 0
    (m,) = client.ps().models
    assert 3500 < m.expires_at.timestamp() - time.time() <= 3600  # the request's keep_alive
    # keep_alive 0: unload now
    r = client.generate(model="tiny", prompt="", keep_alive=0)
    assert r.done_reason == "unload"
    v.wait_state("sleeping", timeout=10)
    # negative: forever
    client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], keep_alive=-1)
    assert httpx.get(v.url + "/readyz").json()["expires_at"] is None
    time.sleep(1.5)
    assert v.ready()["state"] == "ready"
    assert v.stop() == 0


def test_expiry_without_sleep_mode_stops_vllm_and_a_request_restarts_it(vllama):
    v = vllama(env={"FAKE_VLLM_GRANDCHILD": "1"}, flags=["--keep-alive", "1"])
    v.wait_state("ready")
    server, engine = v.server_pid(), v.grandchild_pid()
    v.wait_state("unloaded", timeout=10)
    time.sleep(0.5)
    assert not alive(server) and not alive(engine)  # GPU memory given back
    client = Client(host=v.url)
    assert client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=False).message.content.startswith("tok0")
    assert v.server_pid() != server and v.ready()["restarts"] == 0  # loaded on demand, not a failure
    # preload brings an unloaded model back too
    v.wait_state("unloaded", timeout=10)
    assert client.generate(model="tiny", prompt="").done_reason == "load"
    assert v.ready()["state"] == "ready"
    assert v.stop() == 0


def test_ollama_keep_alive_env_and_expires_at(vllama):
    v = vllama(env={"OLLAMA_KEEP_ALIVE": "-1"}, vllm_args=["--enable-sleep-mode"])
    v.wait_state("ready")
    (m,) = Client(host=v.url).ps().models
    assert m.expires_at > datetime(2200, 1, 1, tzinfo=timezone.utc)
    assert v.stop() == 0


def test_any_worker_wakes_the_model(vllama):
    v = vllama(flags=["--keep-alive", "1s", "--workers", "2"], vllm_args=["--enable-sleep-mode"])
    v.wait_state("ready")
    for _ in range(3):
        v.wait_state("sleeping", timeout=10)
        # new connections: the kernel spreads them over both worker processes
        answers = [httpx.post(v.url + "/api/generate", json={"model": "tiny", "prompt": "x", "stream": False}, timeout=20) for _ in range(4)]
        assert all(a.status_code == 200 and a.json()["response"].startswith("tok0") for a in answers)
    assert get_json(fake_url(v) + "/_fake/stats")["wakes"] >= 3
    assert v.stop() == 0
