"""Unit tests of the upstream client's error mapping, against small in-process HTTP servers.

(aioresponses does not support aiohttp 3.14's ClientResponse; a real aiohttp test
server is closer to vLLM anyway.)
"""

from __future__ import annotations

import asyncio
import re
from unittest.mock import Mock

import aiohttp

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import free_port
from vllama_proxy.errors import UpstreamProtocolError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from vllama_proxy.upstream import Upstream, iter_sse, read_raw, read_some


async def serve(handler, **upstream_kw):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = TestServer(app)
    await server.start_server()
    up = Upstream(str(server.make_url("")).rstrip("/"), **upstream_kw)
    await up.start()
    return server, up


@pytest.mark.parametrize("payload,message", [
    ({"error": {"message": "too long", "type": "BadRequestError", "code": 400}}, "too long"),
    ({"object": "error", "message": "old style", "code": 400}, "old style"),
    ({"detail": "fastapi said"}, "fastapi said"),
])
async def test_vllm_error_shapes(payload, message):
    server, up = await serve(lambda r: web.json_response(payload, status=400))
    try:
        with pytest.raises(UpstreamRejected) as e:
            await up.post_json("/v1/completions", {})
        assert e.value.status == 400 and e.value.message == message
    finally:
        await up.close()
        await server.close()


async def test_non_json_error_and_body():
    server, up = await serve(lambda r: web.Response(status=502 if r.path == "/bad" else 200, text="<html>oops"))
    try:
        with pytest.raises(UpstreamRejected) as e:
            await up.get_json("/bad")
        assert e.value.status == 502 and e.value.message == "<html>oops"
        with pytest.raises(UpstreamProtocolError):
            await up.get_json("/ok")
    finally:
        await up.close()
        await server.close()


async def test_refused_is_unavailable():
    up = Upstream(f"http://127.0.0.1:{free_port()}")
    await up.start()
    try:
        with pytest.raises(UpstreamUnavailable, match="not reachable"):
            await up.get_json("/v1/models")
    finally:
        await up.close()


async def test_idle_read_timeout():
    async def slow(request):
        await asyncio.sleep(5)
        return web.json_response({})

    server, up = await serve(slow, read_timeout=0.2)
    try:
        with pytest.raises(UpstreamTimeout):
            await up.get_json("/v1/models")
    finally:
        await up.close()
        await server.close()


async def test_sse_cut_and_error_event():
    async def sse(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": []}\n\n')
        if request.path == "/err":
            await resp.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
        return resp  # ends without [DONE]

    server, up = await serve(sse)
    try:
        for path, kind, text in (("/cut", UpstreamUnavailable, "before it finished"), ("/err", UpstreamRejected, "engine died")):
            async with up.request("POST", path, body=b"{}") as resp:
                seen = []
                with pytest.raises(kind, match=text):
                    async for batch in iter_sse(resp):
                        seen += batch
                assert seen == [{"choices": []}]
    finally:
        await up.close()
        await server.close()


async def test_sse_events_split_across_reads_and_batched():
    async def sse(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"n": 0}\n\ndata: {"n"')  # an event cut in the middle
        await asyncio.sleep(0.05)
        await resp.write(b': 1}\n\n: a comment\n\ndata: {"n": 2}\n\ndata: {"n": 3}\n\ndata: [DONE]\n\n')
        return resp

    server, up = await serve(sse)
    try:
        async with up.request("POST", "/", body=b"{}") as resp:
            batches = [b async for b in iter_sse(resp)]
        assert [c["n"] for b in batches for c in b] == [0, 1, 2, 3]
        assert len(batches) == 2  # what arrived together is handed over together
    finally:
        await up.close()
        await server.close()


async def test_body_cut_mid_read_is_unavailable():
    async def cut(request):
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
        await resp.prepare(request)
        await resp.write(b'{"data": [')
        request.transport.close()  # the connection breaks before the body is complete
        return resp

    server, up = await serve(cut)
    try:
        with pytest.raises(UpstreamUnavailable):
            await up.get_json("/v1/models")
    finally:
        await up.close()
        await server.close()


class ClosingServer:
    """A keep-alive HTTP/1.1 server that, like uvicorn at the end of its keep-alive, closes a
    connection instead of answering when the next request arrives on it (``close_reused``), or
    closes connections idle for ``idle`` seconds. Counts what it did."""

    def __init__(self, close_reused: bool = False, idle: float = 60.0, close_first: bool = False) -> None:
        self.close_reused, self.idle, self.close_first = close_reused, idle, close_first
        self.answered = self.closed_on_reuse = self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        self.connections += 1
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                    return  # idle too long, or the client closed it
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if self.close_first:
                    return  # closed before answering, on a fresh connection
                if served and self.close_reused:
                    self.closed_on_reuse += 1
                    return
                body = b'{"ok": true}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                served += 1
                self.answered += 1
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def test_request_on_a_connection_closed_before_the_answer_is_sent_again():
    srv = ClosingServer(close_reused=True)
    up = Upstream(await srv.start())
    await up.start()
    try:
        for _ in range(40):  # every reuse of a pooled connection meets a server closing it
            assert await up.post_json("/v1/completions", {"prompt": "x"}) == {"ok": True}
        assert srv.closed_on_reuse >= 10 and srv.answered == 40
    finally:
        await up.close()
        await srv.stop()


async def test_idle_connections_retire_before_the_server_closes_them(monkeypatch):
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "0.5")  # the pool keeps idle connections 0.3 s
    srv = ClosingServer(idle=0.5)
    up = Upstream(await srv.start())
    await up.start()
    retries = []
    fresh = up.pool.fresh.request
    monkeypatch.setattr(up.pool.fresh, "request", lambda *a, **kw: retries.append(a) or fresh(*a, **kw))
    try:
        import random

        rnd = random.Random(7)
        for _ in range(30):  # idle gaps around both lifetimes
            await asyncio.sleep(rnd.uniform(0.2, 0.7))
            results = await asyncio.gather(*(up.post_json("/v1/completions", {}) for _ in range(3)))
            assert results == [{"ok": True}] * 3
        assert retries == []  # no connection outlived its idle lifetime: nothing needed the retry
    finally:
        await up.close()
        await srv.stop()


async def test_a_fresh_connection_that_fails_is_not_retried():
    srv = ClosingServer(close_first=True)  # the server reads the request and closes without answering
    up = Upstream(await srv.start())
    await up.start()
    try:
        with pytest.raises(UpstreamUnavailable):
            await up.post_json("/v1/completions", {})
        await asyncio.sleep(0.1)
        assert srv.connections == 1  # not sent again: vLLM may have started on it
    finally:
        await up.close()
        await srv.stop()


async def test_a_stream_read_up_to_done_keeps_its_connection():
    """vLLM (uvicorn) sends ``data: [DONE]`` and the chunked body's end in separate writes: the
    stream's reader stops at ``[DONE]``, and the connection must still go back to the pool once the
    end arrives, not be closed (issue 19, item 10: on the H200 about every second request through
    vllama opened a new connection to vLLM while the direct client reused its own)."""
    peers = []

    async def sse(request):
        peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.01)  # the generator's end, then the terminating chunk
        await resp.write_eof()
        return resp

    server, up = await serve(sse)
    try:
        for _ in range(5):
            async with up.request("POST", "/v1/completions", body=b"{}") as resp:
                chunks = []
                async for batch in iter_sse(resp):
                    chunks.extend(batch)
            assert [c["choices"][0]["text"] for c in chunks] == ["x"]
            await asyncio.sleep(0.05)  # the next request comes after the end (a client's round trip)
        assert len(set(peers)) == 1, f"{len(set(peers))} connections for 5 sequential streams"
    finally:
        await up.close()
        await server.close()


def _sse_server(events: int, gap: float, then_hang: bool = False):
    """A handler streaming ``events`` SSE events ``gap`` s apart, then [DONE] (or nothing, forever)."""
    async def sse(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(events):
            await resp.write(b'data: {"n": %d}\n\n' % i)
            await asyncio.sleep(gap)
        if then_hang:
            await asyncio.sleep(3600)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    return sse


async def test_streamed_body_arms_no_timer_per_read(monkeypatch):
    """Issue 42: aiohttp's sock_read re-arms a loop timer on every read, a few µs of each streamed
    token's CPU; the body's watch keeps the idle-read timeout with one timer per quarter timeout."""
    server, up = await serve(_sse_server(40, 0.002), read_timeout=30)
    loop = asyncio.get_running_loop()
    armed = []
    for name in ("call_later", "call_at"):
        real = getattr(loop, name)
        # the client's read timers only (the in-process server's own sleeps use the same loop)
        monkeypatch.setattr(loop, name, lambda *a, _real=real, **k: armed.append(getattr(a[1], "__name__", "")) or _real(*a, **k))
    try:
        for reader in (read_some, read_raw):
            async with up.request("POST", "/s", body=b"{}") as resp:
                armed.clear()
                reads = 0
                with up.watch_body(resp):
                    while b"[DONE]" not in await reader(resp):
                        reads += 1
                assert reads >= 20  # one read per event: the server paces them
                timers = [n for n in armed if n in ("_on_read_timeout", "_look")]  # aiohttp's sock_read, the watch's
                assert len(timers) <= 3, f"{len(timers)} read timers armed for {reads} reads"
    finally:
        await up.close()
        await server.close()


async def test_watched_body_times_out_when_idle_not_when_slow():
    """The watch fails a body with no byte for the read timeout (UpstreamTimeout, as aiohttp's
    sock_read did), and never one whose bytes keep coming, however long it lasts."""
    server, up = await serve(_sse_server(2, 0.01, then_hang=True), read_timeout=0.4)
    slow_server, slow_up = await serve(_sse_server(8, 0.15), read_timeout=0.4)  # 1.2 s in all, 0.15 s gaps
    try:
        async with up.request("POST", "/hang", body=b"{}") as resp:
            with up.watch_body(resp):
                t0 = asyncio.get_running_loop().time()
                with pytest.raises(UpstreamTimeout, match="did not answer in time"):
                    while True:
                        await read_some(resp)
                assert asyncio.get_running_loop().time() - t0 >= 0.4
        async with slow_up.request("POST", "/slow", body=b"{}") as resp:
            with slow_up.watch_body(resp):
                while b"[DONE]" not in await read_some(resp):
                    pass
    finally:
        await up.close()
        await slow_up.close()
        await server.close()
        await slow_server.close()



async def test_a_connect_dropped_at_a_full_listen_queue_is_tried_again_soon():
    """A server whose listen queue is full drops the SYN; Linux sends it again after 1 s, then 3 s (issue 43:
    vllm-router 0.1.17 listens with a backlog of 128, and a front opening ~1,000 connections at a run's start
    had 430-917 of its first 1,024 requests wait 1-3 s). A connect not answered within a fifth of a second is
    tried again on a new socket instead: here the queue drains 50 ms after the SYN was dropped, and the request
    is answered well before the kernel's 1 s."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # Linux holds backlog + 1 unaccepted connections
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):  # the queue full (a third SYN is already dropped: its connect stays pending)
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    await asyncio.sleep(0.05)
    app = web.Application()
    app.router.add_get("/ok", lambda r: web.json_response({"ok": True}))
    runner = web.AppRunner(app)
    await runner.setup()
    up = Upstream(f"http://127.0.0.1:{port}")
    await up.start()
    try:
        asked = asyncio.get_running_loop().time()
        pending = asyncio.ensure_future(up.get_json("/ok"))  # its SYN dropped: the queue is full
        await asyncio.sleep(0.05)
        await web.SockSite(runner, listener).start()  # the server accepts from now on: the queue drains
        assert await asyncio.wait_for(pending, 10) == {"ok": True}
        took = asyncio.get_running_loop().time() - asked
        assert took < 0.8, f"answered after {took:.2f} s: the kernel's SYN retransmission, not a new try"
    finally:
        for s in fillers:
            s.close()
        await up.close()
        await runner.cleanup()


async def test_a_request_builds_no_aiohttp_trace(monkeypatch):
    """Issue 42.4: the retry's "was this connection pooled" came from a TraceConfig, and with any trace
    config aiohttp builds a Trace per request and awaits its signals at each step (~30 Python calls of
    each request's ~370 on the client side). The connector says it instead; the retry above still works."""
    from aiohttp import tracing

    built = []
    real = tracing.Trace.__init__
    monkeypatch.setattr(tracing.Trace, "__init__", lambda self, *a, **kw: built.append(1) or real(self, *a, **kw))
    srv = ClosingServer()
    up = Upstream(await srv.start())
    await up.start()
    try:
        for _ in range(3):
            assert await up.post_json("/v1/completions", {}) == {"ok": True}
        assert built == [] and srv.connections == 1  # the pooled connection, reused, and no Trace
    finally:
        await up.close()
        await srv.stop()


async def test_a_server_that_accepts_nothing_fails_its_connects_and_then_fails_fast():
    """Connects wait while the server accepts some (``test_connect_burst.py``), not while it accepts none: after
    ``connect_timeout`` with no connect made the request fails, and once one gave up, the next ones to that server
    get one try each until a connect succeeds again (a dead server's queue of requests fails in fifths of a second,
    not in ``connect_timeout`` each)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):  # the queue full, and nobody accepts: every later SYN is dropped
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    up = Upstream(f"http://127.0.0.1:{port}", connect_timeout=1.0)
    await up.start()
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        with pytest.raises(UpstreamTimeout):
            await up.get_json("/health")
        first = loop.time() - t0
        assert 0.9 < first < 5, f"the first connect gave up after {first:.2f} s"
        t0 = loop.time()
        with pytest.raises(UpstreamTimeout):
            await up.get_json("/health")
        second = loop.time() - t0
        assert second < 0.7, f"the next connect to a server that accepted nothing took {second:.2f} s"
    finally:
        for s in fillers:
            s.close()
        listener.close()
        await up.close()


# --- the one error mapping (upstream/mapping.py) and the pool shared by targets (upstream/pool.py) ------


@pytest.mark.parametrize("error,mapped,text", [
    (aiohttp.ServerTimeoutError("Timeout on reading data from socket"), UpstreamTimeout, "did not answer in time"),
    (asyncio.TimeoutError(), UpstreamTimeout, "did not answer in time"),
    (aiohttp.ClientConnectorError(Mock(), OSError(111, "Connection refused")), UpstreamUnavailable, "not reachable at http://v:1: Connection refused"),
    (aiohttp.ServerDisconnectedError(), UpstreamUnavailable, "closed the connection before the answer was complete (ServerDisconnectedError)"),
    (aiohttp.ClientPayloadError("cut"), UpstreamUnavailable, "(ClientPayloadError)"),
    (ConnectionResetError(), UpstreamUnavailable, "(ConnectionResetError)"),
    (aiohttp.ClientResponseError(Mock(), (), message="bad header"), UpstreamProtocolError, "invalid HTTP answer: bad header"),
    (aiohttp.ClientError("other"), UpstreamUnavailable, "vLLM request failed: other"),
])
def test_raise_mapped_turns_aiohttps_errors_into_the_tree(error, mapped, text):
    from vllama_proxy.upstream import mapped_errors, raise_mapped

    with pytest.raises(mapped, match=re.escape(text)) as caught:
        raise_mapped(error, "http://v:1")
    assert caught.value.__cause__ is error
    with pytest.raises(mapped, match=re.escape(text)):  # the block's form maps alike
        with mapped_errors("http://v:1"):
            raise error


@pytest.mark.parametrize("error", [asyncio.CancelledError(), GeneratorExit(), UpstreamRejected("no", 400), ValueError("mine")])
def test_raise_mapped_passes_what_is_not_about_the_upstream(error):
    from vllama_proxy.upstream import mapped_errors, raise_mapped

    with pytest.raises(type(error)) as caught:
        raise_mapped(error, "http://v:1")
    assert caught.value is error
    with pytest.raises(type(error)) as caught:
        with mapped_errors("http://v:1"):
            raise error
    assert caught.value is error


async def test_a_client_at_another_server_shares_the_pool_and_leaves_it_open():
    server, up = await serve(lambda r: web.json_response({"at": r.path}))
    other, own = await serve(lambda r: web.json_response({"other": r.path}))
    await own.close()  # only its server is used: through up's pool
    try:
        there = up.at(str(other.make_url("")).rstrip("/") + "/")
        assert there.pool is up.pool and there.base_url == str(other.make_url("")).rstrip("/")
        assert await there.get_json("/x") == {"other": "/x"} and await up.get_json("/y") == {"at": "/y"}
        await there.close()  # not its pool to close
        assert await up.get_json("/z") == {"at": "/z"} and await there.get_json("/w") == {"other": "/w"}
    finally:
        await up.close()
        await server.close()
        await other.close()
