"""The one error tree of vllama, and its one mapping onto Ollama's error shape.

Every failure a client can see is one of these exceptions, raised where it is
detected and turned into Ollama's ``{"error": "..."}`` in exactly one place
(:func:`error_response` before streaming, :func:`error_line` after it began).
aiohttp client errors are translated into this tree at the upstream-client
boundary (``upstream.py``), never in handlers.

    VllamaError                       500 (never raised bare for a client mistake)
    ├── BadRequest                    400  malformed JSON, wrong field types, bad values
    │   ├── MissingBody               400  "missing request body"
    │   └── UnsupportedCapability     400  '"X" does not support tools'
    ├── ModelNotFound                 404  "model 'X' not found"
    ├── NotSupported                  501  model management vllama leaves to vLLM
    ├── RequestTooLarge               413
    ├── ModelTooLarge                 507  the model does not fit in its GPUs' memory (fit check)
    └── UpstreamError                 the vLLM side failed
        ├── UpstreamRejected          vLLM's own 4xx, passed on with vLLM's status/message
        ├── UpstreamUnavailable       503  refused/reset connection, vLLM starting or gone
        │   └── ModelLoading          503 + Retry-After  the model is loading: retrying will help
        ├── UpstreamTimeout           504  no byte from vLLM within the idle-read timeout
        └── UpstreamProtocolError     502  vLLM answered something we cannot parse

Source of the shapes: ``shared/ollama-api.md`` "Errors" (Ollama ``server/routes.go``):
non-streaming errors are ``application/json`` ``{"error": msg}`` with the status;
once a stream started the status stays 200 and the last NDJSON line is ``{"error": msg}``.
"""

from __future__ import annotations

import orjson
from aiohttp import web


class VllamaError(Exception):
    """Base of every error vllama reports to a client.

    Attributes:
        status: HTTP status used when the error happens before a response began.
        message: the text put in Ollama's ``{"error": ...}``.
    """

    status = 500

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(VllamaError):
    """A client mistake: bad JSON, wrong types, invalid combinations (400)."""

    status = 400


class MissingBody(BadRequest):
    """An empty request body (Ollama: 400 ``missing request body``)."""

    def __init__(self) -> None:
        super().__init__("missing request body")


class UnsupportedCapability(BadRequest):
    """The model lacks a capability the request needs (Ollama: ``"X" does not support tools``)."""

    def __init__(self, model: str, capability: str) -> None:
        super().__init__(f'"{model}" does not support {capability}')


class ModelNotFound(VllamaError):
    """The requested model is neither served nor an alias (Ollama: 404 ``model 'X' not found``).

    ``detail``, when given, follows after a colon: what is close, what to name instead.
    """

    status = 404

    def __init__(self, model: str, detail: str | None = None) -> None:
        super().__init__(f"model '{model}' not found" + (f": {detail}" if detail else ""))
        self.model = model


class NotSupported(VllamaError):
    """An Ollama endpoint vllama deliberately leaves to vLLM's own model management (501)."""

    status = 501


class RequestTooLarge(VllamaError):
    """The request body is over the configured limit (413)."""

    status = 413


class ModelTooLarge(VllamaError):
    """The model cannot be loaded: its estimated weights, KV cache and overhead do not fit in the
    memory of its GPUs even after idle models are unloaded (``models/fit.py``).

    Ollama answers 500 ``model requires more system memory (X GiB) than is available (Y GiB)``;
    vllama keeps 500 for its own faults (this is neither a bug nor a client mistake: the request
    is valid, the server lacks room) and answers 507 Insufficient Storage (RFC 4918 §11.5: the
    server "is unable to store the representation needed to complete the request"), a server-side
    status that, unlike 503, does not invite a retry of the same request.
    """

    status = 507


class UpstreamError(VllamaError):
    """vLLM, the upstream, failed; subclasses say how."""

    status = 502


class UpstreamRejected(UpstreamError):
    """vLLM answered the request with an error status; its status and message are passed on.

    vLLM's 400s (prompt longer than the context, invalid JSON schema, ...) are client
    mistakes and stay 400; vLLM's 5xx stay 5xx.
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message, status=status)


class UpstreamUnavailable(UpstreamError):
    """vLLM cannot be reached: refused, reset, closed mid-answer, or still starting (503)."""

    status = 503


class ModelLoading(UpstreamUnavailable):
    """The model is loading (starting, restarting, waking): 503 with ``Retry-After``, the HTTP way
    (RFC 9110 §10.2.3) to say that retrying helps. A 503 without it (a model that failed to load)
    is final: ``vllama run`` stops waiting at once (issue 26.2)."""

    retry_after = 1


class SlotsFull(UpstreamUnavailable):
    """Every on-demand slot holds a model that is loaded, loading or in use (503; ``supervisor/slots.py``)."""


class UpstreamTimeout(UpstreamError):
    """vLLM sent nothing within the idle-read timeout (504)."""

    status = 504


class UpstreamProtocolError(UpstreamError):
    """vLLM answered with bytes we cannot read as its OpenAI protocol (502)."""

    status = 502


def error_body(message: str) -> bytes:
    """Ollama's error object as bytes: ``{"error": message}`` (no trailing newline)."""
    return orjson.dumps({"error": message})


def error_response(exc: VllamaError, headers: dict[str, str] | None = None) -> web.Response:
    """The non-streaming answer for ``exc``: its status and ``{"error": exc.message}`` (and
    ``Retry-After`` for :class:`ModelLoading`)."""
    if isinstance(exc, ModelLoading):
        headers = {"Retry-After": str(exc.retry_after), **(headers or {})}
    return web.Response(
        status=exc.status,
        body=error_body(exc.message),
        content_type="application/json",
        headers=headers,
    )


def error_line(exc: VllamaError) -> bytes:
    """The last NDJSON line of a stream that failed after it began (status stays 200)."""
    return error_body(exc.message) + b"\n"


class Unauthorized(VllamaError):
    """No key, or a key this server does not know (401, ``WWW-Authenticate: Bearer``)."""

    status = 401
    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(VllamaError):
    """A known key whose role may not do this (403); the message names what and which role may."""

    status = 403


class TooManyRequests(VllamaError):
    """A key over its own limit (``max_in_flight``): 429 with ``Retry-After`` seconds."""

    status = 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}
