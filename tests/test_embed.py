"""/api/embed and legacy /api/embeddings -> /v1/embeddings."""

from __future__ import annotations

import math

from conftest import SERVED


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def test_embed_normalised(embed_client, embed_requests):
    r = embed_client.embed(model=SERVED, input=["hello world", "good night moon"])
    assert len(r.embeddings) == 2 and all(len(v) == 8 for v in r.embeddings)
    assert all(abs(norm(v) - 1) < 1e-9 for v in r.embeddings)
    assert r.embeddings[0] != r.embeddings[1]
    assert r.prompt_eval_count == 5 and r.total_duration > 0
    body = embed_requests("/v1/embeddings")[0]["body"]
    assert body["input"] == ["hello world", "good night moon"] and body["truncate_prompt_tokens"] == -1


def test_embed_dimensions_truncate_then_renormalise(embed_client):
    full = embed_client.embed(model=SERVED, input="hello world").embeddings[0]
    short = embed_client.embed(model=SERVED, input="hello world", dimensions=3).embeddings[0]
    assert len(short) == 3 and abs(norm(short) - 1) < 1e-9
    n = norm(full[:3])
    assert all(abs(a - b / n) < 1e-9 for a, b in zip(short, full[:3]))


def test_embed_truncate_false_and_empty(embed_client, embed_requests):
    embed_client.embed(model=SERVED, input="x", truncate=False)
    assert "truncate_prompt_tokens" not in embed_requests("/v1/embeddings")[0]["body"]
    assert embed_client.embed(model=SERVED, input=[]).embeddings == []


def test_legacy_embeddings(embed_client):
    r = embed_client.embeddings(model=SERVED, prompt="hello world")
    assert len(r.embedding) == 8 and abs(norm(r.embedding) - 1) > 1e-3  # not normalised, as Ollama


def test_generation_model_cannot_embed(client):
    from ollama import ResponseError
    import pytest

    with pytest.raises(ResponseError) as e:
        client.embed(model=SERVED, input="x")
    assert e.value.status_code == 400 and e.value.error == f'"{SERVED}" does not support embeddings'
