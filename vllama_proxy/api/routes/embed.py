"""``POST /api/embed`` and legacy ``POST /api/embeddings`` -> vLLM ``/v1/embeddings``.

Each answer's prompt tokens (vLLM's ``usage``) are the request's usage (``call.usage``): the settler charges
them to the key's ``budget_tokens``, ``tpm``, fair share and ledger row, as it charges a relayed
``/v1/embeddings``'. Each body is finished as every route's (``finisher.py``: its vLLM ``priority``, its key's
``cache_salt``). How many inputs a user key may send at once is the gate's (``request/gate.py``)."""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web

from vllama_proxy.errors import UnsupportedCapability, UpstreamRejected
from vllama_proxy.models.vllm_servers import Backend, ServedModel
from .body import read_request
from ..request.call import Call, call_of
from ..request.finisher import finish
from .model_use import choose, model_in_use
from ..app_state import SETTINGS
from ..ollama.timestamps import now_ns
from ..ollama.types import EmbedRequest, EmbeddingsRequest


def l2_normalize(vec: list[float]) -> list[float]:
    """``vec / ||vec||``; a zero vector is returned unchanged."""
    norm = math.sqrt(math.fsum(x * x for x in vec))
    return [x / norm for x in vec] if norm else vec


async def _embeddings(call: Call, backend: Backend, name: str, model: ServedModel, inputs: list[str],
                      truncate: bool) -> tuple[list[list[float]], int]:
    """``(vectors, prompt tokens)`` of ``inputs`` from vLLM's ``/v1/embeddings``, the body finished as every
    route's is (``finisher.py``: the request's vLLM ``priority``, its key's ``cache_salt``).

    Raises:
        UnsupportedCapability: a generation model (vLLM serves no ``/v1/embeddings`` for it: 404).
        UpstreamError: vLLM's other failures."""
    body: dict[str, Any] = {"input": inputs, "encoding_format": "float"}
    await finish(call, body, "/v1/embeddings", served=model.name, model=model, upstream=backend.upstream)
    if truncate:
        body["truncate_prompt_tokens"] = -1  # vLLM: -1 truncates to the model's max length
    try:
        data = await backend.upstream.post_json("/v1/embeddings", body)
    except UpstreamRejected as e:
        # vLLM serves /v1/embeddings only for pooling models: a generation model answers 404.
        if e.status == 404:
            raise UnsupportedCapability(name, "embeddings") from None
        raise
    items = sorted(data.get("data") or [], key=lambda d: d.get("index", 0))
    usage = data.get("usage") or {}
    return [d["embedding"] for d in items], int(usage.get("prompt_tokens") or 0)


async def embed(request: web.Request) -> web.Response:
    """Ollama's embed: ``{model, embeddings: [[float]], total_duration, load_duration, prompt_eval_count}``.

    Vectors are L2-normalised; ``dimensions`` keeps the first N values and
    re-normalises (Ollama ``server/routes.go`` EmbedHandler). ``truncate`` (default
    true) cuts inputs to the context length; false lets vLLM's 400 through. An empty
    input answers ``[]`` without asking vLLM. A non-admin key's list longer than
    ``--max-inputs`` is sent to vLLM in parts of that many, one after another.
    """
    t0 = now_ns()
    req = await read_request(request, EmbedRequest)
    call = call_of(request)
    inputs = [req.input] if isinstance(req.input, str) else list(req.input or [])
    inputs = [i for i in inputs if i]
    use = await choose(request, call, req.model, load=bool(inputs))
    name, model, backend = use.name, use.model, use.backend
    t_sent = now_ns()
    vectors: list[list[float]] = []
    count = 0
    if inputs:
        assert backend is not None
        # a user key's long list goes in parts of --max-inputs, one after another: Ollama takes any number, and vLLM
        # never holds more of this request's inputs at once than the bound lets one request send (api/request/gate.py)
        most = len(inputs) if call.key.admin else request.app[SETTINGS].max_inputs
        async with model_in_use(request, backend, req.keep_alive):
            for start in range(0, len(inputs), most):
                part, tokens = await _embeddings(call, backend, name, model, inputs[start:start + most],
                                                 req.truncate is not False)
                vectors += part
                count += tokens
        call.usage = (count, 0)  # charged by the settler
        if req.dimensions:
            vectors = [v[: req.dimensions] for v in vectors]
        vectors = [l2_normalize(v) for v in vectors]
    end = now_ns()
    body = {
        "model": name,
        "embeddings": vectors,
        "total_duration": max(end - t0, 1),
        "load_duration": max(t_sent - t0, 1),
        "prompt_eval_count": count,
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def embeddings(request: web.Request) -> web.Response:
    """Legacy embeddings: ``{model, prompt}`` -> ``{"embedding": [float]}`` (not normalised, as Ollama)."""
    req = await read_request(request, EmbeddingsRequest)
    call = call_of(request)
    use = await choose(request, call, req.model, load=bool(req.prompt))
    name, model, backend = use.name, use.model, use.backend
    vec: list[float] = []
    if req.prompt:
        assert backend is not None
        async with model_in_use(request, backend, req.keep_alive):
            vectors, count = await _embeddings(call, backend, name, model, [req.prompt], True)
        call.usage = (count, 0)
        vec = vectors[0] if vectors else []
    return web.Response(body=orjson.dumps({"embedding": vec}), content_type="application/json")
