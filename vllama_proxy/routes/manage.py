"""Ollama's model management routes vllama does not offer: push, create, copy, blobs.

Each answers 501 naming what is served and how to serve something else. Pull and
delete (Hugging Face Hub cache) live in ``routes/hub.py``.
"""

from __future__ import annotations

from aiohttp import web

from ..errors import NotSupported, UpstreamError
from ..state import CATALOG


async def served_list(request: web.Request) -> str:
    """The Ollama names of every served model, comma-separated (for error messages)."""
    try:
        names = [n for m in await request.app[CATALOG].models() for n in request.app[CATALOG].names_for(m)]
    except UpstreamError:
        names = []
    return ", ".join(names) or "nothing yet"


async def unsupported(request: web.Request) -> web.Response:
    """push, create, copy, blobs: 501 with what vllama serves instead."""
    what = request.path.removeprefix("/api/").split("/")[0]
    raise NotSupported(
        f"vllama does not {what} models: vLLM serves {await served_list(request)}. "
        "Change the served model with `vllama serve --model M` (see README)."
    )
