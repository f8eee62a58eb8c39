"""Ollama's streamed answers are NDJSON (one JSON object a line, ``application/x-ndjson``): the
content type, and the aiohttp response a stream begins with.

Source: ``docs/wire.md`` "Responses" (streaming: one object a line, no blank lines); Ollama's ``server/routes.go``
``streamResponse`` (the headers leave with the first chunk).
"""

from __future__ import annotations

from aiohttp import web

NDJSON = "application/x-ndjson"


class FirstLineResponse(web.StreamResponse):
    """A stream whose status line and headers leave in the same write as its first line.

    aiohttp's ``StreamResponse`` sends them on ``prepare()``; :func:`begin` prepares it only when
    the first line is ready, so sending them apart is a second socket write and a second wake-up
    of the client on every request's TTFT path. aiohttp >= 3.12 holds them for the first write
    when ``_send_headers_immediately`` is false (as its own ``Response`` does); older aiohttp
    ignores the attribute and sends them first.
    """

    _send_headers_immediately = False


async def begin(request: web.Request) -> web.StreamResponse:
    """Start the NDJSON response: status 200 and headers go out in one write with the first line."""
    out = FirstLineResponse(headers={"Content-Type": NDJSON})
    await out.prepare(request)
    return out
