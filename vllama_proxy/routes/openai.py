"""``/v1/*`` passed to vLLM unchanged (streaming included), with Ollama model names mapped.

Copilot and every OpenAI client send inference here, as they would to Ollama's
own OpenAI-compatible surface. Only the ``model`` field of a JSON body is
rewritten (``qwen2.5:1.5b`` -> the served name); the answer is relayed byte for
byte. An upstream failure after the answer began ends an SSE stream with
vLLM's own error event shape, ``data: {"error": {...}}``.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from ..errors import ModelNotFound, UpstreamError
from ..state import CATALOG, UPSTREAM
from ..upstream import encode_json, iter_raw, read_response
from .common import done_with_model, read_body, use_model

_FORWARD_REQUEST = ("Content-Type", "Accept")
_FORWARD_RESPONSE = ("Content-Type", "Cache-Control")


async def _mapped_body(request: web.Request, body: bytes) -> bytes:
    if not body or request.content_type != "application/json":
        return body
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body  # vLLM answers the 400 in its own words
    name = data.get("model") if isinstance(data, dict) else None
    if not isinstance(name, str):
        return body
    try:
        served = (await request.app[CATALOG].resolve(name)).name
    except ModelNotFound:
        return body  # vLLM answers the 404 in its own words
    if served == name:
        return body
    data["model"] = served
    return encode_json(data)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Relay ``request`` to vLLM's ``/v1/<tail>`` and its answer back, chunk by chunk.

    ``.``/``..`` segments are refused: the outgoing URL would be normalised and reach
    vLLM's routes outside ``/v1`` (``/tokenize``, ``/sleep``...), around the API key.
    """
    if any(seg in (".", "..") for seg in request.match_info["tail"].split("/")):
        raise web.HTTPNotFound()
    keep = await use_model(request, None)  # a sleeping or unloaded model comes back first
    body = await _mapped_body(request, await read_body(request))
    headers = {h: request.headers[h] for h in _FORWARD_REQUEST if h in request.headers}
    path = "/v1/" + request.match_info["tail"]
    async with request.app[UPSTREAM].request(
        request.method, path, body=body or None, headers=headers, params=request.query, check=False
    ) as resp:
        out = web.StreamResponse(status=resp.status, headers={h: resp.headers[h] for h in _FORWARD_RESPONSE if h in resp.headers})
        await out.prepare(request)
        try:
            async for data in iter_raw(resp):
                await out.write(data)
        except UpstreamError as e:
            request["vllama.stream_error"] = e
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                err = {"error": {"message": e.message, "type": type(e).__name__, "code": e.status}}
                await out.write(b"data: " + orjson.dumps(err) + b"\n\n")
            else:
                raise  # the connection is dropped: a truncated non-SSE body must not look complete
        await out.write_eof()
        done_with_model(request, keep)
        return out


async def vllm_metrics(request: web.Request) -> web.Response:
    """vLLM's own Prometheus metrics (``vllm:*``), relayed from its ``/metrics``."""
    async with request.app[UPSTREAM].request("GET", "/metrics") as resp:
        body = await read_response(resp)
        return web.Response(body=body, headers={"Content-Type": resp.headers.get("Content-Type", "text/plain")})
