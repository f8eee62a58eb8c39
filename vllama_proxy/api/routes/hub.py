"""``POST /api/pull`` and ``DELETE /api/delete`` for Hugging Face models (the work is in ``models/hub.py``).

A served model pulls at once (clients pull before they chat) and cannot be deleted. Any
other ``org/name[:revision]`` is downloaded into the Hugging Face cache, where vLLM finds it
(``vllama serve --model org/name``), or removed from it. An Ollama library name
(``qwen2.5:0.5b``, ``llama3.2``) means the repo vLLM's library table maps it to
(``models/library.py``); any other name is a 404 naming the closest library names. With
``--upstream`` a model the vLLM does not serve is refused before any download (501): vllama
could never start it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from contextlib import aclosing

import orjson
from aiohttp import web

from vllama_proxy.errors import (
    BadRequest,
    ModelInUse,
    ModelNotFound,
    NotSupported,
    StorageFailed,
    UpstreamError,
    VllamaError,
    error_line,
)
from vllama_proxy.logs import get_logger
from vllama_proxy.models import hub
from vllama_proxy.models.catalog import strip_latest
from vllama_proxy.models.local import uploaded_dir
from vllama_proxy.models.pull_room import PullLimits
from vllama_proxy.supervisor.states import State

from ..app_state import CATALOG, SETTINGS, WORKER
from ..ollama.types import ModelRef
from ..request.call import call_of
from ..ollama.ndjson import NDJSON
from .body import read_request
from .create import unload_adapter
from .model_use import require_model

log = get_logger("vllama.routes")


async def pull(request: web.Request) -> web.StreamResponse:
    """Ollama's pull: NDJSON progress ending ``{"status": "success"}``, or that one object with ``stream: false``.

    The stream starts once the repository's manifest is known, so an unknown, gated or
    unreachable repository is still a plain HTTP error; later failures are the stream's last
    line, ``{"error": ...}``.
    """
    req = await read_request(request, ModelRef)
    name = require_model(req.ref)
    if await _served(request, name, strict=False) is not None:
        return _success(req.stream)  # served (or pulled) already
    model = hub.parse_model(name) or await _from_library(request, name)
    settings = request.app[SETTINGS]
    upstream = settings.upstream_url
    if upstream:  # vllama starts no model in this mode: the download could never serve
        raise NotSupported(f"model '{name}' is not served by the vLLM at {upstream}, and vllama serve --upstream "
                           f"cannot start models: pulling it would not make it runnable (serve it with vllama serve "
                           f"--model {name}, or start that vLLM with it)")
    limits = PullLimits(settings.state_dir / "pulls", settings.max_pulls, settings.cache_quota)
    async with aclosing(hub.pull(model, limits)) as events:
        if req.stream is False:
            async for _ in events:
                pass
            return _success(False)
        out: web.StreamResponse | None = None
        held: list[bytes] = []
        try:
            async for event in events:
                line = orjson.dumps(event) + b"\n"
                if out is not None:
                    await out.write(line)
                elif event["status"] == hub.MANIFEST:
                    held.append(line)
                else:
                    out = web.StreamResponse(headers={"Content-Type": NDJSON})
                    await out.prepare(request)
                    await out.write(b"".join(held) + line)
        except VllamaError as e:
            if out is None:
                raise
            call_of(request).stream_error = e
            await out.write_eof(error_line(e))
            return out
    if out is None:  # cannot happen: the last event is "success", after the manifest
        return _success(True)
    await out.write_eof()
    return out


async def delete(request: web.Request) -> web.Response:
    """Ollama's delete: 200 with an empty body; 404 ``model 'X' not found``; 400 for a model in use.

    An alias made with ``/api/copy`` is removed (the model it names stays), as deleting
    a copy in Ollama leaves the original. A model made with ``/api/create`` is removed with what
    was uploaded for it (its LoRA adapter is unloaded from the running vLLM), unless a copy of it
    still uses them. A pulled model no one uses is removed from the
    cache (``ollama rm``); a model being served (configured, or an on-demand model loaded,
    loading or wanted) is refused, by any name and whatever ``:revision`` is named: its
    repo's weights must stay under it. An on-demand model held under the name asked for is
    unloaded first (:func:`_unload_held`), as ``ollama rm`` stops a running model before deleting it
    (Ollama ``cmd/cmd.go`` DeleteHandler): once deleted it is gone from ``/api/ps`` and no longer served.
    """
    req = await read_request(request, ModelRef)
    name = require_model(req.ref)
    catalog = request.app[CATALOG]
    await _unload_held(request, strip_latest(name))
    made = catalog.created(name)
    shared = made is not None and any(  # a copy (/api/copy) shares its adapter and uploaded files
        m.adapters.keys() & made.adapters.keys() or m.base == made.base == strip_latest(made.name)
        for m in catalog.created_models() if m.name.casefold() != made.name.casefold())
    if made is not None and made.adapters and not shared:
        await unload_adapter(request, made)
    try:  # a model made with /api/create: its name and layers go, its base stays
        if await asyncio.to_thread(catalog.created_store.remove, name):
            for kind in ("models", "adapters") if not shared else ():  # what was uploaded for it, if any (the blobs stay)
                await asyncio.to_thread(shutil.rmtree, uploaded_dir(request.app[SETTINGS].state_dir / kind, strip_latest(name)), True)
            if catalog.on_demand is not None:
                await catalog.on_demand.local(fresh=True)
            return web.Response(status=200)
    except OSError as e:
        raise StorageFailed(f"cannot remove the model from {catalog.created_store.path}: {e.strerror or e} (see --state-dir)") from None
    try:
        if await asyncio.to_thread(catalog.store.remove, strip_latest(name)):
            return web.Response(status=200)
    except OSError as e:
        raise StorageFailed(f"cannot remove the alias from {catalog.store.path}: {e.strerror or e} (see --state-dir)") from None
    serving = await _serving(request, name)
    if serving is not None:
        raise ModelInUse(f"model '{name}' is in use: it is being served")
    model = hub.parse_model(name) or await _from_library(request, name)
    await asyncio.to_thread(hub.delete, model, name)
    if catalog.on_demand is not None:
        await catalog.on_demand.local(fresh=True)  # /api/tags lists it no longer (the scan is cached for a while)
    return web.Response(status=200)


async def _unload_held(request: web.Request, name: str) -> None:
    """Unload the on-demand model a slot holds under served name ``name`` (no-op when none does) and
    return once its supervisor reports it stopped and the slot is emptied (``SlotTable.vacate``: the name is no
    longer listed nor found there), within ``--load-timeout``.

    Raises:
        ModelInUse: requests are using, waiting for or loading it (400 naming them): they are not cut off;
            or it did not stop within ``--load-timeout``.
    """
    on_demand = request.app[CATALOG].on_demand
    if on_demand is None:
        return
    slots = on_demand.slots
    timeout = request.app[SETTINGS].load_timeout
    deadline = time.monotonic() + timeout
    while True:
        i = slots.find(name)
        if i is None or slots.vacate(name):
            return
        board = slots.boards[i]
        if board.in_use or board.loading:
            raise ModelInUse(f"model '{name}' is in use: {board.in_flight} request(s) running, {board.waiters} waiting "
                             f"for it{' (loading)' if board.loading else ''}; delete it once they finish (vllama ps)")
        if time.monotonic() > deadline:
            raise ModelInUse(f"model '{name}' did not stop within --load-timeout ({timeout:g} s): not deleted")
        if board.state is State.READY:
            board.expire()  # its keep_alive ends now; its supervisor stops it (or puts it to sleep, then stops it)
        board.request_release()
        log.info("delete_unloads", model=name, slot=i)
        await slots.changed(request.app[WORKER], deadline - time.monotonic())


async def _serving(request: web.Request, name: str) -> str | None:
    """The served name of a model ``name`` refers to that is being served now (a configured model, or
    an on-demand one that a slot holds loaded, loading or in use), by name, alias or its repo (with
    or without a revision); ``None`` when none. An unreachable ``--upstream`` vLLM is an error."""
    catalog = request.app[CATALOG]
    on_demand = catalog.on_demand
    try:
        model = await catalog.resolve(name)  # a lookup: loads nothing
    except ModelNotFound:
        model = None
    if model is not None and (catalog.is_configured(model) or (on_demand is not None and on_demand.serving(model.name, model.root))):
        return model.name
    try:
        repo = hub.parse_model(name)
    except BadRequest:
        repo = None
    if repo is None and model is not None:
        repo = hub.HubModel(model.root, None) if "/" in model.root and not model.root.startswith("/") else None
    if repo is None:
        return None
    wanted = repo.repo_id.casefold()
    for m in await catalog.models():
        if m.root.casefold() == wanted and (catalog.is_configured(m) or (on_demand is not None and on_demand.serving(m.name, m.root))):
            return m.name
    return None


async def _from_library(request: web.Request, name: str) -> hub.HubModel:
    """The Hugging Face repo a library name (``qwen2.5:0.5b``) maps to.

    Raises:
        ModelNotFound: not a library name: 404 naming the closest ones and how to name a Hub model.
    """
    catalog = request.app[CATALOG]
    if catalog.library is None:
        raise ModelNotFound(name)
    try:
        entry = catalog.library.resolve(name)
    except ModelNotFound as e:
        try:  # the advice names the closest served names too
            served = {m.name: m for m in await catalog.models()}
        except UpstreamError:
            raise e from None
        raise catalog.not_found(name, served) from None
    return hub.HubModel(entry.repo, None if entry.revision == "main" else entry.revision)


async def _served(request: web.Request, name: str, *, strict: bool) -> str | None:
    """The served name ``name`` refers to: by Ollama name or alias, or (a hub id without a
    revision) by the hub id vLLM loaded it from. ``strict``: an unreachable vLLM is an error,
    else it counts as serving nothing."""
    catalog = request.app[CATALOG]
    try:
        try:
            model = hub.parse_model(name)
        except BadRequest:
            return None
        if model is None:  # an Ollama or library name (a hub id never counts by alias)
            try:
                return (await catalog.resolve(name)).name
            except ModelNotFound:
                return None
        if model.revision is None:
            wanted = model.repo_id.casefold()
            return next((m.name for m in await catalog.models() if m.root.casefold() == wanted), None)
    except UpstreamError:
        if strict:
            raise
    return None


def _success(stream: bool | None) -> web.Response:
    if stream is False:
        return web.json_response({"status": "success"})
    return web.Response(body=orjson.dumps({"status": "success"}) + b"\n", content_type=NDJSON)
