"""A keys file of any size loads, at start and on SIGHUP: with more keys than the per-key counters
(``api_keys.KEY_COUNTERS``, 1,024), the keys beyond share a counter with another key (their limits count together)
and the log says so once. Before, a 1,500-key file never listened at start, and a SIGHUP to it sent every worker
into an endless probe for a free counter (100 % CPU, ``/livez`` timed out)."""

from __future__ import annotations

import json
import signal
import time

import httpx

from conftest import SERVED, start_proxy, stop, wait_catching


def _keys(n: int) -> str:
    return "".join(f'[[keys]]\nname = "k{i}"\nkey = "sk-{i}"\nrpm = 100000\n\n' for i in range(n))


def _chat(url: str, key: str) -> httpx.Response:
    return httpx.post(url + "/api/chat", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "stream": False})


def test_a_keys_file_larger_than_the_counters_loads_at_start_and_on_sighup(fake, tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(_keys(1500))
    log = tmp_path / "vllama.log"
    p = start_proxy(fake.url, "--api-key-file", str(path), "--workers", "1", log=log)
    try:
        assert _chat(p.url, "sk-1499").status_code == 200 and _chat(p.url, "sk-0").status_code == 200
        assert '"keys_share_counters"' in log.read_text()
        path.write_text(_keys(1600))
        wait_catching(signal.SIGHUP, p.proc.pid, timeout=120)  # (until its handler is set, SIGHUP would end vllama)
        p.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while not any(json.loads(x).get("event") == "keys_loaded" for x in log.read_text().splitlines() if x.startswith("{")):
            assert time.monotonic() < deadline and p.proc.poll() is None, "the reload never ended"
            time.sleep(0.1)
        assert httpx.get(p.url + "/livez", timeout=5).status_code == 200
        assert _chat(p.url, "sk-1599").status_code == 200
    finally:
        stop(p.proc)
