"""Ollama's model management routes: vLLM serves a fixed set of models, so these say so.

``/api/pull`` of a model that is already served answers success (clients pull
before they chat); everything else gets a clear error naming what is served and
how to serve something else.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from ..errors import ModelNotFound, NotSupported
from ..ollama_types import ModelRef
from ..state import CATALOG
from .common import read_request, resolve_model


async def _served_list(request: web.Request) -> str:
    names = [n for m in await request.app[CATALOG].models() for n in request.app[CATALOG].names_for(m)]
    return ", ".join(names) or "nothing yet"


async def pull(request: web.Request) -> web.Response:
    """Success for a served model (NDJSON ``{"status": "success"}`` when streaming); else 404 with advice."""
    req = await read_request(request, ModelRef)
    try:
        await resolve_model(request, req.ref)
    except ModelNotFound:
        raise NotSupported(
            f"vllama cannot pull '{req.ref}': it serves {await _served_list(request)} through vLLM. "
            f"Start vllama with --model {req.ref} to serve it.",
            status=404,
        ) from None
    if req.stream is False:
        return web.json_response({"status": "success"})
    return web.Response(body=orjson.dumps({"status": "success"}) + b"\n", content_type="application/x-ndjson")


async def unsupported(request: web.Request) -> web.Response:
    """push, create, copy, delete, blobs: 501 with what vllama serves instead."""
    what = request.path.removeprefix("/api/").split("/")[0]
    raise NotSupported(
        f"vllama does not {what} models: vLLM serves {await _served_list(request)}. "
        "Change the served model with `vllama serve --model M` (see README)."
    )
