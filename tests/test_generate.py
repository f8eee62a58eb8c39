"""/api/generate through the real ollama client against the fake vLLM process."""

from __future__ import annotations

import base64

import httpx
import pytest
from ollama import ResponseError

from conftest import ALIAS, EIGHT, SERVED, ndjson_lines

def test_stream_raw_goes_to_completions_untouched(client, upstream_requests):
    chunks = list(client.generate(model=SERVED, prompt="hello there", raw=True, stream=True))
    assert "".join(c.response for c in chunks) == EIGHT
    assert [c.done for c in chunks].count(True) == 1 and chunks[-1].done
    last = chunks[-1]
    assert last.done_reason == "stop"
    assert last.eval_count == 8 and last.prompt_eval_count == 2
    for d in (last.total_duration, last.load_duration, last.prompt_eval_duration, last.eval_duration):
        assert isinstance(d, int) and d > 0
    (sent,) = upstream_requests("/v1/completions")
    body = sent["body"]
    assert body["prompt"] == "hello there"
    assert body["model"] == SERVED and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4096 - 2  # the rest of the context, not vLLM's 16-token default


def test_unlimited_raw_generate_is_not_cut_at_16(client):
    r = client.generate(model=SERVED, prompt="x [[tokens:100]]", raw=True, stream=False)
    assert r.eval_count == 100 and r.done_reason == "stop"


def test_templated_generate_uses_chat_with_system(client, upstream_requests):
    r = client.generate(model=SERVED, prompt="why is the sky blue", system="be brief", stream=False)
    assert r.response == EIGHT and r.done and r.done_reason == "stop"
    (sent,) = upstream_requests("/v1/chat/completions")
    assert sent["body"]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "why is the sky blue"},
    ]


def test_raw_ndjson_framing(proxy):
    r = httpx.post(proxy.url + "/api/generate", json={"model": SERVED, "prompt": "x [[tokens:5]]", "raw": True}, timeout=10)
    lines = ndjson_lines(r)
    assert [line["done"] for line in lines] == [False] * 5 + [True]
    assert lines[0]["model"] == SERVED and lines[0]["created_at"].endswith("Z")
    assert len(lines[0]["created_at"].split(".")[1]) == 10  # nanoseconds + Z
    assert set(lines[-1]) >= {"done_reason", "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"}


def test_non_stream_is_one_json_object(proxy):
    r = httpx.post(proxy.url + "/api/generate", json={"model": SERVED, "prompt": "x", "stream": False}, timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["response"] == EIGHT and body["done"] is True


def test_num_predict_and_options_mapping(client, upstream_requests):
    r = client.generate(
        model=SERVED,
        prompt="x [[tokens:100]]",
        raw=True,
        stream=False,
        options={"num_predict": 3, "temperature": 0.2, "top_k": 5, "top_p": 0.5, "min_p": 0.1, "seed": 42,
                 "repeat_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.6, "stop": ["tok9"],
                 "num_ctx": 8192, "mirostat": 0, "num_gpu": 1},
    )
    assert r.response == "tok0 tok1 tok2 " and r.done_reason == "length" and r.eval_count == 3
    body = upstream_requests("/v1/completions")[0]["body"]
    assert body["max_tokens"] == 3
    assert body["temperature"] == 0.2 and body["top_k"] == 5 and body["top_p"] == 0.5 and body["min_p"] == 0.1
    assert body["seed"] == 42 and body["repetition_penalty"] == 1.3
    assert body["presence_penalty"] == 0.4 and body["frequency_penalty"] == 0.6 and body["stop"] == ["tok9"]
    for ollama_only in ("num_ctx", "mirostat", "num_gpu", "repeat_penalty", "num_predict"):
        assert ollama_only not in body


def test_unset_and_off_values_are_not_sent(client, upstream_requests):
    client.generate(model=SERVED, prompt="x", raw=True, options={"num_predict": -1, "seed": -1, "top_k": 0})
    body = upstream_requests("/v1/completions")[0]["body"]
    assert body["max_tokens"] == 4095 and "seed" not in body and "top_k" not in body and "temperature" not in body


def test_wrong_option_type_is_400(client):
    with pytest.raises(ResponseError) as e:
        client.generate(model=SERVED, prompt="x", options={"temperature": "hot"})
    assert e.value.status_code == 400 and "options.temperature" in e.value.error


def test_format_and_think(client, upstream_requests):
    r = client.generate(model=SERVED, prompt="x", format="json", stream=False)
    assert r.response == '{"ok": true}'
    assert upstream_requests("/v1/chat/completions")[0]["body"]["response_format"] == {"type": "json_object"}
    chunks = list(client.generate(model=SERVED, prompt="x", think=True, stream=True))
    assert "".join(c.thinking or "" for c in chunks) == "think0 think1 think2 "
    assert "".join(c.response for c in chunks) == EIGHT
    assert upstream_requests("/v1/chat/completions")[-1]["body"]["chat_template_kwargs"] == {"enable_thinking": True}


def test_images_become_data_urls(client, upstream_requests):
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n fake").decode()
    client.generate(model=SERVED, prompt="what is this", images=[png], stream=False)
    content = upstream_requests("/v1/chat/completions")[0]["body"]["messages"][-1]["content"]
    assert {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}} in content
    assert {"type": "text", "text": "what is this"} in content


def test_preload_and_unload(client, upstream_requests):
    r = client.generate(model=SERVED, prompt="")
    assert r.done and r.done_reason == "load"
    with pytest.raises(ResponseError) as e:  # --upstream: vllama does not run that vLLM, so it cannot unload
        client.generate(model=SERVED, prompt="", keep_alive=0)
    assert e.value.status_code == 400 and "cannot unload" in e.value.error
    assert upstream_requests("/v1/completions") == [] and upstream_requests("/v1/chat/completions") == []


@pytest.mark.parametrize("name", [SERVED, SERVED + ":latest", ALIAS, "FAKE-MODEL"])
def test_model_names(client, name):
    r = client.generate(model=name, prompt="x", stream=False)
    assert r.model == name and r.response == EIGHT


def test_client_mistakes(client, proxy):
    with pytest.raises(ResponseError) as e:
        client.generate(model="nope", prompt="x")
    # not served, not in the library: Ollama's words, then how to name a Hugging Face model (issue 22)
    assert e.value.status_code == 404 and e.value.error.startswith("model 'nope' not found: it is not a name in vllama's library")
    assert "org/name" in e.value.error
    with pytest.raises(ResponseError) as e:
        client.generate(model=SERVED, prompt="x", suffix="y")
    assert e.value.status_code == 400 and e.value.error == f'"{SERVED}" does not support insert'
    with pytest.raises(ResponseError) as e:
        client.generate(model=SERVED, prompt="x", raw=True, system="s")
    assert e.value.status_code == 400
    cases = [
        (b"", "missing request body"),
        (b"{not json", "invalid JSON"),
        (b"[1,2]", "must be a JSON object"),
        (b'{"prompt": "x"}', "model is required"),
        (b'{"model": "", "prompt": "x"}', "model is required"),
        (b'{"model": "fake-model", "prompt": 5}', "invalid prompt"),
        (b'{"model": "fake-model", "prompt": "x", "keep_alive": "soon"}', "keep_alive"),
        (b'{"model": "fake-model", "prompt": "x", "template": "{{ .Prompt }}"}', "custom templates"),
    ]
    for raw, message in cases:
        r = httpx.post(proxy.url + "/api/generate", content=raw, timeout=10)
        assert r.status_code == 400, raw
        assert r.headers["content-type"].startswith("application/json")
        assert message in r.json()["error"], (raw, r.json())


def test_vllm_400_passes_through(client):
    with pytest.raises(ResponseError) as e:
        client.generate(model=SERVED, prompt="x [[fault:http400]]")
    assert e.value.status_code == 400 and "maximum context length" in e.value.error


@pytest.mark.parametrize("fault", ["reset", "garbage"])
def test_error_after_stream_began_is_last_line(proxy, client, fault):
    r = httpx.post(proxy.url + "/api/generate", json={"model": SERVED, "prompt": f"x [[fault:{fault}]]"}, timeout=10)
    assert r.status_code == 200
    lines = ndjson_lines(r)
    assert "error" in lines[-1] and not any(line.get("done") for line in lines)
    assert "".join(line.get("response", "") for line in lines[:-1]) == "tok0 tok1 "
    with pytest.raises(ResponseError):
        list(client.generate(model=SERVED, prompt=f"x [[fault:{fault}]]", stream=True))
