"""/v1/* forwarded to vLLM unchanged, driven by the real openai client."""

from __future__ import annotations

import openai
import pytest

from conftest import ALIAS, SERVED

EIGHT = "".join(f"tok{i} " for i in range(8))


@pytest.fixture
def oai(proxy):
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused")


def test_chat_stream_with_ollama_name(oai, upstream_requests):
    stream = oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == EIGHT and chunks[-1].usage.completion_tokens == 8
    assert upstream_requests("/v1/chat/completions")[0]["body"]["model"] == SERVED


def test_completions_models_embeddings(oai):
    r = oai.completions.create(model=SERVED + ":latest", prompt="hi", max_tokens=3)
    assert r.choices[0].text == "tok0 tok1 tok2 "
    assert [m.id for m in oai.models.list()] == [SERVED]


def test_errors_pass_through(oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=SERVED, prompt="[[fault:http400]]")
    assert "maximum context length" in str(e.value)


def test_mid_stream_reset_ends_with_openais_error_event(proxy):
    """vLLM gone after the stream began: its last event is OpenAI's error object (as vLLM ends its own
    streams), which the openai client raises as ``APIError`` with the message and the type."""
    import httpx

    r = httpx.post(proxy.url + "/v1/completions", json={"model": SERVED, "prompt": "[[fault:reset]]", "stream": True}, timeout=10)
    events = [line for line in r.text.split("\n\n") if line.strip()]
    assert events[-1].startswith('data: {"error"')
    stream = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0).completions.create(
        model=SERVED, prompt="[[fault:reset]]", stream=True)
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pass
    assert e.value.body == {"message": e.value.message, "type": "api_error", "param": None, "code": 503}
    assert "before the answer was complete" in e.value.message and e.value.type == "api_error"
