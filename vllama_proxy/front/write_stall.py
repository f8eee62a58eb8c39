"""A client that stops reading does not keep its request forever (``--client-write-timeout``).

A streaming client that stops reading (a stalled or hostile client, a laptop asleep with its TCP
connection open) fills its socket's buffers; aiohttp's next ``write`` then waits on ``drain()``
with no bound, and the request keeps its admission place (``api/request/admission.py``: the server's bound
and the key's ``max_in_flight``), its fair-share running slot (``api/policy/fair_queue.py``), its
connection to vLLM, and vLLM the output it made. Many such connections from one key held places
others need.

The bound is kept by the connection's protocol, not by the writes: asyncio tells a protocol
``pause_writing()`` when its transport's write buffer rises above the high-water mark (64 KiB;
only then may aiohttp's write wait, in ``StreamWriter.drain``), and ``resume_writing()`` once the
client took it down to the low-water mark. A :class:`WriteStall` lives between the two: one timer
every quarter of the timeout looks whether the buffer shrank (the kernel took bytes, so the client
read some); once it sat still for a whole timeout since, the connection is aborted. Streamed tokens, which
never wait on a client that reads, pass no timer and no check (``front/site.py``'s handler is the
only code that runs, at the pause and the resume). So every write to a client is bounded alike: an
NDJSON stream, a relayed ``/v1`` SSE stream, a long non-streamed body aiohttp writes after its
handler returned, a pull's progress lines.

Past it, the abort makes aiohttp see the connection lost, as when a client disconnects: the
handler is cancelled (``handler_cancellation=True``), the answer is charged what was sent
(``api/routes/answer.py``, ``api/routes/openai.py``), the upstream request is closed so vLLM
aborts it (``upstream.Upstream.request``), and the middlewares give the admission place and the
fair-share slot back. It is logged once (``client_write_stalled``: key, route, bytes buffered) and
counted (``vllama_client_write_stalls_total{route}``).

A stall, not a slow stream: the bound is on a wait with no byte read, as nginx's ``send_timeout``
("if the client does not receive anything within this time, the connection is closed"), never on
a stream's length or rate. A client that reads, however slowly, keeps its stream; so does one that
takes a few bytes per timeout on purpose (as under nginx): its key's ``max_in_flight`` bounds how
many places it holds that way, and its answer still ends at its ``max_tokens``.
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
