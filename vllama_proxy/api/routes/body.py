"""The request body of the Ollama routes as its ``api/ollama/types.py`` model (the gate's, ``request/gate.py``, for the
inference routes; parsed here for the others), and the Ollama options it carries that vLLM will not see, noted.
The body itself is read by ``api/request/body_reader.py``."""

from __future__ import annotations

from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel

from vllama_proxy.logs import get_logger

from ..request.call import call_of
from ..ollama.types import parse_body
from ..request.body_reader import read_body

log = get_logger("vllama.routes")

M = TypeVar("M", bound=BaseModel)


async def read_request(request: web.Request, cls: type[M]) -> M:
    """The request body parsed into ``cls``: the gate's parse when it made one (``request/gate.py``, for the
    inference routes), else parsed now (see ``api/ollama/types.py``'s ``parse_body`` for the errors raised)."""
    typed = call_of(request).typed
    if isinstance(typed, cls):
        return typed
    return parse_body(await read_body(request), cls)


def log_ignored(ignored: list[str]) -> None:
    """Ollama-only options have no vLLM meaning: note them once per request at debug level."""
    if ignored:
        log.debug("options_ignored", options=ignored)
