"""--max-queue overload answers, /metrics, and every upstream fault mapped to a clear error."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from ollama import ResponseError

from conftest import SERVED, get_json, metric, start_proxy, stop, wait_aborted


def test_overload_is_503_server_busy(fake):
    p = start_proxy(fake.url, "--max-running", "1", "--max-queue", "2", "--retry-after", "7")
    try:
        async def scenario():
            async with httpx.AsyncClient(timeout=10) as c:
                held = []
                for _ in range(3):  # 1 running + 2 queued: all admitted
                    cm = c.stream("POST", p.url + "/api/generate", json={"model": SERVED, "prompt": "x [[fault:hang]]"})
                    r = await cm.__aenter__()
                    assert r.status_code == 200
                    held.append(cm)
                busy = await c.post(p.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "x"}]})
                v1 = await c.post(p.url + "/v1/completions", json={"model": SERVED, "prompt": "x"})
                messages = await c.post(p.url + "/v1/messages", json={"model": SERVED, "max_tokens": 1, "messages": []})
                tags = await c.get(p.url + "/api/tags")  # not inference: never bounded
                for cm in held:
                    await cm.__aexit__(None, None, None)
                return busy, v1, messages, tags

        busy, v1, messages, tags = asyncio.run(scenario())
        assert busy.status_code == 503 and v1.status_code == 503 and messages.status_code == 503 and tags.status_code == 200
        said = "server busy, please try again.  maximum pending requests exceeded"
        assert busy.json() == {"error": said}  # each route family its own shape, the same status and Retry-After
        assert v1.json() == {"error": {"message": said, "type": "api_error", "param": None, "code": 503}}
        assert messages.json() == {"type": "error", "error": {"type": "overloaded_error", "message": said}}
        assert busy.headers["Retry-After"] == v1.headers["Retry-After"] == messages.headers["Retry-After"] == "7"
        deadline = time.monotonic() + 60  # a failure's bound
        while time.monotonic() < deadline:  # the held streams were closed: room again
            r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "x", "stream": False})
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert r.status_code == 200
        text = httpx.get(p.url + "/metrics").text
        assert metric(text, "vllama_queue_rejections_total") == 3
    finally:
        stop(p.proc)


def test_metrics_present_and_moving(proxy, fake, client):
    before = httpx.get(proxy.url + "/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    b = before.text
    for name in ("vllama_requests_total", "vllama_requests_in_flight", "vllama_queue_rejections_total",
                 "vllama_time_to_first_token_seconds_bucket", "vllama_time_per_output_token_seconds_bucket", "vllama_upstream_errors_total"):
        assert f"# TYPE {name.removesuffix('_total').removesuffix('_bucket')}" in b, name
    list(client.generate(model=SERVED, prompt="x [[tokens:5]] [[fault:slow]]", stream=True))  # 0.2 s between tokens
    with pytest.raises(ResponseError):
        list(client.generate(model=SERVED, prompt="x [[fault:reset]]", stream=True))
    a = httpx.get(proxy.url + "/metrics").text
    route = "/api/generate"
    assert metric(a, "vllama_requests_total", route=route, status="200") >= metric(b, "vllama_requests_total", route=route, status="200") + 2
    assert metric(a, "vllama_time_to_first_token_seconds_count", route=route) >= metric(b, "vllama_time_to_first_token_seconds_count", route=route) + 2
    # TPOT is observed once per finished request: 5 tokens 0.2 s apart -> ~0.2 s per token after the first
    assert metric(a, "vllama_time_per_output_token_seconds_count", route=route) == metric(b, "vllama_time_per_output_token_seconds_count", route=route) + 1
    tpot = metric(a, "vllama_time_per_output_token_seconds_sum", route=route) - metric(b, "vllama_time_per_output_token_seconds_sum", route=route)
    assert 0.15 < tpot < 0.4
    assert metric(a, "vllama_upstream_errors_total", kind="UpstreamUnavailable") >= metric(b, "vllama_upstream_errors_total", kind="UpstreamUnavailable") + 1
    vllm = httpx.get(proxy.url + "/vllm/metrics").text
    assert "vllm:num_requests_running" in vllm and "vllm:generation_tokens_total" in vllm


def test_idle_read_timeout_and_faults(fake):
    p = start_proxy(fake.url, "--read-timeout", "1")
    try:
        t0 = time.monotonic()
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "x [[fault:hang]]"}, timeout=10)
        lines = r.text.strip().split("\n")
        assert r.status_code == 200 and "did not answer in time" in lines[-1] and '"error"' in lines[-1]
        assert time.monotonic() - t0 < 5  # bounded by the idle-read timeout, not hanging
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "x [[fault:hang]]", "stream": False}, timeout=10)
        assert r.status_code == 504 and "did not answer in time" in r.json()["error"]
        r = httpx.post(p.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "[[fault:http500]]"}], "stream": False})
        assert r.status_code == 500 and r.json() == {"error": "EngineCore encountered an issue"}  # vLLM's words, no traceback
        r = httpx.post(p.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "[[fault:garbage]]"}]})
        assert "not JSON" in r.text.strip().split("\n")[-1]
        r = httpx.post(p.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "[[fault:garbage]]"}], "stream": False})
        assert r.status_code == 502 and "not JSON" in r.json()["error"]
        r = httpx.post(p.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "[[fault:reset]]"}], "stream": False})
        assert r.status_code == 503 and "closed" in r.json()["error"]
        # valid JSON that is not an object (`data: null`): an error line, not a 500 or a cut stream
        r = httpx.post(p.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "[[fault:nullevent]]"}]})
        lines = [json.loads(x) for x in r.text.strip().split("\n")]
        assert r.status_code == 200 and "not a JSON object" in lines[-1]["error"] and not any(x.get("done") for x in lines)
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "[[fault:nullevent]]", "stream": False})
        assert r.status_code == 502 and "not a JSON object" in r.json()["error"]
        # [DONE] with no finish reason before it: the answer may be cut, so it is an error, not done
        r = httpx.post(p.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "[[fault:nofinish]]"}]})
        lines = [json.loads(x) for x in r.text.strip().split("\n")]
        assert r.status_code == 200 and "without a finish reason" in lines[-1]["error"] and not any(x.get("done") for x in lines)
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "[[fault:nofinish]]", "stream": False})
        assert r.status_code == 502 and "without a finish reason" in r.json()["error"]
    finally:
        stop(p.proc)


def test_non_streaming_disconnect_aborts_upstream(proxy, fake):
    before = get_json(fake.url + "/_fake/stats")

    async def leave():
        async with httpx.AsyncClient() as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(proxy.url + "/api/generate", json={"model": SERVED, "prompt": "x [[fault:hang]]", "stream": False}, timeout=0.5)

    asyncio.run(leave())
    after = wait_aborted(fake.url, before)
    assert after["aborted"] == before["aborted"] + 1
