"""The one error tree of vllama, and its one mapping onto the error shape of each route family.

Invariant: every failure a client sees is one of these classes, raised where it is detected
without a status, and turned into its route family's body (:func:`shape_of`: Ollama's, OpenAI's
or Anthropic's) in one place: the middleware of ``api/app.py`` (:func:`error_response`;
``api/request/admission.py`` answers :class:`ServerBusy` through it directly), or
:func:`error_line` / :func:`error_event` once a stream began. Each class carries its HTTP status
(and any headers) as class attributes; only :class:`UpstreamRejected` takes vLLM's. Lower-layer
errors are translated at their boundary (``upstream/mapping.py``, ``models/hub.py`` ``hub_error``).
The tree with every status: ``docs/api.md`` "Every error and its status"; the shapes: its "Errors".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import orjson
from aiohttp import web


class VllamaError(Exception):
    """Base of every error vllama reports to a client.

    Attributes:
        status: HTTP status used when the error happens before a response began (a class
            attribute of each class of the tree).
        headers: extra response headers (``Retry-After``, ``WWW-Authenticate``).
        code: OpenAI's string ``code`` for this error, where OpenAI's API has one (a class
            attribute); ``None``: the status is the code (vLLM's way).
        message: the text put in the error body (Ollama's ``{"error": ...}``, OpenAI's and
            Anthropic's ``message``).
        param: the request field at fault, where the raise site knows it (OpenAI's ``param``).
    """

    status: int = 500
    headers: ClassVar[Mapping[str, str]] = {}
    code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


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


class ModelInUse(BadRequest):
    """``/api/delete`` of a model that is being served or used (its weights must stay under it), or a stop
    (``keep_alive: 0``) that another request overtook (the model stays loaded): 400."""


class TooManyChoices(BadRequest):
    """A non-admin key's ``/v1`` request asks vLLM for more sequences at once (``n`` x its prompts) than
    ``--max-choices``: it would take that many of vLLM's running slots as one request of its share (400)."""


class TooManyInputs(BadRequest):
    """A non-admin key's embeddings, rerank or score request sends vLLM more inputs than ``--max-inputs``
    (``api/request/bodies.py``): each is a sequence of vLLM's scheduler, while the request counts once in the
    admission bound and the key's share (400)."""


class FormNotAccepted(BadRequest):
    """A ``multipart/form-data`` body on a relayed ``/v1`` route that takes JSON (only the audio routes take a
    form): vllama reads a form for its ``model`` only, so its other fields would pass every check unread (415)."""

    status = 415


class Unauthorized(VllamaError):
    """No key, or a key this server does not know (401, ``WWW-Authenticate: Bearer``)."""

    status = 401
    headers: ClassVar[Mapping[str, str]] = {"WWW-Authenticate": "Bearer"}
    code = "invalid_api_key"


class Forbidden(VllamaError):
    """A known key whose role may not do this (403); the message names what and which role may."""

    status = 403


class SignInFailed(Unauthorized):
    """An OpenID Connect sign-in to ``/admin`` that did not complete: the provider refused it, its state was stale
    or foreign, its ID token did not verify (401; ``api/routes/admin_oidc.py``)."""


class SignInNotAdmin(Forbidden):
    """An OpenID Connect sign-in whose role claim does not make its holder an admin of the page (403)."""


class SignInProviderFailed(VllamaError):
    """The OpenID Connect provider could not be reached or answered amiss (502)."""

    status = 502


class ModelNotAllowed(Forbidden):
    """A local model the on-demand allow-list (``--on-demand-models``) does not admit (403)."""


class ModelNotFound(VllamaError):
    """The requested model is neither served nor an alias (Ollama: 404 ``model 'X' not found``).

    ``detail``, when given, follows after a colon: what is close, what to name instead.
    """

    status = 404
    code = "model_not_found"

    def __init__(self, model: str, detail: str | None = None) -> None:
        super().__init__(f"model '{model}' not found" + (f": {detail}" if detail else ""), param="model")
        self.model = model


class NoSuchModel(ModelNotFound):
    """A ``/v1`` request names a model none of the vLLM servers serves (404), in vLLM's own words,
    ``The model `X` does not exist.`` (``vllm/entrypoints/openai/models/serving.py``): what one vLLM
    answers itself when vllama relays to it unresolved (``api/routes/openai.py``)."""

    def __init__(self, model: str) -> None:
        VllamaError.__init__(self, f"The model `{model}` does not exist.", param="model")
        self.model = model


class KeyNotFound(VllamaError):
    """The admin API names a key that is not minted, or was revoked (404, ``api/routes/keys.py``)."""

    status = 404


class KeyNameTaken(VllamaError):
    """The admin API would mint a key under a name already taken, or change a key from the keys file, which
    only the file changes (409, ``api/routes/keys.py``)."""

    status = 409


class MethodNotAllowed(VllamaError):
    """A method the route does not take (405), e.g. ``GET /api/blobs/...``."""

    status = 405


class BodyTimeout(VllamaError):
    """The request body did not arrive within ``--body-timeout`` (408; the connection is closed after)."""

    status = 408


class RequestTooLarge(VllamaError):
    """The request body is over the configured limit (413)."""

    status = 413


class TooManyRequests(VllamaError):
    """A key over its own limit (``max_in_flight``): 429 with ``Retry-After`` seconds."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}


class TooManyPulls(TooManyRequests):
    """``--max-pulls`` pulls are running over the server (429, ``Retry-After: 30``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=30)


class RateLimited(TooManyRequests):
    """A key over its ``rpm`` or with its ``tpm`` spent this minute (429, ``api/policy/rate_limits.py``):
    ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers, as LiteLLM sends them."""

    def __init__(self, message: str, headers: Mapping[str, str]) -> None:
        VllamaError.__init__(self, message)
        self.headers = dict(headers)


class BudgetExhausted(TooManyRequests):
    """A key used its ``budget_tokens`` for its ``budget_period`` (``api/policy/budgets.py``): 429, the message
    naming the budget and when it resets, ``Retry-After`` the seconds until then (OpenAI's code for a
    spent quota, ``insufficient_quota``)."""

    code = "insufficient_quota"


class StorageFailed(VllamaError):
    """vllama could not write or remove its own files: the state directory (aliases, created
    models), the Hugging Face cache. Neither a client mistake nor vLLM's fault (500)."""


class NotSupported(VllamaError):
    """An Ollama endpoint vllama deliberately leaves to vLLM's own model management (501)."""

    status = 501


class ServerBusy(VllamaError):
    """The server-wide bound on requests at once is full (``api/request/admission.py``): Ollama's
    503 ``server busy``, with ``Retry-After`` seconds (``--retry-after``)."""

    status = 503

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}


class InsufficientStorage(VllamaError):
    """The server lacks room for what is asked: 507 Insufficient Storage (RFC 4918 §11.5: the
    server "is unable to store the representation needed to complete the request"), a
    server-side status that, unlike 503, does not invite a retry of the same request."""

    status = 507


class ModelTooLarge(InsufficientStorage):
    """The model cannot be loaded: its estimated weights, KV cache and overhead do not fit in the
    memory of its GPUs even after idle models are unloaded (``models/fit.py``).

    Ollama answers 500 ``model requires more system memory (X GiB) than is available (Y GiB)``;
    vllama keeps 500 for its own faults (this is neither a bug nor a client mistake: the request
    is valid, the server lacks room) and answers 507.
    """


class NotEnoughSpace(InsufficientStorage):
    """A pull or an upload does not fit: the disk's free space, or the cache's ``--cache-quota`` (507)."""


class PullFailed(VllamaError):
    """A pull from the Hugging Face Hub failed (``models/hub.py``); this class itself for a
    failure none of its subclasses names (500, logged with its traceback)."""


class HubAuthRequired(PullFailed):
    """The repository is gated or private and HF_TOKEN is unset or refused (401; the message says
    what to set). No ``WWW-Authenticate``: the credentials wanted are the server's, not the client's."""

    status = 401


class HubForbidden(PullFailed):
    """The account of HF_TOKEN may not read the repository, or it is disabled (403)."""

    status = 403


class HubModelNotFound(PullFailed):
    """No such repository or revision on the Hub (404, Ollama's ``pull model manifest: file does not exist``)."""

    status = 404


class HubBadAnswer(PullFailed):
    """The Hub (or the server at ``HF_ENDPOINT``) answered what it should not (502)."""

    status = 502


class DigestMismatch(HubBadAnswer):
    """A downloaded file's sha256 (or git blob id) is not the one the Hub listed; it was removed (502)."""


class HubUnavailable(PullFailed):
    """The Hub cannot be reached, is rate-limiting this server, or ``HF_HUB_OFFLINE`` forbids it (503)."""

    status = 503


class UpstreamError(VllamaError):
    """vLLM, the upstream, failed; subclasses say how."""

    status = 502


class UpstreamRejected(UpstreamError):
    """vLLM answered the request with an error status; its status and message are passed on.

    vLLM's 400s (prompt longer than the context, invalid JSON schema, ...) are client
    mistakes and stay 400; vLLM's 5xx stay 5xx. The one error whose status is not its class's.
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status  # vLLM's, passed on


class UpstreamUnavailable(UpstreamError):
    """vLLM cannot be reached: refused, reset, closed mid-answer, or still starting (503)."""

    status = 503


class ModelLoading(UpstreamUnavailable):
    """The model is loading (starting, restarting, waking): 503 with ``Retry-After``, the HTTP way
    (RFC 9110 §10.2.3) to say that retrying helps. A 503 without it (a model that failed to load)
    is final: ``vllama run`` stops waiting at once."""

    headers: ClassVar[Mapping[str, str]] = {"Retry-After": "1"}


class SlotsFull(UpstreamUnavailable):
    """Every on-demand slot holds a model that is loaded, loading or in use (503; ``supervisor/slots.py``)."""


class SlotsKept(SlotsFull):
    """A user key's on-demand load finds every slot held by a model within its keep_alive, which it may not end
    (``models/on_demand.py``): 503 with ``Retry-After`` until the first keep_alive ends."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}  # type: ignore[misc]


class UpstreamTimeout(UpstreamError):
    """vLLM sent nothing within the idle-read timeout (504)."""

    status = 504


class UpstreamProtocolError(UpstreamError):
    """vLLM answered with bytes we cannot read as its OpenAI protocol (502)."""

    status = 502


#: An error body's shape: Ollama's, OpenAI's (vLLM's too) or Anthropic's (:func:`shape_of`).
Shape = Literal["ollama", "openai", "anthropic"]


def shape_of(path: str) -> Shape:
    """The error shape of the route family ``path`` belongs to: Anthropic's on ``/v1/messages`` and
    ``/v1/messages/count_tokens``, OpenAI's on every other ``/v1`` path (relayed, agents' and refused
    alike: what a client of that API reads), Ollama's elsewhere."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/") or path == "/v1":
        return "openai"
    return "ollama"


def error_body(message: str) -> bytes:
    """Ollama's error object as bytes: ``{"error": message}`` (no trailing newline)."""
    return orjson.dumps({"error": message})


#: OpenAI's error ``type`` for each status (Ollama's ``openai.NewError``, OpenAI's API reference "Error
#: codes"); another 4xx: ``invalid_request_error``; a 5xx: ``api_error`` (Ollama's).
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 429: "rate_limit_error"}


def openai_error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """OpenAI's error object as bytes: ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``,
    the type named by ``status``, ``code`` OpenAI's string code or else ``status`` (as vLLM sends it)."""
    kind = _OPENAI_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code or status}})


#: Anthropic's error ``type`` for each status (docs.anthropic.com/en/api/errors); others: ``api_error``.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> bytes:
    """Anthropic's error object as bytes: ``{"type": "error", "error": {"type": ..., "message": message}}``."""
    return orjson.dumps({"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}})


def shaped_body(shape: Shape, status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """The error body of ``shape`` for ``status`` and ``message`` (``param`` and ``code``: OpenAI's only)."""
    if shape == "openai":
        return openai_error_body(status, message, param, code)
    if shape == "anthropic":
        return anthropic_error_body(status, message)
    return error_body(message)


def error_response(exc: VllamaError, shape: Shape = "ollama") -> web.Response:
    """The non-streaming answer for ``exc``: its class's status (vLLM's for
    :class:`UpstreamRejected`), its headers, and its body in ``shape`` (:func:`shape_of` of the
    request's path): Ollama's ``{"error": exc.message}``, OpenAI's or Anthropic's object."""
    return web.Response(
        status=exc.status,
        body=shaped_body(shape, exc.status, exc.message, exc.param, exc.code),
        content_type="application/json",
        headers=exc.headers or None,
    )


def error_line(exc: VllamaError) -> bytes:
    """The last NDJSON line of a stream that failed after it began (status stays 200)."""
    return error_body(exc.message) + b"\n"


def error_event(exc: VllamaError, shape: Shape) -> bytes:
    """The SSE event that ends a ``/v1`` stream failing after it began (status stays 200): OpenAI's
    object as one ``data:`` event (vLLM's own mid-stream error; the ``openai`` SDK raises ``APIError``
    with it as ``body``), or on Anthropic's routes an ``event: error`` (the ``anthropic`` SDK raises it)."""
    if shape == "anthropic":
        return b"event: error\ndata: " + anthropic_error_body(exc.status, exc.message) + b"\n\n"
    return b"data: " + openai_error_body(exc.status, exc.message, exc.param, exc.code) + b"\n\n"
