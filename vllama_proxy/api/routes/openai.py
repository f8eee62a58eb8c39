"""``/v1/*`` passed to vLLM unchanged (streaming included), with Ollama model names mapped.

Copilot and every OpenAI client send inference here, as they would to Ollama's
own OpenAI-compatible surface. The ``model`` field of a JSON body picks the vLLM
server and is rewritten (``qwen2.5:1.5b`` -> the served name); the answer is
relayed byte for byte (but the usage chunk of a stream that did not ask for it: ``_ask_usage``).
``GET /v1/models`` lists every model vllama launched. vllama's own refusals are raised into ``errors.py``'s tree
(OpenAI's error shape on ``/v1``: ``api/app.py``); an upstream failure after the answer began ends an SSE stream with
that object as its last event (``errors.error_event``), as vLLM ends its own.
"""

from __future__ import annotations

import asyncio
import email.policy
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from email.parser import BytesParser
from typing import Any

import orjson
from aiohttp import web

from vllama_proxy.errors import BadRequest, FormNotAccepted, ModelNotFound, NoSuchModel, TooManyChoices, UpstreamError, error_event, shape_of
from vllama_proxy.models.vllm_servers import Backend, ServedModel
from vllama_proxy.upstream import encode_json, read_raw, read_response
from ..relay import in_own_task
from ..request_body import read_body
from .model_use import check_model, may_list, model_in_use, refuse_outside
from ..ollama_types import MAX_STOPS, check_depth
from ..user_fields import user_body
from ..cache_salt import own_caches
from ..admission import with_priority
from ..api_keys import key_of
from ..metrics import MODEL, USAGE
from ..fair_queue import prompt_tokens_guess
from ..app_state import CATALOG, CLIENT_SESSIONS, ROUTER_SESSIONS, SETTINGS
from .. import session
from ..client_sessions import ROUTER_HEADERS
from ..translate.to_openai import OUTPUT_TOKEN_FIELDS
from .output_tokens import cap_output

_FORWARD_PLAIN = ("Content-Type", "Accept")
#: ... and a router's session keys as the client sent them (vllm-router's hash_key.rs), where they are not
#: replaced by the client's key scoped to its caller (a node, ``--session-header ''``: ``client_sessions.py``)
_FORWARD_REQUEST = (*_FORWARD_PLAIN, *ROUTER_HEADERS)
_FORWARD_RESPONSE = ("Content-Type", "Cache-Control")


def _model_entry(model: ServedModel) -> dict:
    """One model in vLLM's ``/v1/models`` shape (``vllm/entrypoints/openai/protocol.py`` ModelCard)."""
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "vllm",
            "root": model.root, "parent": None, "max_model_len": model.max_model_len}


async def _models(request: web.Request) -> web.Response | None:
    """``GET /v1/models[/{id}]`` answered from the catalog when vllama launched the models (all
    of them listed, none woken up to be asked); ``None`` for an ``--upstream`` server.

    Raises:
        NoSuchModel: ``{id}`` names no model (404), where the key's patterns allow the name.
        Forbidden: the key may not see ``{id}`` (403), known or not."""
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
        refuse_outside(key_of(request), wanted)  # no 404 to tell a key what exists outside its patterns
        raise NoSuchModel(wanted) from None


async def _route(request: web.Request, body: bytes) -> tuple[Any, ServedModel | None, Backend]:
    """``(parsed body, its model, the backend it goes to)``, decided from vllama's own parse of the body
    (the parsed body is ``None`` for a form or no body; :func:`_forwarded` writes what is sent).

    Every body is parsed here, once, strictly (orjson: no ``NaN``/``Infinity``, no lone surrogate,
    nothing after the value), whatever its ``Content-Type`` (vLLM reads a body without one as JSON);
    one that does not parse is a 400 and never forwarded, and what is
    forwarded is the parsed body written again (``model`` mapped to the served name, the vLLM
    ``priority``, the key's ``cache_salt`` and media uuids: ``cache_salt.py``, the output tokens capped:
    :func:`translate.cap_output_tokens`), so vLLM reads
    exactly what was checked (issue 38). A ``multipart/form-data`` body (audio) is checked by its
    one ``model`` field and forwarded as sent; on any other route it is a 415 (:data:`_FORM_ROUTES`).

    The key is checked against the model before anything is claimed or loaded: the name is looked
    up first, and only an allowed request for an on-demand model claims its slot. With one backend,
    a request without a model (or naming one vllama does not know, which the key's patterns allow)
    goes there and vLLM answers in its own words; with several that is answered here, no vLLM
    woken for it: 400 without a model, 404 for an unknown one (in vLLM's words).

    Raises:
        BadRequest: a body that does not parse, nests too deep (``ollama_types.check_depth``), has too
            many stop entries (:func:`check_stops`), gives a field a user key may not send
            (``user_fields.user_body``) or a ``cache_salt`` vLLM would refuse; with several models,
            none named (``param`` ``model``).
        TooManyChoices: a user key's ``n`` x prompts over ``--max-choices``.
        NoSuchModel: with several models, a name none of them has (404).
        Forbidden: the key may not use the model (403).
    """
    catalog = request.app[CATALOG]
    key = key_of(request)
    one = len(catalog.backends) == 1
    form = request.content_type == "multipart/form-data"
    data: Any = None
    name: Any = None
    if form and request.path not in _FORM_ROUTES:  # an allow-list: only the audio routes take a form
        raise FormNotAccepted(f"{request.path} takes a JSON body, not multipart/form-data")
    if body and form:
        name = _form_model(request.headers.get("Content-Type", ""), body)
    elif body:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"invalid JSON: {e}") from None
        if isinstance(data, (dict, list)):
            check_depth(data)
        name = data.get("model") if isinstance(data, dict) else None
        if isinstance(data, dict) and request.method == "POST":
            if request.path in _STREAMED_USAGE:
                check_stops(data)
                if not key.admin:
                    _check_choices(data, request.app[SETTINGS].max_choices)
            if not key.admin:
                user_body(request.path, data)  # an allow-list of fields: nothing of vLLM's own machinery
            if request.path in _SALTED:
                own_caches(data, key.cache_salt)  # the key's own prefix and media caches (a uuid names its key's item)
    if not isinstance(name, str):
        if not one:
            raise BadRequest("you must provide a model parameter", param="model")
        default = catalog.backends[0]
        if default.model is not None:  # a key limited to some models may not reach this one unnamed
            check_model(key, default.model.name, default.model)
        return data, default.model, default
    try:
        model = await catalog.resolve(name)  # a lookup: claims, loads and evicts nothing (issue 38)
    except ModelNotFound:
        refuse_outside(key, name)
        if one:
            return data, None, catalog.backends[0]  # vLLM answers the 404 in its own words
        raise NoSuchModel(name) from None
    check_model(key, name, model, catalog.created(name))
    if request.method == "POST" and not catalog.is_configured(model):
        try:  # inference claims an on-demand slot, only now that the key may use it
            model = await catalog.resolve(name, claim=True)
        except ModelNotFound:
            raise NoSuchModel(name) from None
    request[MODEL] = model.name
    backend = catalog.backend_of(model)
    if isinstance(data, dict):
        data["model"] = model.name
    return data, model, backend


def _check_choices(data: dict[str, Any], most: int) -> None:
    """Refuse a request that would start more than ``most`` sequences in vLLM: its ``n`` (vLLM's
    ``SamplingParams.n``, the beam width with ``use_beam_search``) times its prompts (a ``/v1/completions``
    ``prompt`` may be a list of them, and so may its ``prompt_embeds``, with ``--enable-prompt-embeds``). vLLM bounds neither, and each of them holds a running slot and
    generates up to ``max_tokens``, while vllama's admission bound and a key's share count the request
    once: one user's ``n: 500`` took more of vLLM than 500 requests of its share would have.

    Raises:
        TooManyChoices: over ``most`` (``--max-choices``)."""
    n = data.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    prompts = max(_prompts(data.get("prompt")) + _prompts(data.get("prompt_embeds")), 1)
    if n * prompts > most:
        raise TooManyChoices(f"this request asks for {n * prompts} sequences at once (n {n} x {prompts} prompts); a key "
                             f"of role user may ask for at most {most} (--max-choices): send several requests")


def _prompts(value: Any) -> int:
    """The prompts of a ``/v1/completions`` ``prompt`` or ``prompt_embeds`` (vLLM 0.32 ``CompletionRequest``:
    a string, token ids or one base64 tensor is one; a list of them is each; absent or empty is none)."""
    if isinstance(value, list):
        return len(value) if value and not isinstance(value[0], int) else 1 if value else 0
    return 1 if value else 0


def check_stops(data: dict[str, Any], fields: tuple[str, ...] = ("stop", "stop_token_ids", "bad_words")) -> None:
    """Refuse a ``stop``, ``stop_token_ids`` or ``bad_words`` list (Anthropic's ``stop_sequences``:
    ``agents.py``) of more than ``ollama_types.MAX_STOPS`` entries: vLLM pays for each on every token,
    in loops other users' requests share (its docstring).

    Raises:
        BadRequest: over the bound, naming the field."""
    for field in fields:
        value = data.get(field)
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise BadRequest(f"invalid {field}: at most {MAX_STOPS} entries, not {len(value)}")


async def _forwarded(request: web.Request, body: bytes, data: Any, model: ServedModel | None, backend: Backend) -> bytes:
    """What is forwarded: the parsed JSON ``data`` written again (for a POST with the priority, and
    the output tokens capped: ``output_tokens.cap_output``), or ``body`` as sent when it was no
    JSON (a form, or none). Runs with the model held (its ``/tokenize`` may be asked)."""
    if data is None:
        return body
    if isinstance(data, dict) and request.method == "POST":
        with_priority(request, data)
        fields = OUTPUT_TOKEN_FIELDS.get(request.path)
        if fields is not None:
            await cap_output(request, backend.upstream, model, data, fields)
        if request.path in _STREAMED_USAGE and _ask_usage(data):
            request[_DROP_USAGE] = True
    return encode_json(data)


#: The relayed routes that take a ``multipart/form-data`` body (an audio file): every other one takes JSON, and a
#: form there would pass vllama's checks of the JSON body (fields, salt, stops, choices) unread.
_FORM_ROUTES = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
#: The relayed routes whose vLLM request model takes ``cache_salt`` (vLLM 0.32; ``cache_salt.py``).
_SALTED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/v1/score"})
#: The relayed routes whose streams carry their usage only when asked (``stream_options.include_usage``).
_STREAMED_USAGE = ("/v1/chat/completions", "/v1/completions")
#: Request key: vllama asked vLLM for a stream's usage the client did not ask for; its chunk is dropped.
_DROP_USAGE = "vllama.drop_usage"


def _ask_usage(data: dict[str, Any]) -> bool:
    """Ask vLLM for the usage of a stream that did not ask for it (``stream_options.include_usage``,
    without ``continuous_usage_stats``: one chunk, at the end); whether it was asked here.

    Without it vLLM's stream says nothing of its tokens, and the key's ``budget_tokens``, ``tpm``, fair
    share and ledger row counted none of them: a user key streaming from an OpenAI client that does not
    ask (most do not) was never charged. The client still gets the stream it asked for (``_DropUsage``)."""
    if data.get("stream") is not True:
        return False
    options = data.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    data["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True,
                              "continuous_usage_stats": False}
    return True


class _DropUsage:
    """vLLM's SSE stream less its usage chunk (``"choices":[],"usage":{...}``, the one before
    ``[DONE]``), which :func:`_ask_usage` asked for and the client did not. Whole events are passed on
    as they come; the bytes of an event not yet ended wait for its end (vLLM writes one event a write, so
    they rarely wait at all). One ``rfind`` and one ``find`` per read."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = b""

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
        at = data.find(b'"choices":[],"usage":')
        if at >= 0:
            start = data.rfind(b"data:", 0, at)
            if start >= 0:
                data = data[:start] + data[data.find(b"\n\n", at) + 2:]
        return data


def _form_model(content_type: str, body: bytes) -> str | None:
    """The ``model`` field of a ``multipart/form-data`` body (stdlib ``email`` parser), if any.

    Raises:
        BadRequest: the body gives ``model`` more than once (which one vLLM reads is its
            parser's choice, not the one checked here)."""
    message = BytesParser(policy=email.policy.HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        return None
    found = [part for part in message.iter_parts() if part.get_param("name", header="content-disposition") == "model"]
    if len(found) > 1:
        raise BadRequest("the form gives `model` more than once", param="model")
    if not found:
        return None
    value = found[0].get_payload(decode=True)
    return value.decode("utf-8", "replace").strip() if isinstance(value, bytes) else None


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
    body = await read_body(request)
    data, model, backend = await _route(request, body)
    with request.app[CLIENT_SESSIONS].hold_request(request) as own:  # counted until the answer ends
        sent, release = _placement(request, data, own)
        try:
            return await relay(request, backend, "/v1/" + request.match_info["tail"], body, session_headers=sent,
                               ready_body=lambda: _forwarded(request, body, data, model, backend))
        finally:
            if release is not None:  # after the answer's last byte, or its error, or the client's leaving
                request.app[ROUTER_SESSIONS].release(backend.upstream, release)


#: The relayed inference routes a router places by load (``--request-sessions``).
_PLACED = ("/v1/chat/completions", "/v1/completions")


def _placement(request: web.Request, data: Any, own: str | None) -> tuple[dict[str, str], str | None]:
    """The session header for a relayed request, and the key to release when it ends (``session.placement``).

    The client's own key ``own`` (``client_sessions.ClientSessions.hold``: its ``X-Session-ID``, else its
    ``X-User-ID``, scoped to its caller; ``None`` beyond the bound in flight) on any route, never released.
    Else, with ``--request-sessions on``, a ``/v1/chat/completions`` or ``/v1/completions``: a chat gets the
    key ``/api/chat`` would (``session.openai_key``: its shared system prompt's, or under ``--session-key
    conversation`` its conversation's), any other request a key of its own. Nothing for other routes, or with
    the setting off (on a node and with ``--session-header ''`` the client's headers are forwarded as they
    came: ``relay``)."""
    settings = request.app[SETTINGS]
    if own:
        return session.placement(settings.session_header, own, None, False)
    if settings.request_sessions != "on" or request.method != "POST" or request.path not in _PLACED or not isinstance(data, dict):
        return {}, None
    model = data.get("model")
    key = session.openai_key(model, data, settings.session_key) if isinstance(model, str) else None
    return session.placement(settings.session_header, None, key, True)


async def relay(request: web.Request, backend: Backend, path: str, body: bytes, keep_alive: object = None,
                session_headers: Mapping[str, str] | None = None,
                ready_body: Callable[[], Awaitable[bytes]] | None = None) -> web.StreamResponse:
    """Send ``body`` to ``backend``'s vLLM at ``path`` and relay its answer back chunk by chunk, as it comes.

    The model is held for the request (``model_in_use``: woken or started first, counted in
    flight); the usage of a 200 answer is read from its last bytes for the per-key counters
    (``_usage``). ``session_headers`` (a conversation's key for a router) are added to the
    client's own. ``ready_body``: what to send instead of ``body``, built once the model is held.
    A body that is not a form goes as ``application/json``: vllama parsed it and wrote it again. An upstream failure after the answer began ends an SSE stream with
    an error event in the route family's shape (``errors.error_event``: OpenAI's ``data: {"error": {...}}`` as vLLM
    writes its own, Anthropic's ``event: error`` on ``/v1/messages``); a JSON body is cut off instead.

    Raises:
        UpstreamError: vLLM failed before its answer began (mapped in ``api/app.py``).
    """
    forward = _FORWARD_PLAIN if request.app[CLIENT_SESSIONS].scoped else _FORWARD_REQUEST  # a client's key: scoped, not as sent
    headers = {h: request.headers[h] for h in forward if h in request.headers}
    headers.update(session_headers or {})  # a router's conversation key (api/session.py)
    async with model_in_use(request, backend, keep_alive):  # a sleeping or unloaded model comes back first
        if ready_body is not None:
            body = await ready_body()  # built with the model held: its /tokenize may be asked (output_tokens.py)
        if body and request.content_type != "multipart/form-data":
            headers["Content-Type"] = "application/json"  # the body vllama parsed and wrote again, whatever was sent
        async with backend.upstream.request(
            request.method, path, body=body or None, headers=headers, params=request.query, check=False
        ) as resp:
            out = web.StreamResponse(status=resp.status, headers={h: resp.headers[h] for h in _FORWARD_RESPONSE if h in resp.headers})
            await out.prepare(request)
            return await in_own_task(_copied(request, backend, resp, out, body))  # its reads resume its own frames only


async def _copied(request: web.Request, backend: Backend, resp: Any, out: web.StreamResponse, body: bytes) -> web.StreamResponse:
    """:func:`relay`'s loop: vLLM's answer ``resp`` copied to the prepared ``out`` as it comes, then its usage
    read (``body``, what was sent: a stream its client leaves is charged by it, :func:`_charge_cut`)."""
    content_type = resp.headers.get("Content-Type", "")
    kept: deque[bytes] = deque(maxlen=None if content_type.startswith("application/json") else 4)
    sse = content_type.startswith("text/event-stream")
    drop = _DropUsage() if request.get(_DROP_USAGE) and sse else None
    events = 0  # SSE events read: what a stream its client leaves is charged (_charge_cut)
    try:
        with backend.upstream.watch_body(resp):  # the idle-read timeout, without a timer per read
            while data := await read_raw(resp):
                kept.append(data)  # the last chunks (all of a JSON body): its usage, for the per-key counters
                if sse:
                    events += data.count(b"\n\n")
                if drop is not None:  # the usage chunk vllama asked for, not the client (_ask_usage)
                    data = drop.feed(data)
                if data:
                    await out.write(data)
        if drop is not None and drop.held:
            await out.write(drop.held)
    except (ConnectionError, asyncio.CancelledError):  # the client left: vLLM's tokens so far were still made
        if sse and resp.status == 200 and request.method == "POST":
            _charge_cut(request, body, kept, events)
        raise
    except UpstreamError as e:
        request["vllama.stream_error"] = e
        if sse:
            await out.write(error_event(e, shape_of(request.path)))
        else:
            raise  # the connection is dropped: a truncated non-SSE body must not look complete
    await out.write_eof()
    if resp.status == 200 and request.method == "POST":
        usage = _usage(b"".join(kept))
        if usage is not None:
            request[USAGE] = usage
    return out


def _charge_cut(request: web.Request, body: bytes, kept: deque[bytes], events: int) -> None:
    """The usage of a stream its client left before vLLM's usage chunk came: each SSE event relayed
    counts as one output token (vLLM sends one a token: ``--stream-interval`` 1), the prompt by the
    body's size (``fair_queue.prompt_tokens_guess``, as admission guesses it), unless the usage came after all.
    Without it a key read all but the last token of a long answer and left, and its budget, tpm and
    fair share were charged nothing."""
    request[USAGE] = _usage(b"".join(kept)) or (int(prompt_tokens_guess(body)), events)


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
