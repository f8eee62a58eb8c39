"""``/v1/*`` relayed to vLLM: the OpenAI-compatible routes as Copilot and every OpenAI client send them to
Ollama's own OpenAI layer, and (through ``agents.py``) the agents' routes.

What vLLM receives is built from the gate's checked fields (``request/gate.py``), the model as vLLM
serves it, completed by the finisher (``finisher.py``). The answer is relayed as vLLM writes it, but
for a usage chunk the stream did not ask for (``_Events``) and a created model's name where vLLM wrote
its base's; the settler charges its usage, or what was relayed to a client that left. ``GET
/v1/models`` lists every model vllama launched. Refusals are ``errors.py``'s, in OpenAI's shape; an
upstream failure after an SSE stream began ends it with that object (``errors.error_event``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from vllama_proxy.errors import (BadRequest, ModelNotFound, NoSuchModel, UnsupportedCapability, UpstreamError,
                                 UpstreamRejected, UpstreamTimeout, error_event, shape_of)
from vllama_proxy.models.created import CreatedModel
from vllama_proxy.models.names import ollama_name
from vllama_proxy.models.vllm_servers import Backend, ServedModel
from vllama_proxy.errors import VllamaError
from vllama_proxy import error_message
from vllama_proxy.logs import get_logger
from vllama_proxy.upstream import SSEDecoder, encode_json, never_sent, read_raw, read_response, read_some
from ..request.relay import in_own_task
from ..request.resume import Resume, refusal, resumable, resume_timeout
from ..request.body_reader import read_body
from .model_use import check_model, choose, may_list, may_list_created, model_in_use, refuse_outside
from ..policy.keys import key_of
from ..request.call import Call, call_of
from ..policy.fair_queue import prompt_tokens_guess
from ..request.finisher import finish
from ..request.bodies import Body
from ..request.gate import upstream_fields
from ..app_state import CATALOG, CLIENT_AFFINITY, ROUTER_RELEASE, SETTINGS, WORKER
from ..fleet import affinity
from ..fleet.client_affinity import ROUTER_HEADERS

_FORWARD_PLAIN = ("Content-Type", "Accept")
#: ... and a router's session keys as the client sent them (vllm-router's hash_key.rs), where they are not
#: replaced by the client's key scoped to its caller (a node, ``--session-header ''``: ``api/fleet/client_affinity.py``)
_FORWARD_REQUEST = (*_FORWARD_PLAIN, *ROUTER_HEADERS)
_FORWARD_RESPONSE = ("Content-Type", "Cache-Control")

log = get_logger("vllama.resume")


def _model_entry(model: ServedModel, name: str | None = None, parent: str | None = None) -> dict:
    """One model in vLLM's ``/v1/models`` shape (``vllm/entrypoints/openai/protocol.py`` ModelCard): ``model``
    under its served name, or under ``name`` (an alias, a created model: ``parent`` its base)."""
    return {"id": name or model.name, "object": "model", "created": model.created, "owned_by": "vllm",
            "root": model.root, "parent": parent, "max_model_len": model.max_model_len}


async def _models(request: web.Request) -> web.Response | None:
    """``GET /v1/models[/{id}]`` answered from the catalog when vllama launched the models (all
    of them listed, none woken up to be asked); ``None`` for an ``--upstream`` server. As Ollama's ``/v1/models``,
    every name that answers is listed: a model's served name, its aliases (``vllama cp``, ``--alias``) and the
    models made from it (``vllama create``, ``parent`` the base).

    Raises:
        NoSuchModel: ``{id}`` names no model (404), where the key's patterns allow the name.
        Forbidden: the key may not see ``{id}`` (403), known or not."""
    catalog = request.app[CATALOG]
    tail = request.match_info["tail"]
    if request.method != "GET" or not tail.startswith("models") or any(b.board is None for b in catalog.backends):
        return None
    models = await catalog.models()
    if tail in ("models", "models/"):
        data, by_name = [], {m.name: m for m in models}
        for m in models:
            names = catalog.names_for(m)
            if may_list(request, m, names):
                data += [_model_entry(m), *(_model_entry(m, alias) for alias in names[1:])]
        for made in catalog.created_models():
            base = by_name.get(made.base)
            if base is not None and may_list_created(request, made):
                data.append(_model_entry(base, ollama_name(made.name), parent=base.name))
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)
    wanted = tail.removeprefix("models/")
    try:
        model = await catalog.resolve(wanted)  # a lookup: loads nothing
        made = catalog.created(wanted)
        check_model(key_of(request), wanted, model, made)
        named = None if wanted == model.name else wanted
        return web.json_response(_model_entry(model, named, parent=model.name if made else None), dumps=_dumps)
    except ModelNotFound:
        refuse_outside(key_of(request), wanted)  # no 404 to tell a key what exists outside its patterns
        raise NoSuchModel(wanted) from None


async def _route(request: web.Request, call: Call) -> tuple[Any, ServedModel | None, Backend, CreatedModel | None]:
    """``(what goes upstream, its model, the backend it goes to, the created model it names)``, from the gate's
    typed request (``call.typed``; what goes upstream is ``None`` for a form or no body, forwarded as sent).

    The model resolves as on every route (``model_use.choose``: the key is checked against it before
    anything is claimed or loaded, and only an allowed request for an on-demand model claims its slot, under
    ``--on-demand-admin-only`` an admin's). With one backend, a
    request without a model goes to the served default, and is charged to it; one naming a model vllama
    does not know (which the key's patterns allow) goes there and vLLM answers in its own words. With
    several that is answered here, no vLLM woken for it: 400 without a model, 404 for an unknown one.

    Raises:
        BadRequest: with several models, none named (``param`` ``model``).
        NoSuchModel: with several models, a name none of them has (404).
        Forbidden: the key may not use the model (403).
    """
    catalog = request.app[CATALOG]
    key = key_of(request)
    one = len(catalog.backends) == 1
    data = upstream_fields(call)
    name = call.asked
    if name is None:
        if not one:
            raise BadRequest("you must provide a model parameter", param="model")
        default = catalog.backends[0]
        model = default.model
        if model is None:  # --upstream: the first model that vLLM lists
            model = next(iter(await catalog.models()), None)
        if model is not None:  # a key limited to some models may not reach this one unnamed
            check_model(key, model.name, model)
            call.model = model.name
            if isinstance(data, dict) and request.method == "POST":
                data["model"] = model.name
        return data, model, default, None
    try:
        use = await choose(request, call, name)  # the key checked before anything is claimed
    except ModelNotFound:
        if one:
            return data, None, catalog.backends[0], None  # vLLM answers the 404 in its own words
        raise NoSuchModel(name) from None
    if isinstance(data, dict):
        data["model"] = use.model.name
    assert use.backend is not None
    return data, use.model, use.backend, use.made


async def _forwarded(request: web.Request, call: Call, body: bytes, data: Any, model: ServedModel | None, backend: Backend,
                     made: CreatedModel | None, token_ids: bool = False) -> bytes:
    """What is forwarded: for a typed body, the gate's fields finished (``finisher.finish``; ``token_ids``: vLLM asked
    for the stream's token ids, ``resume.py``); for an admin's untyped JSON, the parsed body written again with its
    model mapped; ``body`` as sent when it was no JSON (a form, or none). Runs with the model held (its
    ``/tokenize`` may be asked)."""
    if data is None:
        return body
    if isinstance(call.typed, Body):
        served = model.name if model is not None else data.get("model")
        await finish(call, data, request.path, served=served, model=model, upstream=backend.upstream, made=made,
                     relayed=True, token_ids=token_ids)
    return encode_json(data)


def _resume_of(request: web.Request, call: Call, data: Any, model: ServedModel | None,
               backend: Backend) -> Callable[[Mapping[str, str]], Resume] | None:
    """For a relayed ``/v1/chat/completions`` or ``/v1/completions`` request under ``--resume``: what builds its
    :class:`Resume` (given the headers sent upstream) once its body is finished: a stream is continued, a
    non-streamed request asked again whole (:func:`_answered_whole`). ``None`` for any other request, a model vllama
    does not know, or, on a fleet's node, a stream whose client asked its token ids or any non-streamed request (a
    front's: it goes on through the router on another node at once, not after this node's restart)."""
    settings = request.app[SETTINGS]
    if not (settings.resume and request.method == "POST" and request.path in _PLACED and isinstance(data, dict)
            and isinstance(call.typed, Body) and model is not None):
        return None
    strip = data.get("return_token_ids") is not True  # asked by vllama: not the client's to see
    if settings.register_with and (not strip or data.get("stream") is not True):
        return None  # a fleet's front continues it on another node at once (docs/fleet.md)
    seconds, _ = resume_timeout(settings.resume_timeout, backend.board)
    worker = request.app[WORKER]
    unstreamed = data.get("stream") is not True
    return lambda headers: Resume(request.path, data, backend.upstream, backend.board, worker, seconds,
                                  model.max_model_len, headers, request.path, relayed=True, strip=strip,
                                  unstreamed=unstreamed)


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
    call = call_of(request)
    body = call.body if call.body is not None else await read_body(request)
    data, model, backend, made = await _route(request, call)
    rename = _rename(made, model, call.asked)
    resume_of = _resume_of(request, call, data, model, backend)
    with request.app[CLIENT_AFFINITY].hold_request(request) as own:  # counted until the answer ends
        sent, release = _placement(request, data, own)
        try:
            return await forward(request, backend, "/v1/" + request.match_info["tail"], body, session_headers=sent,
                               ready_body=lambda: _forwarded(request, call, body, data, model, backend, made,
                                                             token_ids=resume_of is not None and data.get("stream") is True),
                               rename=rename, resume_of=resume_of)
        finally:
            if release is not None:  # after the answer's last byte, or its error, or the client's leaving
                request.app[ROUTER_RELEASE].release(backend.upstream, release)


def _rename(made: CreatedModel | None, model: ServedModel | None, asked: str | None) -> tuple[bytes, bytes] | None:
    """For a created model: ``("model":<what vLLM answers with>, "model":<the name asked>)``, as JSON bytes (Ollama
    answers with the model the client named); ``None`` otherwise."""
    if made is None or model is None or asked is None:
        return None
    served = made.served_as(model.name)
    return b'"model":' + orjson.dumps(served), b'"model":' + orjson.dumps(asked)


#: The relayed inference routes a router places by load (``--request-sessions``).
_PLACED = ("/v1/chat/completions", "/v1/completions")


def _placement(request: web.Request, data: Any, own: str | None) -> tuple[dict[str, str], str | None]:
    """The session header for a relayed request, and the key to release when it ends (``affinity.placement``).

    The client's own key ``own`` (``api/fleet/client_affinity.py``'s ``ClientAffinity.hold``: its ``X-Session-ID``, else its
    ``X-User-ID``, scoped to its caller; ``None`` beyond the bound in flight) on any route, never released.
    Else, with ``--request-sessions on``, a ``/v1/chat/completions`` or ``/v1/completions``: a chat gets the
    key ``/api/chat`` would (``affinity.openai_key``: its shared system prompt's, or under ``--session-key
    conversation`` its conversation's), any other request a key of its own. Nothing for other routes, or with
    the setting off (on a node and with ``--session-header ''`` the client's headers are forwarded as they
    came: ``forward``)."""
    settings = request.app[SETTINGS]
    if own:
        return affinity.placement(settings.session_header, own, None, False)
    if settings.request_sessions != "on" or request.method != "POST" or request.path not in _PLACED or not isinstance(data, dict):
        return {}, None
    model = data.get("model")
    key = affinity.openai_key(model, data, settings.session_key) if isinstance(model, str) else None
    return affinity.placement(settings.session_header, None, key, True)


async def forward(request: web.Request, backend: Backend, path: str, body: bytes, keep_alive: object = None,
                session_headers: Mapping[str, str] | None = None,
                ready_body: Callable[[], Awaitable[bytes]] | None = None,
                rename: tuple[bytes, bytes] | None = None,
                resume_of: Callable[[Mapping[str, str]], Resume] | None = None) -> web.StreamResponse:
    """Send ``body`` to ``backend``'s vLLM at ``path`` and relay its answer back chunk by chunk, as it comes.

    The model is held for the request (``model_in_use``: woken or started first, counted in
    flight); the usage of a 200 answer is read from its last bytes for the settler (``call.usage``).
    ``session_headers`` (a conversation's key for a router) are added to the client's own. ``ready_body``:
    what to send instead of ``body``, built once the model is held. ``rename``: ``(bytes, bytes)`` replaced in
    the answer (a created model's name where vLLM wrote its base's). A body that is not a form goes as
    ``application/json``: vllama parsed it and wrote it again. An upstream failure after the answer began ends
    an SSE stream with an error event in the route family's shape (``errors.error_event``: OpenAI's
    ``data: {"error": {...}}`` as vLLM writes its own, Anthropic's ``event: error`` on ``/v1/messages``); a JSON
    body is cut off instead. ``resume_of``: what builds the stream's :class:`Resume` from the headers sent
    upstream (:func:`_resume_of`): a stream vLLM breaks is then continued, not ended (:func:`_continued`).

    Raises:
        UpstreamError: vLLM failed before its answer began (mapped in ``api/app.py``).
    """
    forward = _FORWARD_PLAIN if request.app[CLIENT_AFFINITY].scoped else _FORWARD_REQUEST  # a client's key: scoped, not as sent
    headers = {h: request.headers[h] for h in forward if h in request.headers}
    headers.update(session_headers or {})  # a router's conversation key (api/fleet/affinity.py)
    async with model_in_use(request, backend, keep_alive):  # a sleeping or unloaded model comes back first
        if ready_body is not None:
            body = await ready_body()  # built with the model held: its /tokenize may be asked (output_tokens.py)
        if body and request.content_type != "multipart/form-data":
            headers["Content-Type"] = "application/json"  # the body vllama parsed and wrote again, whatever was sent
        try:
            if resume_of is not None:
                resume = resume_of(headers)
                try:
                    if resume.unstreamed:
                        return await _answered_whole(request, backend, path, body, headers, rename, resume)
                    return await _sent_resumable(request, backend, path, body, headers, rename, resume)
                finally:
                    if resume.times:
                        await resume.close()
            return await _sent(request, backend, path, body, headers, rename)
        except (ConnectionError, asyncio.CancelledError):  # the client left
            call = call_of(request)
            if call.usage is None and request.method == "POST" and call.model is not None:
                _charge_left(request, call)  # before any of vLLM's answer came (a whole answer comes at its end)
            raise


async def _sent(request: web.Request, backend: Backend, path: str, body: bytes, headers: dict[str, str],
                rename: tuple[bytes, bytes] | None) -> web.StreamResponse:
    """:func:`forward`'s request to vLLM and its answer copied back."""
    async with backend.upstream.request(
        request.method, path, body=body or None, headers=headers, params=request.query, check=False
    ) as resp:
        if resp.status == 404 and path in _CAPABILITY:  # vLLM's own 404, passed on as it wrote it but this one
            data = await _refuse_missing_route(request, resp, path)
            return web.Response(status=404, body=data, headers={h: resp.headers[h] for h in _FORWARD_RESPONSE if h in resp.headers})
        out = web.StreamResponse(status=resp.status, headers={h: resp.headers[h] for h in _FORWARD_RESPONSE if h in resp.headers})
        await out.prepare(request)
        return await in_own_task(_copied(request, backend, resp, out, rename))  # its reads resume its own frames only


async def _sent_resumable(request: web.Request, backend: Backend, path: str, body: bytes, headers: dict[str, str],
                          rename: tuple[bytes, bytes] | None, resume: Resume) -> web.StreamResponse:
    """:func:`_sent` for a stream that is continued when vLLM breaks it (``resume.py``): vLLM's failure before its
    answer began (its engine dead: a 5xx, or the connection refused) is asked again once the model serves again,
    but a 5xx of a vLLM that still serves (``Resume.its_own``) is the request's own, passed on at once; its SSE answer
    is relayed by :func:`_continued`."""
    try:
        async with backend.upstream.request("POST", path, body=body, headers=headers, params=request.query,
                                            check=False) as resp:
            if resp.status < 500 and resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                out = web.StreamResponse(status=resp.status,
                                         headers={h: resp.headers[h] for h in _FORWARD_RESPONSE if h in resp.headers})
                await out.prepare(request)
                return await in_own_task(_continued(request, backend, resp, out, rename, resume))
            if resp.status < 500:  # vLLM's refusal (a 4xx), copied as it wrote it
                return await _copy_whole(request, resp, path)
            failed: VllamaError = UpstreamRejected((await read_response(resp))[:300].decode(errors="replace"), resp.status)
    except UpstreamError as e:
        failed = e
    if not await resume.asked_again(failed):
        raise failed
    resp = await resume.reopen(failed)
    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    return await in_own_task(_continued(request, backend, resp, out, rename, resume))


async def _answered_whole(request: web.Request, backend: Backend, path: str, body: bytes, headers: dict[str, str],
                          rename: tuple[bytes, bytes] | None, resume: Resume) -> web.StreamResponse:
    """:func:`_sent` for a non-streamed chat or completion under ``--resume``: vLLM's answer read whole before the
    client gets it. Broken before its last byte (vLLM's 5xx, the connection reset or closed; a connect that failed
    too where vllama runs the vLLM) by a vLLM that no longer serves (its ``/health`` fails: an engine dead), nothing
    has reached the client: the request is asked again whole, once, when the model serves again
    (``Resume.reopen``), and the client gets that answer, charged once by its usage (the broken one's work is
    vllama's cost; a client that leaves while no vLLM has its request is charged nothing). A vLLM that still serves
    failed the request itself: its error at once. Never on the idle-read timeout: a long answer is not a dead
    engine."""
    try:
        async with backend.upstream.request("POST", path, body=body, headers=headers, params=request.query,
                                            check=False) as resp:
            if resp.status < 500 and resp.status != 200:  # vLLM's refusal (a 4xx), copied as it wrote it
                return await _copy_whole(request, resp, path)
            data = await read_response(resp)
            if resp.status == 200:
                return _whole(request, resp, data, rename)
            failed: VllamaError = UpstreamRejected(error_message(data, f"vLLM answered HTTP {resp.status}"), resp.status)
    except UpstreamError as e:
        failed = e
    if isinstance(failed, UpstreamTimeout) or not resume.can(failed, before_answer=never_sent(failed)):
        raise failed
    try:
        if await resume.its_own(failed):
            raise failed
        resp = await resume.reopen(failed)
    except (ConnectionError, asyncio.CancelledError):
        if not resume.sending:
            call_of(request).usage = (0, 0)  # the client left while no vLLM had its request
        raise
    return _whole(request, resp, await read_response(resp), rename)


def _whole(request: web.Request, resp: Any, data: bytes, rename: tuple[bytes, bytes] | None) -> web.Response:
    """vLLM's whole 200 answer ``data`` as the client's, its usage read for the settler."""
    usage = _usage(data, request.path)
    if usage is not None:
        call_of(request).usage = usage
    return web.Response(status=200, body=data.replace(*rename) if rename is not None else data,
                        headers={h: resp.headers[h] for h in _FORWARD_RESPONSE if h in resp.headers})


async def _copy_whole(request: web.Request, resp: Any, path: str) -> web.StreamResponse:
    """vLLM's whole answer (a refusal) copied as it came, its 404 for a route of the other kind of model too."""
    if resp.status == 404 and path in _CAPABILITY:
        data = await _refuse_missing_route(request, resp, path)
    else:
        data = await read_response(resp)
    return web.Response(status=resp.status, body=data,
                        headers={h: resp.headers[h] for h in _FORWARD_RESPONSE if h in resp.headers})


async def _continued(request: web.Request, backend: Backend, resp: Any, out: web.StreamResponse,
                     rename: tuple[bytes, bytes] | None, resume: Resume) -> web.StreamResponse:
    """A relayed ``/v1`` SSE stream that survives its vLLM: each event decoded (``SSEDecoder``), its token ids kept
    by ``resume`` (and taken out when the client did not ask for them), written again; a break (the connection
    closed, reset or idle, or vLLM's error event) pauses the client's stream while ``resume`` asks the model's next
    vLLM for the rest, whose chunks come shaped as this route's, its usage covering the whole answer. What cannot
    be continued ends as :func:`_copied` ends it: an error event. The settler charges the usage vLLM reported
    (rewritten by ``resume``: the client's prompt once, every output token once), or what was relayed."""
    call = call_of(request)
    dumps = orjson.dumps
    drop = call.drop_usage
    usage: dict[str, Any] | None = None
    events = 0  # chunks with a choice relayed: the output of a stream cut without token ids (a vLLM that sends none)
    decoder = SSEDecoder()
    watch = backend.upstream.watch_body(resp)
    try:
        while True:
            try:
                while not decoder.done:
                    chunks = resume.take(decoder.feed(await read_some(resp)))
                    parts = []
                    for chunk in chunks:
                        if chunk.get("choices"):
                            events += 1
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                            if drop and not chunk.get("choices"):
                                continue  # asked by vllama for the settler, not by the client
                        parts.append(b"data: " + dumps(chunk) + b"\n\n")
                    if parts:
                        data = b"".join(parts)
                        await out.write(data.replace(*rename) if rename is not None else data)
                    if decoder.failure is not None:
                        raise decoder.failure
                break
            except VllamaError as e:
                if not resume.can(e):
                    raise
                watch.close()
                resp.close()
                resp = await resume.reopen(e, resume.thinking)  # the client's stream pauses here
                decoder = SSEDecoder()
                watch = backend.upstream.watch_body(resp)
    except (ConnectionError, asyncio.CancelledError):  # the client left: the tokens relayed so far were made
        call.usage = _relayed_usage(call, resume, usage, events)
        raise
    except VllamaError as e:
        call.stream_error = e
        call.usage = _relayed_usage(call, resume, usage, events)  # what was relayed before vLLM failed was made, and read
        await out.write(error_event(e, shape_of(request.path)))
        await out.write_eof()
        return out
    finally:
        watch.close()
    await out.write_eof(b"data: [DONE]\n\n")
    call.usage = _relayed_usage(call, resume, usage, events)
    return out


#: The agents' routes relayed to vLLM's own APIs (not resumed: ``resume.refusal``), and how their streams fail.
_OWN_APIS = ("/v1/messages", "/v1/responses")
_FAILED = (b"event: error", b'"type":"error"', b'"type": "error"', b"response.failed")


def _refused_if_failed(request: web.Request, tail: bytes) -> None:
    """The ``resume_refused`` line for a stream of vLLM's own Messages or Responses API that vLLM ended with its own
    error event (its engine died): it ends as before, and the log says why."""
    if any(mark in tail for mark in _FAILED):
        log.info("resume_refused", route=request.path, why=refusal(request.path, {}),
                 error=tail[-300:].decode(errors="replace"))


def _relayed_usage(call: Call, resume: Resume, usage: dict[str, Any] | None, events: int) -> tuple[int, int]:
    """``(prompt, output)`` tokens of a continued stream: vLLM's usage as ``resume`` rewrote it, else the prompt's
    ids (or its size) and the output's ids relayed, or its ``events`` with a choice (each ``stream_interval`` tokens,
    as :func:`_charge_cut` counts them) when vLLM sent no ids."""
    if usage is not None:
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    prompt = len(resume.prompt_ids) if resume.prompt_ids else int(prompt_tokens_guess(call.body))
    return prompt, len(resume.ids) or events * (getattr(call.typed, "stream_interval", None) or 1)


async def _copied(request: web.Request, backend: Backend, resp: Any, out: web.StreamResponse,
                  rename: tuple[bytes, bytes] | None) -> web.StreamResponse:
    """:func:`forward`'s loop: vLLM's answer ``resp`` copied to the prepared ``out`` as it comes, then its usage
    read for the settler (a stream its client leaves is charged what was relayed, :func:`_charge_cut`)."""
    call = call_of(request)
    content_type = resp.headers.get("Content-Type", "")
    whole = content_type.startswith("application/json")
    kept: deque[bytes] = deque(maxlen=None if whole else 4)
    sse = content_type.startswith("text/event-stream")
    events_filter = _Events(call.drop_usage, rename) if sse and (call.drop_usage or rename) else None
    hold = rename is not None and whole  # a JSON answer renamed once whole
    events = 0  # SSE events read: what a stream its client leaves is charged (_charge_cut)
    try:
        with backend.upstream.watch_body(resp):  # the idle-read timeout, without a timer per read
            while data := await read_raw(resp):
                kept.append(data)  # the last chunks (all of a JSON body): its usage, for the settler
                if sse:
                    events += data.count(b"\n\n")
                if events_filter is not None:  # whole events: the usage chunk vllama asked for dropped, renamed
                    data = events_filter.feed(data)
                elif hold:
                    continue
                if data:
                    await out.write(data)
        if events_filter is not None and events_filter.held:
            await out.write(events_filter.rest())
        if hold and rename is not None:
            await out.write(b"".join(kept).replace(*rename))
    except (ConnectionError, asyncio.CancelledError):  # the client left: vLLM's tokens so far were still made
        if resp.status == 200 and request.method == "POST":
            if sse:
                _charge_cut(request, call, kept, events)
            else:  # an answer vLLM sends whole: what it made before its abort is not known; the worst case is charged
                _charge_left(request, call)
        raise
    except UpstreamError as e:
        call.stream_error = e
        why = refusal(request.path, {}) if sse and request.app[SETTINGS].resume and resumable(e) else None
        if why is not None and request.method == "POST":  # vLLM's own Messages and Responses APIs: ended as before
            log.info("resume_refused", route=request.path, why=why, error=str(e)[:200])
        if sse:
            if resp.status == 200 and request.method == "POST":
                _charge_cut(request, call, kept, events)  # what was relayed before vLLM failed was made, and read
            await out.write(error_event(e, shape_of(request.path)))
        else:
            raise  # the connection is dropped: a truncated non-SSE body must not look complete
    if sse and request.method == "POST" and request.path in _OWN_APIS and request.app[SETTINGS].resume:
        _refused_if_failed(request, b"".join(kept))
    await out.write_eof()
    if resp.status == 200 and request.method == "POST":
        usage = _usage(b"".join(kept), request.path)
        if usage is not None:
            call.usage = usage
    return out


#: The routes vLLM serves only for one kind of model (pooling or generation), and the capability each needs.
_CAPABILITY = {"/v1/embeddings": "embeddings", "/v1/rerank": "embeddings", "/v1/score": "embeddings",
               "/v1/chat/completions": "generate", "/v1/completions": "generate"}


async def _refuse_missing_route(request: web.Request, resp: Any, path: str) -> bytes:
    """vLLM's 404 ``resp`` to ``path``; when it is FastAPI's ``{"detail": "Not Found"}`` (vLLM registers the route
    only for models of the other kind: pooling or generation), the client gets Ollama's words for it in the route
    family's shape instead. Returns the body of any other 404 (an unknown model, in vLLM's words).

    Raises:
        UnsupportedCapability: ``"X" does not support embeddings`` (or ``generate``), 400."""
    data = await read_response(resp)
    if b'"detail"' in data and b"Not Found" in data:
        call = call_of(request)
        raise UnsupportedCapability(call.asked or call.model or "the model", _CAPABILITY[path])
    return data


class _Events:
    """vLLM's SSE stream passed on in whole events: less its usage chunk (``"choices":[],"usage":{...}``, the one
    before ``[DONE]``) when vllama asked for it and the client did not (``drop``), and with ``rename``'s first bytes
    replaced by its second (a created model's name). The bytes of an event not yet ended wait for its end (vLLM
    writes one event a write, so they rarely wait at all). One ``rfind`` and one ``find`` per read."""

    __slots__ = ("held", "drop", "rename")

    def __init__(self, drop: bool, rename: tuple[bytes, bytes] | None) -> None:
        self.held = b""
        self.drop = drop
        self.rename = rename

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` (and the bytes held before it) the client gets now."""
        if self.held:
            data, self.held = self.held + data, b""
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self.held = data
            return b""
        if end < len(data):
            data, self.held = data[:end], data[end:]
        if self.drop:
            at = data.find(b'"choices":[],"usage":')
            if at >= 0:
                start = data.rfind(b"data:", 0, at)
                if start >= 0:
                    data = data[:start] + data[data.find(b"\n\n", at) + 2:]
        return data.replace(*self.rename) if self.rename is not None else data

    def rest(self) -> bytes:
        """The bytes held at the stream's end (an event vLLM did not end)."""
        held, self.held = self.held, b""
        return held.replace(*self.rename) if self.rename is not None else held


def _charge_left(request: web.Request, call: Call) -> None:
    """The usage of a non-streamed answer its client left before it came: its prompt by the body's size and the
    output it asked for (capped, per sequence), as admission reserved it (``admission.worst_case``): vLLM read the
    prompt and generated until the abort, and says nothing of it. Without it a key sent long prompts, hung up
    before the answer and was charged nothing."""
    typed = call.typed
    output = 0
    if isinstance(typed, Body) and typed.OUTPUT_FIELDS:
        asked = [x for x in (typed.output_asked(), call.key.max_tokens) if x]
        output = (min(asked) if asked else 16 if request.path == "/v1/completions" else 0) * typed.sequences()
    call.usage = (int(prompt_tokens_guess(call.body)), output)


def _charge_cut(request: web.Request, call: Call, kept: deque[bytes], events: int) -> None:
    """The usage of a stream cut before vLLM's usage chunk came (its client left, or vLLM failed): each SSE
    event relayed counts as ``stream_interval`` output tokens (vLLM sends one event per that many tokens, 1 by
    default), the prompt by the body's size (``fair_queue.prompt_tokens_guess``, as admission guesses it),
    unless the usage came after all. Without it a key read all but the last token of a long answer and left,
    and its budget, tpm and fair share were charged nothing."""
    interval = getattr(call.typed, "stream_interval", None) or 1
    call.usage = _usage(b"".join(kept), request.path) or (int(prompt_tokens_guess(call.body)), events * interval)


def _usage(tail: bytes, path: str = "") -> tuple[int, int] | None:
    """``(prompt tokens, output tokens)`` of vLLM's answer from its last bytes: the ``usage`` of a
    JSON body, or of the last SSE event that has one (streams with ``stream_options.include_usage``);
    ``count_tokens``' ``input_tokens`` (the prompt it rendered, charged as a prompt); ``None`` when there is
    none. Read once per request, after the answer was relayed.

    Three shapes: OpenAI's ``prompt_tokens``/``completion_tokens``; Anthropic's and the Responses
    API's ``input_tokens``/``output_tokens`` (a Responses stream's ``response.completed`` event
    carries it as ``response.usage``; Anthropic's counts cached input apart, added back here).
    """
    if path == "/v1/messages/count_tokens":
        try:
            counted = orjson.loads(tail).get("input_tokens")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return (counted, 0) if isinstance(counted, int) else None
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
