"""Ollama's model management beyond pull, delete and create: copy makes an alias; push is 501.

``POST /api/copy`` gives a served model another name, kept in the alias store
(``models/aliases.py``) so every worker and later runs know it; ``DELETE /api/delete`` of
that name removes it again (``routes/hub.py``). A copy of a model made with ``/api/create`` is
another such model, with the same layers. Push answers 501 naming what is served and how to
serve something else. Pull and delete (Hugging Face Hub cache) live in ``routes/hub.py``,
create and blobs in ``routes/create.py`` and ``routes/blobs.py``.
"""

from __future__ import annotations

import asyncio
import re

from aiohttp import web

from vllama_proxy.errors import BadRequest, ModelNotFound, NotSupported, StorageFailed, UpstreamError
from vllama_proxy.models import hub
from vllama_proxy.models.catalog import strip_latest
from .body import read_request
from .model_use import where_models_change
from ..ollama.types import CopyRequest
from ..app_state import CATALOG, SETTINGS

#: Ollama's model name shape: ``[host/][namespace/]model[:tag]``, letters, digits, ``._-``.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*){0,2}(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?")


async def served_list(request: web.Request) -> str:
    """The Ollama names of every served model, comma-separated (for error messages)."""
    try:
        names = [n for m in await request.app[CATALOG].models() for n in request.app[CATALOG].names_for(m)]
    except UpstreamError:
        names = []
    return ", ".join(names) or "nothing yet"


async def copy(request: web.Request) -> web.Response:
    """Ollama's copy: ``{"source", "destination"}`` -> 200, empty body; ``destination`` becomes an alias.

    Errors as Ollama's ``server/routes.go`` CopyHandler: 400 ``source and destination are
    required``, 400 ``destination "X" is invalid``, 404 ``model 'X' not found``. A name that
    is already a served model or a configured alias is not replaced (400).
    """
    req = await read_request(request, CopyRequest)
    source, destination = (req.source or "").strip(), (req.destination or "").strip()
    if not source or not destination:
        raise BadRequest("source and destination are required")
    if len(destination) > 256 or not _NAME.fullmatch(destination):
        raise BadRequest(f'destination "{destination}" is invalid')
    catalog = request.app[CATALOG]
    _not_a_pullable_name(request, destination)
    made = catalog.created(source)
    if made is not None:  # a model made with /api/create: the copy is one too, with the same layers
        if catalog.is_served_name(destination):
            raise BadRequest(f"'{destination}' is a served model or an alias; choose another name")
        copied = made.model_copy(update={"name": strip_latest(destination)})
        try:
            await asyncio.to_thread(catalog.created_store.put, copied)
        except OSError as e:
            raise StorageFailed(f"cannot save the model in {catalog.created_store.path}: {e.strerror or e} (see --state-dir)") from None
        return web.Response(status=200)
    model = await catalog.resolve(source)  # a lookup: loads nothing
    try:
        existing = await catalog.resolve(destination)
    except ModelNotFound:
        existing = None
    if strip_latest(destination).casefold() == model.name.casefold():
        return web.Response(status=200)  # its own served name: nothing to add
    if existing is not None and existing.name != model.name:
        if strip_latest(destination).casefold() == existing.name.casefold():
            raise BadRequest(f"'{destination}' is a served model; choose another name")
        if catalog.is_configured_alias(destination):
            raise BadRequest(f"'{destination}' is an alias in vllama's configuration; choose another name")
    limit = request.app[SETTINGS].max_aliases
    if catalog.store.lookup(strip_latest(destination)) is None and len(catalog.store.current()) >= limit:
        raise BadRequest(f"too many aliases: this server keeps at most {limit} (--max-aliases); delete one first")
    try:
        await asyncio.to_thread(catalog.store.set, strip_latest(destination), model.name)
    except OSError as e:
        raise StorageFailed(f"cannot save the alias in {catalog.store.path}: {e.strerror or e} (see --state-dir)") from None
    return web.Response(status=200)


def _not_a_pullable_name(request: web.Request, destination: str) -> None:
    """An alias must not take a name a pull would fetch: a Hugging Face id (``org/name``) or a
    library name, when pulled models are served on demand. Else a later ``pull`` of that name
    serves the alias's model instead (an alias redirected another user's pull).

    Raises:
        BadRequest: the destination is such a name.
    """
    if request.app[CATALOG].on_demand is None:
        return  # pulled models are never served by name: a pull of it serves nothing either
    try:
        repo = hub.parse_model(destination)
    except BadRequest:
        repo = None
    if repo is not None or destination.count("/") == 1:
        raise BadRequest(f"'{destination}' has the form of a Hugging Face id (org/name), which a pull would fetch; "
                         "choose a name without '/'")
    library = request.app[CATALOG].library
    if library is None or destination.strip() not in library:
        return
    try:
        library.resolve(destination.strip())
    except ModelNotFound:
        return  # a known name with a tag the library lacks (llama3:backup) pulls nothing
    raise BadRequest(f"'{destination}' is a name of vllama's library, which a pull would fetch; choose another name")


#: What each unsupported route would have done, in Ollama's words.
_UNSUPPORTED = {
    "push": "push models to a registry",
    "create": "create models from a Modelfile",
    "blobs": "store blobs (they are the layers `ollama create` builds models from)",
}


async def unsupported(request: web.Request) -> web.Response:
    """push, create, blobs: 501 with what is served and how to change it (in ``--upstream``
    mode: on the upstream server, not with ``--model``)."""
    what = request.path.removeprefix("/api/").split("/")[0]
    raise NotSupported(
        f"vllama does not {_UNSUPPORTED.get(what, what)}: vLLM serves {await served_list(request)}; "
        f"{where_models_change(request)}."
    )
