"""``HEAD``/``POST /api/blobs/sha256:<hex>``: Ollama's blob upload, kept by ``models/blobs.py``.

As Ollama's ``server/routes.go`` HeadBlobHandler/CreateBlobHandler: HEAD answers 200 when the
blob exists, 404 when not; POST stores the body, 201 (200 when it was there already), 400 when
the body's sha256 is not the digest named. vllama adds a size limit (``--max-blob-size``, 413)
and a free-disk check (507).
"""

from __future__ import annotations

from aiohttp import web

from vllama_proxy.errors import MethodNotAllowed
from ..app_state import BLOBS


async def blob(request: web.Request) -> web.Response:
    """See the module docstring."""
    store = request.app[BLOBS]
    digest = request.match_info["digest"]
    if request.method == "HEAD":
        return web.Response(status=200 if store.exists(digest) else 404)
    if request.method != "POST":
        raise MethodNotAllowed(f"method {request.method} is not allowed on /api/blobs (HEAD or POST)")
    made = await store.write(digest, request.content.iter_chunked(1 << 20), request.content_length)
    return web.Response(status=201 if made else 200)
