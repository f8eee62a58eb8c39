"""What a request does with its model before it goes upstream: the load/evict protocol.

The name is resolved (an on-demand model claims a slot, ``models/catalog.py``), the request's
key is checked against it (``api/policy/keys.py``), and :func:`model_in_use` holds the model for the
request: a sleeping or unloaded one is woken or started (idle ones make room), the request
counts in flight so the supervisor neither puts it to sleep nor evicts it, and its keep_alive
is renewed at the start and the end. :func:`load_reply` answers Ollama's load and unload
requests (an empty prompt, ``keep_alive: 0``) with the same protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp import web

from vllama_proxy.errors import (
    BadRequest,
    Forbidden,
    ModelNotFound,
    UpstreamUnavailable,
)
from vllama_proxy.models.vllm_servers import Backend, ServedModel
from vllama_proxy.models.created import CreatedModel
from vllama_proxy.models.keep_alive import parse_keep_alive

from ..app_state import CATALOG, SETTINGS, WORKER
from ..policy.keys import Key, key_of
from ..request.call import call_of
from ..ollama.types import require_model
from ..ollama.timestamps import CLOCK


async def resolve_model(request: web.Request, name: str | None) -> tuple[str, ServedModel, Backend]:
    """``(name as sent, served model, its backend)`` for inference or an explicit load: a local model
    no on-demand slot holds claims one, only once the key may use it (the name is looked
    up and the key checked first, so a refused request claims, loads and evicts nothing).

    Raises:
        BadRequest: no model named.
        ModelNotFound: the name is unknown.
        Forbidden: the key may not use it, or may not start it (``--on-demand-admin-only``).
    """
    name = require_model(name)
    catalog = request.app[CATALOG]
    key = key_of(request)
    _, model, backend = await lookup_model(request, name)  # raises Forbidden before anything is claimed
    if backend is None:
        if not key.admin and request.app[SETTINGS].on_demand_admin_only:
            raise Forbidden(f"key '{key.name}' (role {key.role}) may not start '{name}', which is not loaded: "
                            "this server starts models on demand for admin keys only (--on-demand-admin-only)")
        model = await catalog.resolve(name, claim=True, evict_kept=key.admin)  # a user ends no other's keep_alive
        backend = catalog.backend_of(model)
    call_of(request).model = model.name  # charged to it (settler.py)
    return name, model, backend


def refuse_outside(key: Key, name: str) -> None:
    """403 for a name the key's patterns do not match, whether or not such a model exists (called when
    it does not): otherwise a 404 for an unknown name beside the 403 for another tenant's model would
    tell a key which models exist outside its patterns.

    Raises:
        Forbidden: ``name`` is outside ``key``'s ``models`` patterns (as :func:`check_model` words it).
    """
    if not key.may_use(name):
        raise _outside(key, name)


def _outside(key: Key, name: str) -> Forbidden:
    return Forbidden(f"key '{key.name}' may not use model '{name}' (its models: {', '.join(key.models)})")


def check_model(key: Key, name: str, model: ServedModel, made: CreatedModel | None = None) -> None:
    """403 unless ``key`` may use ``model`` (asked as ``name``): its ``models`` patterns match the
    name as asked, the served name or the repo (``api/policy/keys.py``). A model made with ``/api/create``
    (``made``; ``model`` is then its base) is matched by its own name only: a key that may use a
    base does not thereby use every model made of it, with its adapter and system prompt."""
    allowed = key.may_use(name, made.name) if made is not None else key.may_use(name, model.name, model.root)
    if not allowed:
        raise _outside(key, name)


def may_list(request: web.Request, model: ServedModel, names: list[str]) -> bool:
    """Whether the request's key may see ``model`` in a listing (tags, ps, /v1/models)."""
    key = key_of(request)
    return not key.models or key.may_use(model.name, model.root, *names)


def may_list_created(request: web.Request, made: CreatedModel) -> bool:
    """Whether the request's key may see a model made with ``/api/create`` in a listing: its own
    name matches the key's patterns (as :func:`check_model`), whatever its base's."""
    key = key_of(request)
    return not key.models or key.may_use(made.name)


#: The request's ``(name, the model made with /api/create it names or None)``, as :func:`lookup_model` read it.
CREATED = "vllama.created"


def created_of(request: web.Request, name: str) -> CreatedModel | None:
    """The model made with ``/api/create`` that ``name`` names, as this request's :func:`lookup_model`
    read it (the created models' file is looked at once per request), else read now."""
    seen = request.get(CREATED)
    if seen is not None and seen[0] == name:
        return seen[1]
    return request.app[CATALOG].created(name)


async def lookup_model(request: web.Request, name: str | None) -> tuple[str, ServedModel, Backend | None]:
    """``(name as sent, served model, its backend or None)`` without loading anything: an on-demand
    model no slot holds has no backend (looking a model up never loads it)."""
    name = require_model(name)
    catalog = request.app[CATALOG]
    made = catalog.created(name)  # read once per request (a stat of its file each time): see created_of
    request[CREATED] = (name, made)
    try:
        model = await catalog.resolve(name, made=made)
    except ModelNotFound:
        refuse_outside(key_of(request), name)  # a 404 only for names the key may use: it learns no other's models
        raise
    check_model(key_of(request), name, model, made)
    try:
        return name, model, catalog.backend_of(model)
    except ModelNotFound:
        return name, model, None


def wants_unload(request: web.Request, keep_alive: Any) -> bool:
    """Whether a load request's ``keep_alive`` unloads (0): it must not load the model first."""
    return parse_keep_alive(keep_alive, default=1.0) == 0


def where_models_change(request: web.Request) -> str:
    """How the served models are changed, true to the mode vllama runs in."""
    upstream = request.app[SETTINGS].upstream
    if upstream:
        return f"vllama proxies the vLLM server at {upstream}, which decides what it serves: change its models there"
    return "change the served models with `vllama serve --model M` or the config file's [[models]] (see README)"


async def load_reply(request: web.Request, asked: str | None, keep_alive: Any, *, chat: bool) -> web.Response:
    """Ollama's answer to an empty prompt / no messages for the model ``asked`` (the request's
    ``model``): the model is (un)loaded, nothing generated.

    ``done_reason`` is ``load`` (a sleeping or unloaded model is brought back first), or
    ``unload`` when ``keep_alive`` is 0: the keep-alive ends now and the supervisor puts
    vLLM to sleep or stops it at its next check (Ollama ``server/routes.go``
    GenerateHandler/ChatHandler). An unload only looks the model up (:func:`lookup_model`: it
    never loads the model first); a load resolves it (:func:`resolve_model`).

    Raises:
        BadRequest: an unload of a model vllama does not run (``--upstream``): a 400 saying so,
            not a ``done_reason: unload`` for a model that stays loaded.
        What :func:`lookup_model` and :func:`resolve_model` raise (404, 403, 503...).
    """
    backend: Backend | None
    if wants_unload(request, keep_alive):
        name, _, backend = await lookup_model(request, asked)
    else:
        name, _, backend = await resolve_model(request, asked)
    board = backend.board if backend is not None else None
    default = board.keep_alive if board is not None else request.app[SETTINGS].keep_alive_seconds()
    unload = parse_keep_alive(keep_alive, default=default) == 0
    key = key_of(request)
    if unload and backend is None:
        pass  # an on-demand model no slot holds: nothing is loaded, nothing to unload
    elif unload and not key.admin and board is not None and (board.in_flight or backend.slot is None):
        # a user may unload an on-demand model no one else uses; not the operator's, not one in use
        raise Forbidden(f"key '{key.name}' (role {key.role}) may not unload '{name}' (keep_alive 0): "
                        f"{'others are using it' if board.in_flight else 'the operator runs it'}; that needs an admin key")
    elif unload:
        if board is None:  # --upstream: the model lives in a vLLM vllama does not run
            raise BadRequest(f"vllama cannot unload '{name}': it does not run that model; {where_models_change(request)}")
        board.touch(0)
    else:
        assert backend is not None
        async with model_in_use(request, backend, keep_alive):
            pass
    body: dict[str, Any] = {"model": name, "created_at": CLOCK.now()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    body.update(done=True, done_reason="unload" if unload else "load")
    return web.json_response(body, dumps=_dumps)


@asynccontextmanager
async def model_in_use(request: web.Request, backend: Backend, keep_alive: Any) -> AsyncIterator[None]:
    """Hold ``backend``'s model for one request: loaded, counted in flight, keep-alive renewed.

    When vllama runs the model: a sleeping or unloaded one is woken or started (bounded
    by ``--load-timeout``, while idle models make room), the request counts as in flight
    (so the model is neither put to sleep nor evicted under it), and its keep_alive
    (Ollama: per request, else the model's default; negative forever) counts from the
    start and again from the end of the request. With ``--upstream`` it does nothing.

    Raises:
        UpstreamUnavailable: the model is starting at launch (503 "loading"), failed, or
            could not be brought back in time.
    """
    board = backend.board
    if board is None:
        yield
        return
    seconds = parse_keep_alive(keep_alive, default=board.keep_alive)
    if seconds <= 0 and not key_of(request).admin:
        seconds = board.keep_alive  # a user neither unloads after its request nor pins a model forever
    slot = request.app[WORKER]
    held = board.served_name  # an on-demand slot may take another model before this request is counted
    timeout = request.app[SETTINGS].load_timeout
    if not (board.available or board.waking or board.loading):
        raise board.unavailable()
    # A model serving now is counted in flight at once: one lock section instead of the wait's three
    # (begin waiting, ready, stop waiting; docs/decisions.md)
    if not board.try_begin(slot):
        board.wait_begin(slot)  # counted from here on: a model requests wait for is not evicted
        try:
            while True:
                await board.wait_ready(timeout, slot)
                if board.try_begin(slot):  # before wait_end: never uncounted in between
                    break
                # the supervisor began putting it to sleep after wait_ready saw it ready: wait again
        finally:
            board.wait_end(slot)
    if board.served_name != held:
        board.end(slot)
        raise UpstreamUnavailable(f"model '{held}' was unloaded for another model before this request began; retry")
    board.touch(seconds)
    try:
        yield
    finally:
        board.touch(seconds)  # Ollama sets the expiry after each request; before end(), so the
        board.end(slot)  # supervisor never sees it idle with the old expiry


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()
