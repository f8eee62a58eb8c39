"""structlog set-up: console lines on a TTY, JSON lines otherwise, ``request_id`` per request.

Request-scoped fields are bound with ``structlog.contextvars`` by the request
middleware, so every log line written while a request is handled carries its
``request_id`` without passing loggers around.
"""

from __future__ import annotations

import json
import logging
import sys

import orjson
import structlog


def configure_logging(level: str = "INFO", fmt: str = "auto") -> None:
    """Configure structlog and the stdlib root logger (aiohttp logs through it).

    Args:
        level: ``DEBUG``/``INFO``/``WARNING``/``ERROR``.
        fmt: ``console``, ``json``, or ``auto`` (console when stderr is a TTY).
    """
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if use_json:
        renderer = structlog.processors.JSONRenderer(serializer=_dumps)
        final = [structlog.processors.dict_tracebacks, renderer]
    else:
        final = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    numeric = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[*shared, *final],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # WriteLogger writes a line and its newline in one write (PrintLogger's print() made two system
        # calls per line on an unbuffered stderr: the access log's line on every request)
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Route stdlib logging (aiohttp, asyncio) through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final], foreign_pre_chain=shared)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # aiohttp's own access log is replaced by ours (one line per request, with request_id).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # huggingface_hub's one line per Hub request


def _dumps(obj: object, **_: object) -> str:
    # orjson is fast but refuses lone surrogates (undecodable bytes from a client);
    # the stdlib escapes them, so one odd header can never break logging.
    try:
        return orjson.dumps(obj, default=str).decode()
    except TypeError:
        return json.dumps(obj, default=str)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A structlog logger tagged with ``component=name``."""
    return structlog.get_logger(component=name)
