"""A client that stops reading does not keep its request forever (``--client-write-timeout``).

A streaming client that stops reading fills its socket's buffers, and aiohttp's next ``write`` waits
with no bound while the request keeps its admission place, fair-share slot, vLLM connection and
vLLM's work. The bound is kept by the protocol, not the writes: between asyncio's ``pause_writing()``
(write buffer above 64 KiB) and ``resume_writing()``, a :class:`WriteStall` timer checks every quarter
timeout whether the buffer shrank, and aborts once it sat still a whole timeout; tokens to a client
that reads pass no timer. So every write to a client is bounded alike. The abort is a disconnect to
aiohttp (handler cancelled, answer charged what was sent, upstream closed, places given back), logged
once (``client_write_stalled``) and counted (``vllama_client_write_stalls_total{route}``). Invariant:
a stall, not a slow stream, as nginx's ``send_timeout``: a client that reads, however slowly, keeps it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from vllama_proxy.api.policy import keys as api_keys
from vllama_proxy.api.metrics import CLIENT_WRITE_STALLS, route_of
from vllama_proxy.logs import get_logger

log = get_logger("vllama.server")


class WriteStall:
    """The watch over one connection's writes while its transport is paused (above the high-water mark).

    Made at ``pause_writing()``, closed at ``resume_writing()`` or when the connection is lost.
    Every ``timeout / 4`` seconds it reads the transport's write buffer size (bytes): a shrink (the
    client took bytes) starts the count again; a look that finds it unchanged counts (nothing taken,
    nothing written: a write waits on ``drain``, or the stream idles, on a client that reads nothing);
    one that finds it grown does not count (vllama wrote: aiohttp's write waits only once it wrote
    64 KiB past the pause, and a client's read may hide under the write). The fourth look that
    counts aborts the connection: it fires between ``timeout`` and 1.25 x ``timeout`` after the
    write began to wait on a client that took nothing since (``upstream.BodyWatch`` keeps vLLM's
    idle-read timeout the same way). The timer runs in the context of the write that paused the
    transport, so the log line carries its ``request_id``.

    Args:
        transport: the connection's transport (``get_write_buffer_size()``, ``abort()``).
        timeout: seconds a write may wait with no byte taken by the client (> 0).
        request: returns what the connection answers now (an aiohttp ``BaseRequest``, or ``None``),
            called at the stall for the log's key and route.
    """

    __slots__ = ("_handle", "_looks", "_period", "_request", "_seen", "_timeout", "_transport")

    #: looks per timeout: the timeout's precision (it fires within 1 + 1/_LOOKS of it)
    _LOOKS = 4

    def __init__(self, transport: asyncio.Transport, timeout: float, request: Callable[[], Any]) -> None:
        self._transport = transport
        self._timeout = timeout
        self._request = request
        self._period = timeout / self._LOOKS
        self._looks = 0
        self._seen = transport.get_write_buffer_size()
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(self._period, self._look)

    def close(self) -> None:
        """Stop watching (the client took the buffer down, or the connection is gone)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _look(self) -> None:
        size = self._transport.get_write_buffer_size()
        if size < self._seen:  # the client took bytes
            self._looks = 0
        elif size == self._seen:  # nothing taken, nothing written: the write waits (or the stream idles) on a client that reads nothing
            self._looks += 1
            if self._looks >= self._LOOKS:
                self._handle = None
                self._stalled(size)
                return
        # grown: vllama wrote (aiohttp waits on drain only once it wrote 64 KiB past the pause), so no
        # write waited then, and what the client took may hide under it: neither counts
        self._seen = size
        self._handle = asyncio.get_running_loop().call_later(self._period, self._look)

    def _stalled(self, buffered: int) -> None:
        try:
            request = self._request()
            route = route_of(request) if request is not None else "other"
            key = api_keys.key_of(request).name if request is not None else "-"
            CLIENT_WRITE_STALLS.labels(route).inc()
            log.warning("client_write_stalled", key=key, route=route, buffered=buffered, timeout_s=self._timeout,
                        path=request.path if request is not None else None,
                        detail="the client read nothing for --client-write-timeout: its connection is closed and its request ended")
        finally:  # whatever the log line met, the connection goes
            self._transport.abort()  # connection_lost follows: the handler is cancelled as for a client gone
