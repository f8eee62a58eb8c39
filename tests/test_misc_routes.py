"""Management routes, unknown routes, body limits, disconnects, an unreachable upstream."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from ollama import ResponseError

from conftest import SERVED, free_port, get_json, start_proxy, stop, wait_aborted


def test_pull_served_model_succeeds(client, proxy):
    assert client.pull(SERVED).status == "success"
    assert [p.status for p in client.pull(SERVED + ":latest", stream=True)] == ["success"]
    with pytest.raises(ResponseError) as e:  # neither served nor a library name: what is close
        client.pull("fake-modl:8b")
    assert e.value.status_code == 404 and f"the closest known names are {SERVED}" in e.value.error and "org/name" in e.value.error


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/api/push", {"model": SERVED}),
])
def test_management_routes_say_what_is_served(proxy, method, path, body):
    r = httpx.request(method, proxy.url + path, json=body)
    assert r.status_code == 501
    assert "vllama does not" in r.json()["error"] and SERVED in r.json()["error"]
    # --upstream: the advice is to change the upstream server, not to start vllama with --model
    assert "vllama proxies the vLLM server at" in r.json()["error"] and "--model" not in r.json()["error"]
    assert "does not blobs" not in r.json()["error"]


def test_unknown_route_and_method_are_json(proxy):
    r = httpx.get(proxy.url + "/api/nothing")
    assert r.status_code == 404 and r.json() == {"error": "404 page not found"}
    r = httpx.get(proxy.url + "/api/generate")
    assert r.status_code == 405 and "error" in r.json()


def test_body_over_limit_is_413(fake):
    p = start_proxy(fake.url, "--max-body-size", "1000")
    try:
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "x" * 5000})
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]
    finally:
        stop(p.proc)


def test_client_disconnect_aborts_upstream(proxy, fake):
    before = get_json(fake.url + "/_fake/stats")

    async def leave_mid_stream():
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", proxy.url + "/api/generate", json={"model": SERVED, "prompt": "x [[fault:hang]]"}) as r:
                async for line in r.aiter_lines():
                    if line:
                        return  # got the first token; leave

    asyncio.run(leave_mid_stream())
    after = wait_aborted(fake.url, before)
    assert after["aborted"] == before["aborted"] + 1 and after["in_flight"] == 0


def test_upstream_unreachable_is_503():
    dead = f"http://127.0.0.1:{free_port()}"
    p = start_proxy(dead)
    try:
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "x"})
        assert r.status_code == 503 and "not reachable" in r.json()["error"]
        assert httpx.get(p.url + "/api/tags").status_code == 503
        assert httpx.get(p.url + "/v1/models").status_code == 503
    finally:
        stop(p.proc)
