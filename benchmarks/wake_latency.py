#!/usr/bin/env python3
"""What one more process on a request's path costs on this host: a loopback TCP round trip between
two processes, back to back (both awake) and with a pause before each (the echoing process and
its CPU idle in between, as vllama's worker is between two requests at c = 1), issue 28.

A proxy adds one such hop each way to a request's first token: on a VM whose idle vCPUs are slow
to wake (a halt exits to the hypervisor, an IPI wakes it), the paused round trip is the price of
the hop, and only the host can lower it. Usage: wake_latency.py [--n 400] [--pause-ms 5] [--json OUT]
Prints p50 / p90 / p99 round-trip µs of each mode.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import time


def _echo(port: int) -> None:
    srv = socket.create_server(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--pause-ms", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    port = _free_port()
    p = multiprocessing.get_context("spawn").Process(target=_echo, args=(port,), daemon=True)
    p.start()
    for _ in range(200):
        try:
            c = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.02)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = {}
    for mode, pause in (("hot", 0.0), ("after_pause", args.pause_ms / 1000)):
        rtts = []
        for _ in range(args.n):
            if pause:
                time.sleep(pause)
            t = time.perf_counter_ns()
            c.sendall(b"x")
            c.recv(64)
            rtts.append((time.perf_counter_ns() - t) / 1000)
        out[mode] = {"p50_us": round(statistics.median(rtts), 1), "p90_us": round(_pct(rtts, 0.9), 1),
                     "p99_us": round(_pct(rtts, 0.99), 1)}
        print(f"loopback round trip, {mode:<11}: p50 {out[mode]['p50_us']} µs, p90 {out[mode]['p90_us']} µs, p99 {out[mode]['p99_us']} µs")
    c.close()
    p.join(2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
