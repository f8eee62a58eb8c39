"""``/v1/*`` passed to vLLM unchanged (streaming included), with Ollama model names mapped.

Copilot and every OpenAI client send inference here, as they would to Ollama's
own OpenAI-compatible surface. The ``model`` field of a JSON body picks the vLLM
server and is rewritten (``qwen2.5:1.5b`` -> the served name); the answer is
relayed byte for byte. ``GET /v1/models`` lists every model vllama launched. An upstream failure after the answer began ends an SSE stream with
vLLM's own error event shape, ``data: {"error": {...}}``.
"""

from __future__ import annotations

import email.policy
from collections import deque
from collections.abc import Mapping
from email.parser import BytesParser

import orjson
from aiohttp import web

from vllama_proxy.errors import ModelNotFound, UpstreamError
from vllama_proxy.models.backends import Backend, ServedModel
from vllama_proxy.upstream import encode_json, iter_raw, read_response
from .body import read_body
from .model_use import check_model, may_list, model_in_use
from ..admission import PRIORITY, with_priority
from ..keys import key_of
from ..metrics import MODEL, USAGE
from ..app_keys import CATALOG

_FORWARD_REQUEST = ("Content-Type", "Accept", "X-Session-ID", "X-User-ID")  # the last two: a router's session keys
_FORWARD_RESPONSE = ("Content-Type", "Cache-Control")


def _model_entry(model: ServedModel) -> dict:
    """One model in vLLM's ``/v1/models`` shape (``vllm/entrypoints/openai/protocol.py`` ModelCard)."""
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "vllm",
            "root": model.root, "parent": None, "max_model_len": model.max_model_len}


async def _models(request: web.Request) -> web.Response | None:
    """``GET /v1/models[/{id}]`` answered from the catalog when vllama launched the models (all
    of them listed, none woken up to be asked); ``None`` for an ``--upstream`` server."""
    catalog = request.app[CATALOG]
    tail = request.match_info["tail"]
    if request.method != "GET" or not tail.startswith("models") or any(b.board is None for b in catalog.backends):
        return None
    models = await catalog.models()
    if tail in ("models", "models/"):
        shown = [m for m in models if may_list(request, m, catalog.names_for(m))]
        return web.json_response({"object": "list", "data": [_model_entry(m) for m in shown]}, dumps=_dumps)
    wanted = tail.removeprefix("models/")
    try:
        model = await catalog.resolve(wanted)  # a lookup: loads nothing (issue 27)
        check_model(key_of(request), wanted, model, catalog.created(wanted))
        return web.json_response(_model_entry(model), dumps=_dumps)
    except ModelNotFound:
        err = {"error": {"message": f"The model `{wanted}` does not exist.", "type": "NotFoundError", "code": 404}}
        return web.json_response(err, status=404, dumps=_dumps)


class _NoBackend(Exception):
    """Several models and the request names none of them: answered here, no vLLM woken for it."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.response = web.json_response({"error": {"message": message, "type": err_type, "param": "model", "code": status}},
                                          status=status, dumps=_dumps)


async def _route(request: web.Request, body: bytes) -> tuple[bytes, Backend]:
    """The body to send (``model`` mapped to the served name) and the backend it goes to.

    With one backend, a request without a known model goes there and vLLM answers in its
    own words. With several, that is answered here (:class:`_NoBackend`): 400 without a
    model, 404 for an unknown one, in vLLM's error shape.
    """
    catalog = request.app[CATALOG]
    default = catalog.backends[0]
    one = len(catalog.backends) == 1
    name = None
    data = None
    if request.content_type == "application/json" and body:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            if one:
                return body, default  # vLLM answers the 400 in its own words
            raise _NoBackend(400, f"invalid JSON: {e}", "BadRequestError") from None
        name = data.get("model") if isinstance(data, dict) else None
    elif request.content_type == "multipart/form-data" and body and not one:
        name = _form_model(request.headers.get("Content-Type", ""), body)  # audio transcriptions
        if name is not None:
            try:
                model = await catalog.resolve(name, claim=True)
                check_model(key_of(request), name, model, catalog.created(name))
                return body, catalog.backend_of(model)
            except ModelNotFound:
                raise _NoBackend(404, f"The model `{name}` does not exist.", "NotFoundError") from None
    if not isinstance(name, str):
        if one:
            if default.model is not None:  # a key limited to some models may not reach this one unnamed
                check_model(key_of(request), default.model.name, default.model)
            return body, default
        raise _NoBackend(400, "you must provide a model parameter", "BadRequestError")
    try:
        model = await catalog.resolve(name, claim=request.method == "POST")  # inference claims an on-demand slot
    except ModelNotFound:
        if one:
            return body, default  # vLLM answers the 404 in its own words
        raise _NoBackend(404, f"The model `{name}` does not exist.", "NotFoundError") from None
    check_model(key_of(request), name, model, catalog.created(name))
    request[MODEL] = model.name
    backend = catalog.backend_of(model)
    prioritised = request.get(PRIORITY) is not None and request.method == "POST"
    if model.name == name and not prioritised:
        return body, backend
    data["model"] = model.name
    return encode_json(with_priority(request, data) if prioritised else data), backend


def _form_model(content_type: str, body: bytes) -> str | None:
    """The ``model`` field of a ``multipart/form-data`` body (stdlib ``email`` parser), if any."""
    message = BytesParser(policy=email.policy.HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        return None
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == "model":
            value = part.get_payload(decode=True)
            return value.decode("utf-8", "replace").strip() if isinstance(value, bytes) else None
    return None


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Relay ``request`` to the vLLM serving its ``model`` (``/v1/<tail>``) and the answer back, chunk by chunk.

    ``.``/``..`` segments are refused: the outgoing URL would be normalised and reach
    vLLM's routes outside ``/v1`` (``/tokenize``, ``/sleep``...), around the API key.
    """
    if any(seg in (".", "..") for seg in request.match_info["tail"].split("/")):
        raise web.HTTPNotFound()
    listed = await _models(request)
    if listed is not None:
        return listed
    try:
        body, backend = await _route(request, await read_body(request))
    except _NoBackend as e:
        return e.response
    return await relay(request, backend, "/v1/" + request.match_info["tail"], body)


async def relay(request: web.Request, backend: Backend, path: str, body: bytes, keep_alive: object = None,
                session_headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    """Send ``body`` to ``backend``'s vLLM at ``path`` and relay its answer back chunk by chunk, as it comes.

    The model is held for the request (``model_in_use``: woken or started first, counted in
    flight); the usage of a 200 answer is read from its last bytes for the per-key counters
    (``_usage``). ``session_headers`` (a conversation's key for a router) are added to the
    client's own. An upstream failure after the answer began ends an SSE stream with vLLM's
    error event, ``data: {"error": {...}}``; a JSON body is cut off instead.

    Raises:
        UpstreamError: vLLM failed before its answer began (mapped in ``api/app.py``).
    """
    headers = {h: request.headers[h] for h in _FORWARD_REQUEST if h in request.headers}
    headers.update(session_headers or {})  # a router's conversation key (api/session.py)
    async with model_in_use(request, backend, keep_alive):  # a sleeping or unloaded model comes back first
        async with backend.upstream.request(
            request.method, path, body=body or None, headers=headers, params=request.query, check=False
        ) as resp:
            out = web.StreamResponse(status=resp.status, headers={h: resp.headers[h] for h in _FORWARD_RESPONSE if h in resp.headers})
            await out.prepare(request)
            kept: deque[bytes] = deque(maxlen=None if resp.headers.get("Content-Type", "").startswith("application/json") else 4)
            try:
                async for data in iter_raw(resp):
                    await out.write(data)
                    kept.append(data)  # the last chunks (all of a JSON body): its usage, for the per-key counters
            except UpstreamError as e:
                request["vllama.stream_error"] = e
                if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                    err = {"error": {"message": e.message, "type": type(e).__name__, "code": e.status}}
                    await out.write(b"data: " + orjson.dumps(err) + b"\n\n")
                else:
                    raise  # the connection is dropped: a truncated non-SSE body must not look complete
            await out.write_eof()
            if resp.status == 200 and request.method == "POST":
                usage = _usage(b"".join(kept))
                if usage is not None:
                    request[USAGE] = usage
            return out


def _usage(tail: bytes) -> tuple[int, int] | None:
    """``(prompt tokens, output tokens)`` of vLLM's answer from its last bytes: the ``usage`` of a
    JSON body, or of the last SSE event that has one (streams with ``stream_options.include_usage``);
    ``None`` when there is none. Read once per request, after the answer was relayed.

    Three shapes: OpenAI's ``prompt_tokens``/``completion_tokens``; Anthropic's and the Responses
    API's ``input_tokens``/``output_tokens`` (a Responses stream's ``response.completed`` event
    carries it as ``response.usage``; Anthropic's counts cached input apart, added back here).
    """
    at = tail.rfind(b'"usage"')
    start = tail.find(b"{", at)
    if at < 0 or start < 0 or tail[at + 7:start].strip() != b":":  # "usage": null
        return None
    depth = 0
    for end in range(start, len(tail)):  # the usage object: numbers and objects of numbers, no strings with braces
        depth += {123: 1, 125: -1}.get(tail[end], 0)
        if depth == 0:
            break
    try:
        usage = orjson.loads(tail[start:end + 1])
        if "input_tokens" in usage or "output_tokens" in usage:
            prompt = sum(int(usage.get(k) or 0) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
            return prompt, int(usage.get("output_tokens") or 0)
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None


async def vllm_metrics(request: web.Request) -> web.Response:
    """vLLM's own Prometheus metrics (``vllm:*``), relayed from its ``/metrics``.

    With several models, ``?model=NAME`` picks whose (default: the first configured);
    each vLLM labels its series with ``model_name``.

    Raises:
        ModelNotFound: ``model`` names no served model.
    """
    catalog = request.app[CATALOG]
    backend = catalog.backends[0]
    if "model" in request.query:
        backend = catalog.backend_of(await catalog.resolve(request.query["model"]))
    async with backend.upstream.request("GET", "/metrics") as resp:
        body = await read_response(resp)
        return web.Response(body=body, headers={"Content-Type": resp.headers.get("Content-Type", "text/plain")})


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()
