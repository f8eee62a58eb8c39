"""What a request does with its model before it goes upstream: the load/evict protocol.

:func:`choose` resolves the name once, in one step: the created model it names, the served model (an
on-demand model claims a slot, ``models/catalog.py``) and the key checked against it
(``api/policy/keys.py``) before anything is claimed; its :class:`Resolved` is all that later steps read of
the model. :func:`model_in_use` holds the model for the request: a sleeping or unloaded one is woken or
started (idle ones make room), the request counts in flight so the supervisor neither puts it to sleep nor
evicts it, and its keep_alive is renewed at the start and the end. :func:`load_reply` answers Ollama's load
and unload requests (an empty prompt, ``keep_alive: 0``) with the same protocol.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from vllama_proxy.errors import (
    BadRequest,
    Forbidden,
    ModelInUse,
    ModelNotFound,
    UpstreamUnavailable,
)
from vllama_proxy.models.vllm_servers import Backend, ServedModel
from vllama_proxy.models.created import CreatedModel
from vllama_proxy.logs import get_logger
from vllama_proxy.supervisor.states import State

from ..app_state import CATALOG, SETTINGS, WORKER
from ..policy.keys import Key, key_of
from ..request.call import Call
from ..ollama.timestamps import CLOCK

log = get_logger("vllama.routes")


@dataclass(frozen=True, slots=True)
class Resolved:
    """The model a request named, resolved for it once (:func:`choose`): what every later step reads.

    Attributes:
        name: the name as the client sent it (echoed in its answer).
        model: the served model (a created model's base).
        backend: its vLLM server; ``None`` for a lookup of an on-demand model no slot holds.
        made: the model made with ``/api/create`` that ``name`` names, else ``None``.
    """

    name: str
    model: ServedModel
    backend: Backend | None
    made: CreatedModel | None

    @property
    def served(self) -> str:
        """vLLM's ``model`` for the request: a created model's LoRA adapter, else the served model's name."""
        return self.made.served_as(self.model.name) if self.made is not None else self.model.name


async def choose(request: web.Request, call: Call, name: str | None, *, load: bool = True) -> Resolved:
    """The model ``name`` names, looked up once and checked against ``call.key`` in one step, before anything
    is claimed or loaded. With ``load`` (inference, an explicit load) a local model no on-demand slot holds
    claims one and the request is charged to it (``call.model``, ``settler.py``); without (an unload, a
    lookup) nothing is claimed and an on-demand model no slot holds has no backend.

    Raises:
        BadRequest: no model named.
        Forbidden: the key may not use the name (asked whether or not such a model exists: a 404 beside
            another tenant's 403 would tell a key which models exist outside its patterns), or may not
            start it (``--on-demand-admin-only``).
        ModelNotFound: the name is unknown (to a key that may use it).
    """
    name = require_model(name)
    app = request.app
    catalog = app[CATALOG]
    key = call.key
    made = catalog.created(name)  # the created models' file: looked at once per request
    missing: ModelNotFound | None = None
    try:
        model: ServedModel | None = await catalog.resolve(name, made=made)
    except ModelNotFound as e:
        model, missing = None, e
    check_model(key, name, model, made)  # before the 404: a key learns no model outside its patterns
    if missing is not None:
        raise missing
    assert model is not None
    try:
        backend: Backend | None = catalog.backend_of(model)
    except ModelNotFound:
        backend = None  # an on-demand model no slot holds (looking a model up never loads it)
    if load:
        if backend is None:
            if not key.admin and app[SETTINGS].on_demand_admin_only:
                raise Forbidden(f"key '{key.name}' (role {key.role}) may not start '{name}', which is not loaded: "
                                "this server starts models on demand for admin keys only (--on-demand-admin-only)")
            model = await catalog.resolve(name, claim=True, made=made, evict_kept=key.admin)  # a user ends no other's keep_alive
            backend = catalog.backend_of(model)
        call.model = model.name  # charged to it (settler.py)
    return Resolved(name, model, backend, made)


def require_model(name: str | None) -> str:
    """Ollama's check: a missing or empty ``model`` is a 400 ``model is required``."""
    if not name:
        raise BadRequest("model is required")
    return name


def refuse_outside(key: Key, name: str) -> None:
    """403 for a name the key's patterns do not match, asked when no such model exists (as :func:`choose`
    does, for a route that looks models up on its own).

    Raises:
        Forbidden: ``name`` is outside ``key``'s ``models`` patterns.
    """
    check_model(key, name, None)


def check_model(key: Key, name: str, model: ServedModel | None, made: CreatedModel | None = None) -> None:
    """403 unless ``key`` may use ``model`` (asked as ``name``; ``None``: no such model): its ``models`` patterns
    (``Key.may_use``) match the name as asked, or the served name or repo of the model found. A created model
    (``made``; ``model`` is then its base) is matched by its own name only: a key that may use a base does not
    thereby use every model made of it, with its adapter and system prompt."""
    names = (name,) if model is None else (name, made.name) if made is not None else (name, model.name, model.root)
    if not key.may_use(*names):
        raise Forbidden(f"key '{key.name}' may not use model '{name}' (its models: {', '.join(key.models)})")


def may_list(request: web.Request, model: ServedModel, names: list[str]) -> bool:
    """Whether the request's key may see ``model`` in a listing (tags, ps, /v1/models)."""
    key = key_of(request)
    return not key.models or key.may_use(model.name, model.root, *names)


def may_list_created(request: web.Request, made: CreatedModel) -> bool:
    """Whether the request's key may see a model made with ``/api/create`` in a listing: its own
    name matches the key's patterns (as :func:`check_model`), whatever its base's."""
    key = key_of(request)
    return not key.models or key.may_use(made.name)


def where_models_change(request: web.Request) -> str:
    """How the served models are changed, true to the mode vllama runs in."""
    upstream = request.app[SETTINGS].upstream
    if upstream:
        return f"vllama proxies the vLLM server at {upstream}, which decides what it serves: change its models there"
    return "change the served models with `vllama serve --model M` or the config file's [[models]] (see README)"


async def load_reply(request: web.Request, call: Call, use: Resolved, keep_alive: float | None, *,
                     chat: bool) -> web.Response:
    """Ollama's answer to an empty prompt / no messages (a load request) for the model ``use``
    (:func:`choose`: with ``load`` unless ``keep_alive`` is 0): the model is (un)loaded, nothing generated.

    ``done_reason`` is ``load`` (a sleeping or unloaded model is brought back first), or
    ``unload`` when ``keep_alive`` (seconds, ``None``: the model's default) is 0: the keep-alive ends
    now and the supervisor puts vLLM to sleep or stops it at its next check (Ollama ``server/routes.go``
    GenerateHandler/ChatHandler). An unload's model was only looked up: it is never loaded first.

    Raises:
        BadRequest: an unload of a model vllama does not run (``--upstream``): a 400 saying so,
            not a ``done_reason: unload`` for a model that stays loaded.
        Forbidden: a user key's unload of a model others use, or the operator runs.
        What :func:`model_in_use` and :func:`_stopped` raise (503...).
    """
    name, backend = use.name, use.backend
    board = backend.board if backend is not None else None
    default = board.keep_alive if board is not None else request.app[SETTINGS].keep_alive_seconds()
    unload = (default if keep_alive is None else keep_alive) == 0
    key = call.key
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
        await _stopped(request, board, name)
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


async def _stopped(request: web.Request, board: Any, name: str) -> None:
    """Return once ``board``'s model (its keep_alive just ended) is unloaded or asleep, as Ollama's
    ``stop`` returns once the runner is gone: its supervisor is asked to look now (``StatusBoard.hurry``),
    not at its next health check, and each of its announcements is awaited.

    Raises:
        ModelInUse: a request used the model meanwhile (its keep_alive renewed): it stays loaded, and
            the stop says so instead of returning as if it had stopped.
        UpstreamUnavailable: it did not stop within ``--load-timeout``.
    """
    asked = time.time()
    timeout = request.app[SETTINGS].load_timeout
    deadline = time.monotonic() + timeout
    board.hurry()
    while board.state in (State.READY, State.STOPPING):
        if board.expires_at > asked or board.in_flight:
            raise ModelInUse(f"model '{name}' was used by another request while stopping: it stays loaded "
                             f"(stop it again once that request ends)")
        left = deadline - time.monotonic()
        if left <= 0:
            raise UpstreamUnavailable(f"model '{name}' did not stop within --load-timeout ({timeout:g} s)")
        news = board.news(request.app[WORKER])
        try:
            await asyncio.wait_for(news, left)
        except TimeoutError:
            pass
        finally:
            news.cancel()
    log.info("stopped_for_client", model=name, seconds=round(time.time() - asked, 3))


@asynccontextmanager
async def model_in_use(request: web.Request, backend: Backend, keep_alive: float | None) -> AsyncIterator[None]:
    """Hold ``backend``'s model for one request: loaded, counted in flight, keep-alive renewed.

    When vllama runs the model: a sleeping or unloaded one is woken or started (bounded
    by ``--load-timeout``, while idle models make room), the request counts as in flight
    (so the model is neither put to sleep nor evicted under it), and its keep_alive
    (Ollama's, in seconds, as the request's typed body holds it: ``api/ollama/types.py``; ``None``: the
    model's default; negative forever) counts from the
    start and again from the end of the request. With ``--upstream`` it does nothing.

    Raises:
        UpstreamUnavailable: the model is starting at launch (503 "loading"), failed, or
            could not be brought back in time.
    """
    board = backend.board
    if board is None:
        yield
        return
    seconds = board.keep_alive if keep_alive is None else keep_alive
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
