"""A client that stops reading does not hold its place forever (``--client-write-timeout``,
``vllama_proxy/front/write_stall.py``).

Before, a streaming client that stopped reading filled its socket's buffers and vllama's next write
waited on ``drain()`` with no bound: the request kept its admission place, the key's
``max_in_flight`` place, its connection to vLLM and vLLM's work. Here a raw socket with a tiny
receive buffer asks for a long stream (the stand-in vLLM, many tokens) and never reads: under
``--client-write-timeout 3`` its connection is closed, vLLM's request aborted, the key's only place
given back, the stall logged and counted. A client that reads slowly keeps its stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from conftest import ALIAS, get_json, start_fake, start_proxy, stop, wait_events, write_keys

KEYS = [
    {"name": "root", "key": "sk-root", "role": "admin"},
    {"name": "bob", "key": "sk-bob", "max_in_flight": 1},
]

#: A stream far longer than the socket buffers on both sides (about 10 MB of NDJSON).
LONG = "x [[tokens:100000]] [[fault:hangatend]]"  # cannot complete before the stall is seen, on any load


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stall")
    keys = tmp / "keys.toml"
    write_keys(keys, *KEYS)
    fake = start_fake(model_dir, extra=["--max-model-len", "1000000"])
    try:
        log = tmp / "vllama.log"
        proxy = start_proxy(fake.url, "--api-key-file", str(keys), "--client-write-timeout", "3", "--workers", "2", log=log)  # the workers too
        yield fake, proxy, log
        stop(proxy.proc)
    finally:
        stop(fake.proc)


def _ask(port: int, path: str, body: dict, rcvbuf: int = 4096) -> socket.socket:
    """A raw HTTP/1.1 request from a socket with a small receive buffer; nothing is read."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window it offers
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer sk-bob\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _wait_stats(url: str, field: str, above: int, timeout: float = 60.0) -> dict:
    """The stand-in's stats once ``field`` passed ``above`` (the event; ``timeout`` is a failure's bound)."""
    deadline = time.monotonic() + timeout
    while (stats := get_json(url + "/_fake/stats"))[field] <= above:
        assert time.monotonic() < deadline, f"the stand-in's {field} stayed at {stats[field]}: {stats}"
        time.sleep(0.05)
    return stats


def _read_to_end(s: socket.socket) -> bytes:
    got = bytearray()
    s.settimeout(60)
    try:
        while chunk := s.recv(1 << 16):
            got += chunk
    except ConnectionResetError:  # aborted: the kernel resets a connection closed with data unread
        pass
    return bytes(got)


@pytest.mark.parametrize(("path", "body", "route"), [
    ("/api/generate", {"model": ALIAS, "prompt": LONG}, "/api/generate"),
    ("/v1/chat/completions", {"model": ALIAS, "stream": True, "messages": [{"role": "user", "content": LONG}]}, "/v1/{tail}"),
], ids=["ndjson", "sse"])
def test_a_client_that_stops_reading_loses_its_stream_and_gives_its_place_back(served, path, body, route):
    fake, proxy, log = served
    before = get_json(fake.url + "/_fake/stats")
    charged = _bobs_output_tokens(proxy.url)
    stalled = sum(e.get("event") == "client_write_stalled" for e in _log(log))
    s = _ask(proxy.port, path, body)
    try:
        _wait_stats(fake.url, "started", before["started"])
        # bob's one place is held: a second request is refused (429), unless the stall came first and freed it
        r = httpx.post(proxy.url + "/api/generate", headers={"Authorization": "Bearer sk-bob"}, timeout=60,
                       json={"model": ALIAS, "prompt": "hi", "stream": False})
        if r.status_code != 429:  # a loaded machine took the timeout to answer it: the place was given back by the stall
            assert r.status_code == 200 and sum(e.get("event") == "client_write_stalled" for e in _log(log)) > stalled, r.text
        else:
            assert "max_in_flight" in r.json()["error"], r.text
        # the events: the stall, then vLLM's request aborted (bounds are a failure's, the stall itself takes 3-3.75 s)
        events = wait_events(log, "client_write_stalled", stalled + 1, timeout=90)
        after = _wait_stats(fake.url, "aborted", before["aborted"])
        assert after["completed"] == before["completed"]  # cut, not finished
        line = [e for e in events if e.get("event") == "client_write_stalled"][-1]
        assert line["key"] == "bob" and line["route"] == route and line["buffered"] > 0
        # the connection is closed: what the client reads now ends before any last line
        got = _read_to_end(s)
        assert b'"done":true' not in got and b"[DONE]" not in got
    finally:
        s.close()
    # bob's place is free again
    r = httpx.post(proxy.url + "/api/generate", headers={"Authorization": "Bearer sk-bob"}, timeout=60,
                   json={"model": ALIAS, "prompt": "hi", "stream": False})
    assert r.status_code == 200 and r.json()["done"], r.text
    # charged what it was sent, as a client that leaves (the ledger's row, written within its flush interval)
    deadline = time.monotonic() + 30
    while _bobs_output_tokens(proxy.url) < charged + 1000:
        assert time.monotonic() < deadline, f"bob was charged {_bobs_output_tokens(proxy.url) - charged} output tokens"
        time.sleep(0.1)
    text = httpx.get(proxy.url + "/metrics", headers={"Authorization": "Bearer sk-root"}).text
    counted = re.search(rf'^vllama_client_write_stalls_total\{{route="{re.escape(route)}"\}} (\S+)$', text, re.M)  # conftest.metric
    assert counted and float(counted.group(1)) >= 1, text[-2000:]  # reads no label with a brace in it
    # a client that reads, slowly, keeps its stream (the bound is on a stall, not on a slow reader)
    s = _ask(proxy.port, path, {**body, "prompt": "x [[tokens:30000]]"} if "prompt" in body else
             {**body, "messages": [{"role": "user", "content": "x [[tokens:10000]]"}]})
    try:
        got = bytearray()
        while chunk := s.recv(8192):
            got += chunk
            if got.endswith(b"0\r\n\r\n"):  # the chunked body's end
                break
            time.sleep(0.005)
    finally:
        s.close()
    assert b'"done":true' in got or b"data: [DONE]" in got, bytes(got[-300:])
    assert sum(e.get("event") == "client_write_stalled" for e in _log(log)) == stalled + 1


def _bobs_output_tokens(url: str) -> int:
    usage = httpx.get(url + "/api/usage", params={"key": "bob"}, headers={"Authorization": "Bearer sk-root"}).json()["usage"]
    return sum(row["output_tokens"] for row in usage)


def _log(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]


async def test_a_long_body_written_after_its_handler_is_bounded_too():
    """A non-streamed answer is written by aiohttp after its handler returned (the admission place is
    already free then, but the connection and its buffer are not): the same bound closes it."""
    from vllama_proxy.front.site import start_site

    body = b"x" * (32 << 20)  # more than the kernel's buffers on both sides hold

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/big", big)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    runner = await start_site(app, "127.0.0.1", port, write_timeout=0.5)
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    try:
        with capture_logs() as logs:
            await loop.sock_connect(s, ("127.0.0.1", port))
            await loop.sock_sendall(s, b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            deadline = loop.time() + 30  # a failure's bound: the stall fires 0.5-0.625 s after the buffers fill
            while not [e for e in logs if e["event"] == "client_write_stalled"]:
                assert loop.time() < deadline, logs
                await asyncio.sleep(0.02)
        line = next(e for e in logs if e["event"] == "client_write_stalled")
        assert line["route"] == "/big" and line["key"] == "-" and line["buffered"] > 0
        got = 0
        try:
            while chunk := await loop.sock_recv(s, 1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < len(body)  # the connection ended short of the body
    finally:
        s.close()
        await runner.cleanup()


class _Transport:
    """What a :class:`WriteStall` reads of a transport: its write buffer's size, and whether it was aborted."""

    def __init__(self) -> None:
        self.size = 100_000
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.size

    def abort(self) -> None:
        self.aborted = True


async def test_only_looks_with_nothing_taken_and_nothing_written_count_toward_a_stall():
    """The rule, look by look (``WriteStall._look``, driven by hand; its own timer set an hour off):
    a shrink (the client read) starts the count again; growth (vllama still writing, aiohttp not yet
    waiting on drain: a read may hide under it) does not count; the fourth unchanged look aborts."""
    from vllama_proxy.front.write_stall import WriteStall

    t = _Transport()
    watch = WriteStall(t, 4 * 3600.0, lambda: None)  # type: ignore[arg-type]
    try:
        with capture_logs() as logs:
            # grown, still, still (2), grown (not counted), shrunk (the client read: 0 again), still, still (2),
            # grown, still (3)
            for size in (120_000, 120_000, 120_000, 130_000, 120_000, 120_000, 120_000, 140_000, 140_000):
                t.size = size
                watch._look()
            assert not t.aborted and not logs
            watch._look()  # still: the fourth
        assert t.aborted
        assert [(e["event"], e["key"], e["route"], e["buffered"]) for e in logs] == [("client_write_stalled", "-", "other", 140_000)]
    finally:
        watch.close()
