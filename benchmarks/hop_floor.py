#!/usr/bin/env python3
"""Where a relay's share of a lone request's TTFT goes, on this host, without vLLM (issue 28).

One stub upstream (asyncio on uvloop, no HTTP library: it answers each request after
``--ttft-ms``, as vLLM's API server answers a lone request after prefill) listens on loopback
TCP and on a Unix socket. In front of it run bare aiohttp relays (``aiohttp_floor.py``'s
``/v1/completions``: bytes in, bytes out, one pooled upstream connection), one per upstream
transport; with ``--spin``, the same relays keeping their event loop awake while a request is in
flight; with ``--raw``, relays whose upstream client is hand-written (no aiohttp client). A blocking client sends one request at a time, rotating over the targets request
by request (no drift between targets), and reads the stub's clock from its first chunk, so each
request splits into:

* **forward**: client send -> the stub has the whole request (the relay's request path,
  including waking it up);
* **return**: the stub's first chunk sent -> the client has it (the relay's answer path);
* **TTFT**: client send -> first chunk (= forward + ttft-ms + return).

All clocks are ``time.monotonic_ns`` of one machine. Prints p50/p90 per target and the
difference to the direct target of the same transport; ``--json`` writes every sample.

    python benchmarks/hop_floor.py --n 400 --ttft-ms 20 [--spin] [--raw] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadgen import percentile  # this folder: the script's own

HERE = Path(__file__).resolve().parent


class _Stub(asyncio.Protocol):
    """HTTP/1.1 keep-alive answers: headers + the first chunk after ttft, the rest 1 ms later."""

    def __init__(self, ttft: float) -> None:
        self.ttft, self.buf, self.tr = ttft, b"", None

    def connection_made(self, tr) -> None:  # type: ignore[no-untyped-def]
        self.tr = tr
        s = tr.get_extra_info("socket")
        if s is not None and s.family != socket.AF_UNIX:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            n = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    n = int(v)
            if len(rest) < n:
                return
            self.buf = rest[n:]
            got = time.monotonic_ns()
            asyncio.get_running_loop().call_later(self.ttft, self._answer, got)

    def _answer(self, got: int) -> None:
        sent = time.monotonic_ns()
        event = b'data: {"got":%d,"sent":%d}\n\n' % (got, sent)
        self.tr.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                      + b"%x\r\n%s\r\n" % (len(event), event))
        done = b"data: [DONE]\n\n"
        asyncio.get_running_loop().call_later(0.001, self.tr.write, b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def _stub_main(port: int, path: str, ttft: float) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await loop.create_server(lambda: _Stub(ttft), "127.0.0.1", port)
        await loop.create_unix_server(lambda: _Stub(ttft), path)
        await asyncio.Event().wait()

    uvloop.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(addr: tuple[str, int] | str) -> None:
    for _ in range(200):
        try:
            fam = socket.AF_UNIX if isinstance(addr, str) else socket.AF_INET
            with socket.socket(fam) as s:
                s.connect(addr)
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {addr}")


class _Conn:
    """One keep-alive client connection; ``ask`` sends a request and returns (t0, got, sent, t3)."""

    def __init__(self, addr: tuple[str, int] | str) -> None:
        fam = socket.AF_UNIX if isinstance(addr, str) else socket.AF_INET
        self.s = socket.socket(fam)
        self.s.connect(addr)
        if fam == socket.AF_INET:
            self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = b'{"model":"m","prompt":"hi","max_tokens":2,"stream":true}'
        self.req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def ask(self) -> tuple[int, int, int, int]:
        t0 = time.monotonic_ns()
        self.s.sendall(self.req)
        buf, first = b"", None
        while True:
            data = self.s.recv(65536)
            if not data:
                raise SystemExit("connection closed")
            if first is None and b'"got":' in buf + data:
                first = time.monotonic_ns()
            buf += data
            if buf.endswith(b"0\r\n\r\n"):
                break
        i = buf.index(b'{"got":')
        d = json.loads(buf[i:buf.index(b"}", i) + 1])
        return t0, d["got"], d["sent"], first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=400, help="requests per target")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--spin", action="store_true", help="also relays that keep their loop awake while a request is in flight")
    p.add_argument("--raw", action="store_true", help="also relays whose upstream client is a hand-written HTTP/1.1 "
                   "exchange on one kept-open asyncio stream instead of aiohttp's client")
    p.add_argument("--json", help="write every sample here")
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="hop-floor-")
    uds = os.path.join(tmp, "stub.sock")
    port = _free_port()
    stub = f"import sys; sys.path.insert(0, {str(HERE)!r}); import hop_floor; hop_floor._stub_main({port}, {uds!r}, {a.ttft_ms / 1000})"
    procs = [subprocess.Popen([sys.executable, "-c", stub])]
    targets: dict[str, tuple[str, int] | str] = {"direct-tcp": ("127.0.0.1", port), "direct-uds": uds}
    relays = [("relay-tcp", f"http://127.0.0.1:{port}", []), ("relay-uds", f"unix:{uds}", [])]
    if a.spin:
        relays += [("spin-tcp", f"http://127.0.0.1:{port}", ["--spin"]), ("spin-uds", f"unix:{uds}", ["--spin"])]
    if a.raw:
        relays += [("raw-tcp", f"http://127.0.0.1:{port}", ["--raw-client"]), ("raw-uds", f"unix:{uds}", ["--raw-client"])]
    try:
        _wait(("127.0.0.1", port))
        _wait(uds)
        for name, up, extra in relays:
            rp = _free_port()
            procs.append(subprocess.Popen([sys.executable, str(HERE / "aiohttp_floor.py"), "--upstream", up, "--port", str(rp),
                                           *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            targets[name] = ("127.0.0.1", rp)
        for addr in targets.values():
            _wait(addr)
        conns = {k: _Conn(v) for k, v in targets.items()}
        for c in conns.values():  # warm-up: the relays open their pooled upstream connection
            for _ in range(20):
                c.ask()
        samples: dict[str, list[tuple[int, int, int, int]]] = {k: [] for k in conns}
        for i in range(a.n):
            order = list(conns)[i % len(conns):] + list(conns)[:i % len(conns)]
            for k in order:
                samples[k].append(conns[k].ask())
                time.sleep(0.002)
    finally:
        for pr in procs:
            pr.terminate()
    rows = {}
    for k, xs in samples.items():
        fwd = [(g - t0) / 1e3 for t0, g, s, t3 in xs]
        ret = [(t3 - s) / 1e3 for t0, g, s, t3 in xs]
        ttft = [(t3 - t0) / 1e3 for t0, g, s, t3 in xs]
        rows[k] = {name: (statistics.median(v), percentile(sorted(v), 90))
                   for name, v in (("forward_us", fwd), ("return_us", ret), ("ttft_us", ttft))}
    print(f"{a.n} requests per target, stub TTFT {a.ttft_ms} ms, host {os.cpu_count()} CPUs; µs, p50 / p90; "
          "Δ = p50 minus direct of the same upstream transport")
    print("| target | forward | return | TTFT | Δ TTFT p50 |\n|---|---|---|---|---|")
    for k, r in rows.items():
        base = rows["direct-uds" if k.endswith("uds") else "direct-tcp"]["ttft_us"][0]
        f = lambda v: f"{v[0]:.1f} / {v[1]:.1f}"
        print(f"| {k} | {f(r['forward_us'])} | {f(r['return_us'])} | {f(r['ttft_us'])} | {r['ttft_us'][0] - base:+.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "summary": rows, "samples": samples}))


if __name__ == "__main__":
    main()
