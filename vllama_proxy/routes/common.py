"""Small helpers the handlers share: body parsing, model resolution, load/unload replies."""

from __future__ import annotations

import time
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel

from ..catalog import ServedModel
from ..errors import BadRequest
from ..logs import get_logger
from ..ollama_types import parse_body, parse_keep_alive, require_model
from ..state import CATALOG, SETTINGS, STATUS
from ..stream import CLOCK

log = get_logger("vllama.routes")

M = TypeVar("M", bound=BaseModel)


async def read_body(request: web.Request) -> bytes:
    """The raw request body.

    Raises:
        BadRequest: it cannot be read as sent (e.g. ``Content-Encoding: gzip`` on a body that is not gzip).
    """
    try:
        return await request.read()
    except RequestPayloadError as e:
        raise BadRequest(f"cannot read the request body: {e}") from None


async def read_request(request: web.Request, cls: type[M]) -> M:
    """The request body parsed into ``cls`` (see ``ollama_types.parse_body`` for the errors raised)."""
    return parse_body(await read_body(request), cls)


async def resolve_model(request: web.Request, name: str | None) -> tuple[str, ServedModel]:
    """``(name as sent, served model)``; raises ``BadRequest`` if missing, ``ModelNotFound`` if unknown."""
    name = require_model(name)
    return name, await request.app[CATALOG].resolve(name)


async def load_reply(request: web.Request, name: str, keep_alive: Any, *, chat: bool) -> web.Response:
    """Ollama's answer to an empty prompt / no messages: the model is (un)loaded, nothing generated.

    ``done_reason`` is ``load`` (a sleeping or unloaded model is brought back first), or
    ``unload`` when ``keep_alive`` is 0: the keep-alive ends now and the supervisor puts
    vLLM to sleep or stops it at its next check (Ollama ``server/routes.go``
    GenerateHandler/ChatHandler).
    """
    settings = request.app[SETTINGS]
    unload = parse_keep_alive(keep_alive, default=settings.keep_alive_seconds()) == 0
    status = request.app.get(STATUS)
    if unload and status is not None:
        status.touch(0)
    elif not unload:
        await use_model(request, keep_alive)
    body: dict[str, Any] = {"model": name, "created_at": CLOCK.now()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    body.update(done=True, done_reason="unload" if unload else "load")
    return web.json_response(body, dumps=_dumps)


async def use_model(request: web.Request, keep_alive: Any) -> float:
    """keep_alive bookkeeping when vllama supervises vLLM: wake a sleeping or unloaded
    model (bounded by ``--load-timeout``) and restart its keep-alive clock.

    Returns the request's keep_alive in seconds (negative: forever), for :func:`done_with_model`.

    Raises:
        UpstreamUnavailable: the model could not be brought back in time.
    """
    settings = request.app[SETTINGS]
    seconds = parse_keep_alive(keep_alive, default=settings.keep_alive_seconds())
    status = request.app.get(STATUS)
    if status is not None:
        await status.wait_ready(settings.load_timeout)
        status.touch(seconds)
    return seconds


def done_with_model(request: web.Request, seconds: float) -> None:
    """The request finished: the keep-alive counts from now (Ollama sets expiry after each request)."""
    status = request.app.get(STATUS)
    if status is not None:
        status.touch(seconds)


def log_ignored(ignored: list[str]) -> None:
    """Ollama-only options have no vLLM meaning: note them once per request at debug level."""
    if ignored:
        log.debug("options_ignored", options=ignored)


def now_ns() -> int:
    """Monotonic nanoseconds, the base of every Ollama duration."""
    return time.perf_counter_ns()


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()
