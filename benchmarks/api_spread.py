"""How the connections to a vLLM server spread over its API-server processes (issue 28).

vLLM's ``--api-server-count N`` runs N API-server processes that accept from one listening
socket: each TCP connection is served, for its whole life, by the process that accepted it.
A keep-alive pool (vllama's workers) reuses its connections, so how many a client opens and
which process accepted each decides how the streams spread over the N processes. This tool
samples, while a load runs:

* per API-server pid: established connections to the port (mean and max over samples), the
  connections' streams split by client process (vllama worker pids, a load generator's), and
  the CPU seconds the process used over the window;
* per client pid: its connections to the port.

Library: :class:`Spread` (``start()`` / ``stop()`` -> a JSON-able dict). CLI::

    python benchmarks/api_spread.py --port 8100 --seconds 30 [--interval 0.5] [--json out.json]
    python benchmarks/api_spread.py --port 8100 --json out.json & ...load...; kill -INT $!   # until SIGINT/SIGTERM

Needs psutil and the right to see the processes' sockets (same user, or root).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from collections import Counter, defaultdict

import psutil


def listeners(port: int) -> list[int]:
    """The pids holding a listening TCP socket on ``port``: every one of vLLM's API servers holds the
    same socket (``psutil.net_connections`` names one holder per socket, so each process is asked)."""
    pids = []
    for proc in psutil.process_iter():
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.Error, OSError):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            pids.append(proc.pid)
    return sorted(pids)


def _cmd(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120]
    except psutil.Error:
        return "?"


def snapshot(port: int) -> tuple[Counter, Counter, Counter]:
    """One sample: (server pid -> established connections, client pid -> its connections,
    (server pid, client pid) -> connections)."""
    server_of: dict[int, int] = {}  # client-side port -> the server pid holding that connection
    client_of: dict[int, int] = {}  # client-side port -> the client pid
    for c in psutil.net_connections(kind="tcp"):
        if c.status != psutil.CONN_ESTABLISHED or not c.laddr or not c.raddr or not c.pid:
            continue
        if c.laddr.port == port:
            server_of[c.raddr.port] = c.pid
        elif c.raddr.port == port:
            client_of[c.laddr.port] = c.pid
    servers = Counter(server_of.values())
    clients = Counter(client_of.values())
    pairs = Counter((server_of[p], client_of.get(p, 0)) for p in server_of)
    return servers, clients, pairs


class Spread:
    """Samples :func:`snapshot` every ``interval`` s in a thread between ``start()`` and ``stop()``."""

    def __init__(self, port: int, interval: float = 0.5) -> None:
        self.port = port
        self.interval = interval
        self._stop = threading.Event()
        self._samples: list[tuple[Counter, Counter, Counter]] = []
        self._thread: threading.Thread | None = None
        self._servers: list[int] = []
        self._cpu0: dict[int, float] = {}
        self._t0 = 0.0

    def _cpu(self) -> dict[int, float]:
        out = {}
        for pid in self._servers:
            try:
                t = psutil.Process(pid).cpu_times()
                out[pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def start(self) -> Spread:
        self._servers = listeners(self.port)
        self._cpu0 = self._cpu()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._samples.append(snapshot(self.port))
            except psutil.Error:
                pass
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        """Stop sampling; the summary (see the module docstring)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        wall = time.monotonic() - self._t0
        cpu1 = self._cpu()
        n = max(len(self._samples), 1)
        servers: dict[int, dict] = {}
        clients_seen: set[int] = set()
        for pid in self._servers:
            counts = [s[0].get(pid, 0) for s in self._samples] or [0]
            by_client: dict[int, float] = defaultdict(float)
            for s in self._samples:
                for (spid, cpid), k in s[2].items():
                    if spid == pid:
                        by_client[cpid] += k / n
                        clients_seen.add(cpid)
            servers[pid] = {
                "conns_mean": round(sum(counts) / n, 1), "conns_max": max(counts),
                "cpu_s": round(cpu1.get(pid, 0.0) - self._cpu0.get(pid, 0.0), 2),
                "cpu_share": round((cpu1.get(pid, 0.0) - self._cpu0.get(pid, 0.0)) / max(wall, 1e-9), 3),
                "by_client_mean": {str(c): round(v, 1) for c, v in sorted(by_client.items())},
            }
        clients = {str(c): {"conns_mean": round(sum(s[1].get(c, 0) for s in self._samples) / n, 1), "cmd": _cmd(c)}
                   for c in sorted(clients_seen) if c}
        return {"port": self.port, "seconds": round(wall, 2), "samples": len(self._samples), "api_servers": servers,
                "clients": clients}


def table(summary: dict) -> str:
    """A markdown table of :meth:`Spread.stop`'s summary: one row per API-server process."""
    rows = ["| API server pid | conns mean | conns max | CPU s | CPU share | conns by client pid (mean) |", "|---|---|---|---|---|---|"]
    for pid, s in summary["api_servers"].items():
        by = ", ".join(f"{c}: {v}" for c, v in s["by_client_mean"].items())
        rows.append(f"| {pid} | {s['conns_mean']} | {s['conns_max']} | {s['cpu_s']} | {s['cpu_share']} | {by} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True, help="vLLM's port")
    ap.add_argument("--seconds", type=float, default=0.0, help="how long to sample (0: until SIGINT or SIGTERM)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    spread = Spread(args.port, args.interval).start()
    done.wait(args.seconds or None)
    summary = spread.stop()
    print(table(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
