"""A request's body, read once within its route's size and time limits: by admission (``admission.py``,
before a request takes a place) and by the route that parses it (``routes/body.py``). It stands
below both, so admission needs nothing of ``routes/`` (that import pointed upward)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from vllama_proxy.errors import BadRequest, BodyTimeout, RequestTooLarge

from ..app_state import CLOSE_AFTER, SETTINGS


async def read_body(request: web.Request) -> bytes:
    """The raw request body, read once: a second call (the route's, after admission's) returns it as read.

    Inference routes take ``--max-body-size``, the sign-in routes anyone may reach :data:`SIGN_IN_LIMIT`, every
    other route ``--max-small-body-size``, counted as the body is inflated (a compressed body's size says nothing
    of what it holds); the whole body must arrive within ``--body-timeout``.

    Raises:
        BadRequest: it cannot be read as sent (e.g. ``Content-Encoding: gzip`` on a body that is not gzip).
        RequestTooLarge: over the route's limit (413).
        BodyTimeout: not received in time (408; the connection is closed after the answer).
    """
    body = request.get(BODY)
    if body is not None:  # admission read it: the route's read is free
        return body
    settings = request.app[SETTINGS]
    small = request.path not in LARGE_BODY_ROUTES and not request.path.startswith(LARGE_BODY_PREFIXES)
    limit = SIGN_IN_LIMIT if request.path in UNSIGNED_ROUTES else settings.max_small_body_size if small else settings.max_body_size
    if (request.content_length or 0) > limit:
        request[CLOSE_AFTER] = True
        raise RequestTooLarge(f"request body too large: the limit of {request.path} is {limit} bytes")
    try:
        if request.content.is_eof():  # all of it arrived with the headers (the usual small body): no wait to bound
            body = await _within(request, limit)
        else:
            async with asyncio.timeout(settings.body_timeout):
                body = await _within(request, limit)
    except TimeoutError:
        request.content.feed_eof()
        request[CLOSE_AFTER] = True
        raise BodyTimeout(f"the request body was not received within {settings.body_timeout:g} s (--body-timeout)") from None
    except RequestPayloadError:
        # Nothing more of this body will be read: say so, or aiohttp's lingering read after the
        # 400 hits the same error and logs it as an error-level "Unhandled exception"; and the
        # connection closes after the 400 (the parser cannot find the next request after it).
        request.content.feed_eof()
        request[CLOSE_AFTER] = True
        encoding = request.headers.get("Content-Encoding", "").strip()
        if encoding:
            raise BadRequest(f"the request body is not valid {encoding} (it was sent with Content-Encoding: {encoding})") from None
        raise BadRequest("the request body could not be read as sent") from None
    request[BODY] = body
    return body


async def _within(request: web.Request, limit: int) -> bytes:
    """The body, counted as it arrives (inflated: aiohttp inflates a compressed body as it is read, a chunk at a
    time), and given up past ``limit`` bytes: a 120 MiB gzip bomb costs its route's limit, never its size.

    Raises:
        RequestTooLarge: over ``limit`` (the connection closes after the answer: the rest is never read)."""
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            request[CLOSE_AFTER] = True
            raise RequestTooLarge(f"request body too large: the limit of {request.path} is {limit} bytes")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


#: The request's body once :func:`read_body` read it within its limits (admission's read, then the route's).
BODY = "vllama.body"


#: Routes anyone may post to before signing in, and what their bodies may hold (bytes): a sign-in form.
UNSIGNED_ROUTES = frozenset({"/admin/login", "/admin/logout"})
SIGN_IN_LIMIT = 4096
#: Routes that take ``--max-body-size`` (inference, blobs); every other route ``--max-small-body-size``.
LARGE_BODY_ROUTES = frozenset({"/api/generate", "/api/chat", "/api/embed", "/api/embeddings"})
LARGE_BODY_PREFIXES = ("/v1/", "/api/blobs/")
