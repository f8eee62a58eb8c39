"""/api/tags, /api/show, /api/ps built from vLLM's /v1/models and the model's files."""

from __future__ import annotations

import re

import httpx

from conftest import ALIAS, CHAT_TEMPLATE, SERVED


def test_tags(client, proxy):
    r = httpx.get(proxy.url + "/api/tags").json()
    names = [m["name"] for m in r["models"]]
    assert names == [SERVED + ":latest", ALIAS]
    m = r["models"][0]
    assert m["model"] == m["name"]
    assert re.fullmatch(r"[0-9a-f]{64}", m["digest"])
    assert m["size"] > 128000
    # Ollama 0.33: each entry says what the model can do and its context (Ollama's launch picks models by them)
    assert m["details"] == {"parent_model": "", "format": "safetensors", "family": "qwen2", "families": ["qwen2"],
                            "parameter_size": "64.06K", "quantization_level": "BF16", "context_length": 4096,
                            "embedding_length": 64}
    assert m["capabilities"] == ["completion", "tools", "thinking", "vision"]
    assert r["models"][1]["capabilities"] == m["capabilities"]  # the alias too
    listed = client.list()
    assert [x.model for x in listed.models] == names
    assert httpx.head(proxy.url + "/api/tags").status_code == 200


def test_show(client, proxy):
    for name in (SERVED, SERVED + ":latest", ALIAS):
        s = client.show(name)
        assert s.capabilities == ["completion", "tools", "thinking", "vision"]
        info = s.modelinfo
        arch = info["general.architecture"]
        assert arch == "qwen2" and info[f"{arch}.context_length"] == 4096
        assert info[f"{arch}.embedding_length"] == 64 and info["general.parameter_count"] == 64064
        assert s.template == CHAT_TEMPLATE
        assert "num_ctx 4096" in s.parameters.splitlines() and 'stop "<|im_end|>"' in s.parameters
        assert "temperature 0.7" in s.parameters
        assert s.details.family == "qwen2"
    details = httpx.post(proxy.url + "/api/show", json={"model": SERVED}).json()["details"]
    assert (details["context_length"], details["embedding_length"]) == (4096, 64)
    legacy = httpx.post(proxy.url + "/api/show", json={"name": SERVED}).json()
    assert legacy["model_info"]["general.architecture"] == "qwen2"
    assert httpx.post(proxy.url + "/api/show", json={"model": "nope"}).status_code == 404


def test_ps(client, proxy):
    (m,) = client.ps().models
    assert m.name == m.model == SERVED + ":latest"
    assert m.context_length == 4096 and m.size == m.size_vram > 0
    assert m.expires_at.year > 2100
    (raw,) = httpx.get(proxy.url + "/api/ps").json()["models"]
    assert (raw["details"]["context_length"], raw["details"]["embedding_length"]) == (4096, 64)


def test_version_and_root(proxy):
    v = httpx.get(proxy.url + "/api/version").json()["version"]
    assert tuple(map(int, v.split("."))) >= (0, 33, 0)  # the Ollama API level vllama speaks: 0.33's fields
    for method in ("GET", "HEAD"):
        r = httpx.request(method, proxy.url + "/")
        assert r.status_code == 200
    assert httpx.get(proxy.url + "/").text == "Ollama is running"
    assert httpx.head(proxy.url + "/api/version").status_code == 200


def test_embedding_model_capability(fake):
    from conftest import start_proxy, stop

    p = start_proxy(fake.url, vllm_args=["--runner", "pooling"])
    try:
        caps = httpx.post(p.url + "/api/show", json={"model": SERVED}).json()["capabilities"]
        assert caps == ["embedding"]
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "x"})
        assert r.status_code == 400 and "does not support generate" in r.json()["error"]
    finally:
        stop(p.proc)
