"""An idle engine is never called hung: vLLM's gauges alone neither restart it nor keep it awake.

On an H200, after a load sweep and a 5,000-prompt batch, vLLM's ``/metrics`` kept reporting 6 requests pending
and no new token while it served fine; vllama logged ``engine hung`` after ``--hang-timeout`` and restarted it
(83 s of 503s), and the ``vllama stop`` sent after the batch never put it to sleep (``benchmarks/RESULTS.md``).
The stand-in reports such a stale gauge with ``FAKE_VLLM_STALE_PENDING``: the hang check asks vLLM a request of
vllama's own before it restarts anything (``supervisor/lifecycle.py``, ``_watch``), and a model vllama's own
requests no longer use sleeps. A truly hung stand-in (``FAKE_VLLM_HANG_AFTER``) is still restarted.
"""

from __future__ import annotations

import time

import pytest
from ollama import Client, ResponseError

from conftest import log_events
from test_stop_sleeps import ONE_GPU, fake_url, vllama_cli
from conftest import get_json

STALE = {"FAKE_VLLM_STALE_PENDING": "6"}


def stale_events_or_restart(v, count: int, timeout: float) -> list[dict]:
    """The ``engine_gauge_stale`` lines once ``count`` were logged; fails at once if vLLM restarted meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        body = v.ready()
        assert body["restarts"] == 0, f"restarted on a stale gauge: {body['last_error']}"
        seen = [e for e in log_events(v.log) if e.get("event") == "engine_gauge_stale"]
        if len(seen) >= count:
            return seen
        assert time.monotonic() < deadline, f"{len(seen)} engine_gauge_stale lines after {timeout:.0f} s: {body}"
        time.sleep(0.05)


def test_a_stale_gauge_does_not_restart_a_working_engine(vllama):
    v = vllama(env=STALE, flags=["--hang-timeout", "1"])
    v.wait_state("ready")
    client = Client(host=v.url)
    assert client.generate(model="tiny", prompt="x", stream=False).done
    seen = stale_events_or_restart(v, 2, timeout=60)  # the check ran twice: each past the 1 s that restarted vLLM
    assert seen[0]["pending"] == 6 and "HTTP 200" in seen[0]["answer"] and seen[0]["level"] == "warning"
    assert client.generate(model="tiny", prompt="x", stream=False).done
    assert v.ready()["restarts"] == 0
    assert v.stop() == 0


def test_stop_sleeps_an_engine_whose_gauge_says_requests_are_pending(vllama):
    v = vllama(env={**ONE_GPU, **STALE}, flags=["--keep-alive", "-1", "--hang-timeout", "0"])
    v.wait_state("ready")
    client = Client(host=v.url)
    assert client.generate(model="tiny", prompt="x", stream=False).done  # vllama's own requests: all done
    r = vllama_cli(v, "stop", "tiny")
    assert r.returncode == 0, r.stderr
    v.wait_state("sleeping", timeout=20)
    assert get_json(fake_url(v) + "/_fake/stats")["sleeping"] == 1
    ignored = [e for e in log_events(v.log) if e.get("event") == "engine_gauge_ignored"]
    assert ignored and ignored[0]["pending"] == 6
    assert v.stop() == 0


def test_a_hung_engine_is_still_restarted_once_its_own_request_gets_no_answer(vllama):
    v = vllama(env={**STALE, "FAKE_VLLM_HANG_AFTER": "2"}, flags=["--hang-timeout", "1", "--no-resume"])  # the stream ends with the engine
    v.wait_state("ready")
    client = Client(host=v.url)
    assert client.generate(model="tiny", prompt="x", stream=False).done  # request 1; from 2 on nothing is generated
    with pytest.raises(ResponseError):
        list(client.generate(model="tiny", prompt="x", stream=True))  # hangs -> restart -> error line
    body = v.wait_state("ready", restarts=1, timeout=60)
    assert "engine hung" in body["last_error"] and "vllama's own request got no answer" in body["last_error"]
    assert v.stop() == 0
