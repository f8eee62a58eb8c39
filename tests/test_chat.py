"""/api/chat through the real ollama client: content, tools, thinking, images, translation."""

from __future__ import annotations

import base64

import httpx
import orjson
import pytest
from ollama import ResponseError

from conftest import EIGHT, SERVED, ndjson_lines

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_stream_and_non_stream(client, upstream_requests):
    chunks = list(client.chat(model=SERVED, messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(c.message.content for c in chunks) == EIGHT
    assert all(c.message.role == "assistant" for c in chunks)
    assert [c.done for c in chunks].count(True) == 1 and chunks[-1].done_reason == "stop"
    assert chunks[-1].eval_count == 8 and chunks[-1].prompt_eval_count == 1
    r = client.chat(model=SERVED, messages=[{"role": "user", "content": "hi [[tokens:3]]"}], stream=False)
    assert r.message.content == "tok0 tok1 tok2 " and r.done
    body = upstream_requests("/v1/chat/completions")[0]["body"]
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "max_tokens" not in body


def test_tool_calls_arrive_whole_one_per_chunk(proxy):
    r = httpx.post(proxy.url + "/api/chat", json={"model": SERVED, "tools": TOOLS, "messages": [{"role": "user", "content": "weather? [[tools:2]]"}]}, timeout=10)
    lines = ndjson_lines(r)
    calls = [line["message"]["tool_calls"] for line in lines if line["message"].get("tool_calls")]
    assert len(calls) == 2 and all(len(c) == 1 for c in calls)
    for i, (call,) in enumerate(calls):
        assert call["function"]["name"] == "get_weather"
        assert call["function"]["arguments"] == {"city": "Paris", "n": i}  # an object, not a JSON string
    for line in lines:
        if line["message"].get("tool_calls"):
            assert line["message"]["content"] == ""
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_tool_calls_via_ollama_client(client):
    r = client.chat(model=SERVED, tools=TOOLS, messages=[{"role": "user", "content": "[[tool]]"}], stream=False)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris", "n": 0}
    chunks = list(client.chat(model=SERVED, tools=TOOLS, messages=[{"role": "user", "content": "[[tool]]"}], stream=True))
    streamed = [tc for c in chunks for tc in (c.message.tool_calls or [])]
    assert [tc.function.arguments for tc in streamed] == [{"city": "Paris", "n": 0}]


def test_tool_round_trip_translation(client, upstream_requests):
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "noon", "tool_call_id": "call_1"},
    ]
    client.chat(model=SERVED, tools=TOOLS, messages=messages, stream=False)
    sent = upstream_requests("/v1/chat/completions")[0]["body"]["messages"]
    assert sent[1]["tool_calls"] == [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]
    assert sent[1]["content"] is None
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_0", "name": "get_weather"}
    # the name is recovered from the call the tool message answers
    assert sent[4] == {"role": "tool", "content": "noon", "tool_call_id": "call_1", "name": "get_time"}
    assert upstream_requests("/v1/chat/completions")[0]["body"]["tools"] == TOOLS


def test_thinking(client, upstream_requests):
    chunks = list(client.chat(model=SERVED, messages=[{"role": "user", "content": "hi"}], think=True, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == "think0 think1 think2 "
    r = client.chat(model=SERVED, messages=[{"role": "user", "content": "hi"}], think=True, stream=False)
    assert r.message.thinking == "think0 think1 think2 " and r.message.content == EIGHT
    client.chat(model=SERVED, messages=[{"role": "user", "content": "hi"}], think="high", stream=False)
    body = upstream_requests("/v1/chat/completions")[-1]["body"]
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["reasoning_effort"] == "high"


def test_think_max_reaches_vllm_as_its_reasoning_effort(proxy, upstream_requests):
    # Ollama 0.22's "max" level (api/types.go ThinkValue); vLLM 0.32 takes it as reasoning_effort
    r = httpx.post(proxy.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                                                   "think": "max", "stream": False}, timeout=30)
    assert r.status_code == 200, r.text
    body = upstream_requests("/v1/chat/completions")[-1]["body"]
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["reasoning_effort"] == "max"


def test_format_schema_and_images(client, upstream_requests):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    r = client.chat(model=SERVED, messages=[{"role": "user", "content": "x", "images": ["/9j/4AAQ"]}], format=schema, stream=False)
    assert orjson.loads(r.message.content) == {"ok": True}
    body = upstream_requests("/v1/chat/completions")[0]["body"]
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}
    assert body["messages"][0]["content"][0] == {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}}


def test_no_messages_loads(client):
    r = client.chat(model=SERVED, messages=[])
    assert r.done and r.done_reason == "load" and r.message.role == "assistant"


def test_bad_messages_are_400(proxy):
    for body in (
        {"model": SERVED, "messages": [{"role": "wizard", "content": "x"}]},
        {"model": SERVED, "messages": "hello"},
        {"model": SERVED, "messages": [{"role": "user", "content": None, "images": "x"}]},
        {"model": SERVED, "messages": [{"role": "user", "content": "x"}], "options": {"num_predict": "many"}},
        {"model": SERVED, "messages": [{"role": "user", "content": "x"}], "think": "maybe"},
    ):
        r = httpx.post(proxy.url + "/api/chat", json=body, timeout=10)
        assert r.status_code == 400 and "error" in r.json(), body


def test_capabilities_enforced(fake):
    from conftest import start_proxy, stop

    p = start_proxy(fake.url, vllm_args=[])  # no tool parser, no reasoning parser
    try:
        for extra, cap in (({"tools": TOOLS}, "tools"), ({"think": True}, "thinking")):
            r = httpx.post(p.url + "/api/chat", json={"model": SERVED, "messages": [{"role": "user", "content": "x"}], **extra}, timeout=10)
            assert r.status_code == 400 and r.json()["error"] == f'"{SERVED}" does not support {cap}'
    finally:
        stop(p.proc)


def test_upstream_500_and_mid_stream_error(client):
    with pytest.raises(ResponseError) as e:
        client.chat(model=SERVED, messages=[{"role": "user", "content": "[[fault:http500]]"}], stream=False)
    assert e.value.status_code == 500 and "EngineCore" in e.value.error
    with pytest.raises(ResponseError):
        list(client.chat(model=SERVED, messages=[{"role": "user", "content": "[[fault:reset]]"}], stream=True))


@pytest.mark.parametrize("stream", [True, False])
def test_error_streamed_before_any_token_is_a_status(client, proxy, stream):
    """vLLM 0.26 answers a streamed request with a bad JSON schema 200 and one error event
    (recorded in tests/fixtures/vllm-0.26/error_bad_schema_stream.json): nothing was sent to
    the client yet, so it gets the status and the error, as from Ollama, not a 200 stream."""
    schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    with pytest.raises(ResponseError) as e:
        r = client.chat(model=SERVED, messages=[{"role": "user", "content": "hi"}], format=schema, stream=stream)
        if stream:
            list(r)
    assert e.value.status_code == 400 and "Grammar error: Invalid type: no-such-type" in e.value.error
    raw = httpx.post(proxy.url + "/api/chat", json={"model": SERVED, "format": schema, "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert raw.status_code == 400 and raw.headers["content-type"].startswith("application/json")
    assert "Grammar error" in raw.json()["error"]


@pytest.mark.parametrize("image", ["http://169.254.169.254/latest/meta-data/", "file:///etc/passwd", "!!!notbase64###", "",
                                   "QUJDRA=="])
def test_images_that_are_not_base64_images_never_reach_vllm(proxy, upstream_requests, image):
    """Issue 19: a URL in ``images`` made vLLM fetch it (server-side request forgery); Ollama answers 400."""
    for path, body in (("/api/chat", {"model": SERVED, "messages": [{"role": "user", "content": "x", "images": [image]}]}),
                       ("/api/generate", {"model": SERVED, "prompt": "x", "images": [image]})):
        r = httpx.post(proxy.url + path, json=body, timeout=10)
        assert r.status_code == 400, (path, r.text)
        assert "images[0]" in r.json()["error"]
    assert upstream_requests("/v1/chat/completions") == []


def test_a_real_png_from_the_ollama_client_arrives_as_a_data_url(client, upstream_requests):
    from conftest import _png

    png = _png()
    client.chat(model=SERVED, messages=[{"role": "user", "content": "what is it", "images": [png]}], stream=False)
    part = upstream_requests("/v1/chat/completions")[0]["body"]["messages"][0]["content"][0]
    assert part == {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
