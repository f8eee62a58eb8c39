"""Reading vLLM's answers: whole bodies (JSON or not), a streamed body's bytes and its idle-read
timeout (:class:`BodyWatch`), server-sent events (:class:`SSEDecoder`, :func:`iter_sse`); and the JSON
encoder of the bodies sent (:func:`encode_json`). Client errors are mapped by ``mapping.py``.

A streamed body's idle-read timeout is :class:`BodyWatch`'s, not aiohttp's ``sock_read``: aiohttp
re-arms a timer on every read (a few µs of each streamed token's CPU); the watch looks
at the bytes received a few times per timeout instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from vllama_proxy import error_text
from vllama_proxy.errors import BadRequest, UpstreamError, UpstreamProtocolError, UpstreamRejected, UpstreamUnavailable

from .mapping import mapped_errors, raise_mapped

_DONE = b"[DONE]"


def encode_json(obj: Any) -> bytes:
    """``orjson.dumps`` for bodies built from client input.

    orjson reads JSON nested up to 1024 levels but writes at most 254, so a body that
    parsed can still fail here; that is the client's nesting, answered as a 400.

    Raises:
        BadRequest: the structure is nested too deeply (or not serialisable) to forward.
    """
    try:
        return orjson.dumps(obj)
    except TypeError as e:
        raise BadRequest(f"request is nested too deeply to forward: {e}") from None


class BodyWatch:
    """A streamed body's idle-read timeout without a timer per read.

    aiohttp's ``sock_read`` timeout cancels and re-arms a loop timer on every read from the
    socket (``ResponseHandler._reschedule_timeout``): ~2.5 µs of CPU per streamed token on
    uvloop, each token being one read. While the watch is on, the connection's
    ``read_timeout`` is off (the public setter aiohttp itself uses for websockets) and one timer
    per stream fires every quarter of ``timeout``, comparing the body's ``total_bytes`` with the
    last look: four looks in a row with no new byte fail the body with aiohttp's own
    ``ServerTimeoutError`` (``StreamReader.set_exception``), which the readers map to
    ``UpstreamTimeout`` as before. So a body fails between ``timeout`` and 1.25 x ``timeout``
    after its last byte (aiohttp's: at ``timeout``). Waiting for the response headers is still
    ``sock_read``'s (the watch starts once they came); the connection's next request sets its
    ``read_timeout`` again (aiohttp's ``set_response_params``). One difference: a client that stops
    reading stops the relay reading vLLM, and once no byte came for the timeout the body's next read
    fails too (aiohttp held its timer while its own buffer was full).

    Args:
        resp: the open response, its headers read.
        timeout: seconds without a byte before the body fails; ``None`` or 0 watches nothing.
    """

    __slots__ = ("_content", "_handle", "_looks", "_period", "_seen")

    #: looks per timeout: the timeout's precision (it fires within 1 + 1/_LOOKS of it)
    _LOOKS = 4

    def __init__(self, resp: aiohttp.ClientResponse, timeout: float | None) -> None:
        self._content = resp.content
        self._handle: asyncio.TimerHandle | None = None
        self._looks = 0
        self._seen = 0
        self._period = 0.0
        conn = resp.connection
        if timeout and conn is not None and conn.protocol is not None:
            # The timer aiohttp armed at the last read still runs: it fires at that read + timeout
            # if nothing else comes, and the next read cancels it without arming another.
            conn.protocol.read_timeout = None
            self._period = timeout / self._LOOKS
            self._seen = self._content.total_bytes
            self._handle = asyncio.get_running_loop().call_later(self._period, self._look)

    def _look(self) -> None:
        total = self._content.total_bytes
        if total != self._seen:
            self._seen, self._looks = total, 0
        else:
            self._looks += 1
            if self._looks >= self._LOOKS:
                self._handle = None
                self._content.set_exception(aiohttp.ServerTimeoutError("Timeout on reading data from socket"))
                return
        self._handle = asyncio.get_running_loop().call_later(self._period, self._look)

    def close(self) -> None:
        """Stop watching (the body ended, or its reader left)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def __enter__(self) -> BodyWatch:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


async def read_response(resp: aiohttp.ClientResponse) -> bytes:
    """Read a whole body, with client errors mapped (a reset mid-body is ``UpstreamUnavailable``)."""
    with mapped_errors(str(resp.url.origin())):
        return await resp.read()


async def read_json(resp: aiohttp.ClientResponse) -> Any:
    """Read and decode a whole JSON body.

    Raises:
        UpstreamProtocolError: the body is not JSON.
    """
    raw = await read_response(resp)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamProtocolError(f"vLLM sent a body that is not JSON: {raw[:200]!r}") from None


class SSEDecoder:
    """Incremental decoder of vLLM's server-sent events: bytes in, chunk dicts out.

    vLLM frames every event as one ``data: <json>`` line plus a blank line and ends with
    ``data: [DONE]``; an error raised after streaming began arrives as a
    ``data: {"error": {...}}`` event. :meth:`feed` returns the chunks of every complete
    event in ``data`` (an event cut between reads is kept for the next call). Afterwards
    :attr:`done` tells that ``[DONE]`` came, and :attr:`failure` holds the error to raise
    once the chunks before it were used (``UpstreamRejected`` for an error event,
    ``UpstreamProtocolError`` for a ``data:`` line that is not a JSON object).

    Synchronous and allocation-light on purpose: it runs once per token on the hot path.
    """

    __slots__ = ("_tail", "done", "failure")

    def __init__(self) -> None:
        self._tail = b""
        self.done = False
        self.failure: UpstreamError | None = None

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        if self._tail:
            data = self._tail + data
        lines = data.split(b"\n")
        self._tail = lines.pop()  # b"" when data ended on a line break
        batch = []
        for line in lines:
            if line[:5] != b"data:":
                continue  # blank separators, comments, event:/id: lines
            payload = line[5:].strip()
            if payload == _DONE:
                self.done = True
                break
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                self.failure = UpstreamProtocolError(f"vLLM sent an event that is not JSON: {payload[:200]!r}")
                break
            if type(chunk) is not dict:
                self.failure = UpstreamProtocolError(f"vLLM sent an event that is not a JSON object: {payload[:200]!r}")
                break
            if "error" in chunk:
                err = chunk["error"]
                code = err.get("code") if isinstance(err, dict) else None
                self.failure = UpstreamRejected(error_text(chunk) or "vLLM reported an error",
                                                code if isinstance(code, int) and code >= 400 else 500)
                break
            batch.append(chunk)
        return batch


async def read_some(resp: aiohttp.ClientResponse) -> bytes:
    """The next bytes of a streamed body, with client errors mapped (see :func:`mapped_errors`).

    Raises:
        UpstreamUnavailable: the stream ended (or broke) here.
        UpstreamTimeout: no byte within the idle-read timeout.
    """
    try:
        data = await resp.content.readany()
    except Exception as e:  # noqa: BLE001 - mapped or re-raised
        raise_mapped(e, str(resp.url.origin()))
    if not data:
        raise UpstreamUnavailable("vLLM closed the stream before it finished")
    return data


async def read_raw(resp: aiohttp.ClientResponse) -> bytes:
    """The next bytes of a body as they arrive, ``b""`` at its end, with client errors mapped
    (see :func:`mapped_errors`): a plain coroutine per read, where an async generator over
    aiohttp's ``iter_any`` was two more frames resumed per streamed token.

    Raises:
        UpstreamUnavailable: the body broke (reset, cut chunked encoding).
        UpstreamTimeout: no byte within the idle-read timeout.
    """
    try:
        return await resp.content.readany()
    except Exception as e:  # noqa: BLE001 - mapped or re-raised
        raise_mapped(e, str(resp.url.origin()))


async def iter_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[list[dict[str, Any]]]:
    """Decode vLLM's server-sent events (:class:`SSEDecoder`) into batches of chunk dicts, up to ``[DONE]``.

    Each batch holds every complete event that had arrived when the proxy read: one
    at light load, several when the proxy falls behind. Reading and, downstream,
    writing a whole batch at once keeps the per-token cost from growing with load.
    What came before a failure is yielded before the failure is raised.

    Raises:
        UpstreamRejected: vLLM streamed an error event (its message and code).
        UpstreamProtocolError: a ``data:`` line is not JSON.
        UpstreamUnavailable: the stream ended or broke before ``[DONE]``.
        UpstreamTimeout: no byte within the idle-read timeout.
    """
    decoder = SSEDecoder()
    while not decoder.done:
        batch = decoder.feed(await read_some(resp))
        if batch:
            yield batch
        if decoder.failure is not None:
            raise decoder.failure
