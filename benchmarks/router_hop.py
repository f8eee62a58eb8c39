#!/usr/bin/env python3
"""What vllm-router's hop costs (issue 43): the same streaming chat load sent to the workers directly
(the client spreading requests round robin over them) and through the router, in alternating blocks.

Per block and path: output tok/s, TTFT and ITL at the client, how the stream arrives (reads and bytes per
SSE event: does the hop re-chunk?), and the CPU of every process by kind (``benchmarks/loadgen.py``'s
``machine_cpu``: ``router``, ``vllm_api`` (a stand-in or vLLM's API servers), ``vllama``, ``client``) in
µs per output token. Summary: the median of each over the blocks, and the router-minus-direct difference of
the paired blocks (median, 95 % bootstrap interval of the mean). With stand-ins it also shows what a worker
receives through the router against a direct call (body fields, headers), the router's connections to the
workers (reused or one per request) and its threads, and the requests the workers get per chat (a policy
that asks every worker to render each chat first, ``cache_aware``, shows N+1).

Stand-ins (default; CPU only, tests/fake_vllm.py with ``FAKE_VLLM_TOKEN_DELAY``, the real ``vllm-router``
from the venv; its CPU set is whatever this process has)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router_hop.py [--workers 2] [--nodes] [--streams 64] [--tokens 64]
        [--token-delay 0.02] [--blocks 6] [--policy round_robin] [--router-arg=--flag ...] [--json PATH]

Running servers (a GPU fleet: each node's URL and the router's; no stand-ins, no capture)::

    python benchmarks/router_hop.py --direct http://127.0.0.1:11501,... --router http://127.0.0.1:30000 --model M

Summary of ``benchmarks/fleet.sh hop`` (loadgen JSONs ``hop-PATH-rROUND-TAG.json``; parallel loadgens of one run
summed: tok/s added, latencies the median of theirs, cores by kind from the first, machine-wide)::

    python benchmarks/router_hop.py --summarize-loadgen OUTDIR

Units: ms for latencies, µs of CPU (user+system) per output token, tokens per second.
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
import time
from typing import Any

import aiohttp
import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from loadgen import _kind, machine_cpu, make_session, percentile  # noqa: E402
from paired_stats import bootstrap  # noqa: E402

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def quantile(sorted_xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of an already sorted list: ``loadgen.percentile`` takes percent (this file
    passed 0.5 for the median until issue 43's turnaround work: its "p50" columns were the 0.5th percentile)."""
    return percentile(sorted_xs, 100 * q)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, seconds: float = 60) -> None:
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: process exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {seconds} s")


def start_standins(n: int, token_delay: float, model: str) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    env = dict(os.environ, FAKE_VLLM_TOKEN_DELAY=str(token_delay))
    urls, procs = [], []
    for _ in range(n):
        port = free_port()
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "bin", "vllm"), "serve", model,
                              "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        urls.append(f"http://127.0.0.1:{port}")
        procs.append(p)
    for u, p in zip(urls, procs):
        wait_http(u + "/health", p)
    return urls, procs


def start_nodes(n: int, token_delay: float, model: str) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """``n`` vllama nodes (``vllama serve --model``, one worker), each supervising its stand-in vLLM: the
    fleet's nodes, whose ``/v1`` passthrough the router calls."""
    import tempfile

    env = dict(os.environ, FAKE_VLLM_TOKEN_DELAY=str(token_delay), PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    urls, procs = [], []
    for _ in range(n):
        port = free_port()
        p = subprocess.Popen([sys.executable, "-m", "vllama_proxy", "serve", "--model", os.path.join(ROOT, "tests", "assets", "tool-model"),
                              "--served-model-name", model, "--port", str(port), "--workers", "1", "--keep-alive", "-1",
                              "--no-gpu-check", "--vllm-executable", os.path.join(ROOT, "tests", "bin", "vllm")],
                             env=dict(env, VLLAMA_STATE_DIR=tempfile.mkdtemp(prefix="router-hop-")),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        urls.append(f"http://127.0.0.1:{port}")
        procs.append(p)
    for u, p in zip(urls, procs):
        wait_http(u + "/readyz", p, 120)
    return urls, procs


def start_router(workers: list[str], policy: str, extra: list[str]) -> tuple[str, subprocess.Popen[bytes]]:
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    port, pport = free_port(), free_port()
    p = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(pport),
                          "--policy", policy, "--worker-urls", *workers, *extra],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/liveness", p)
    wait_http(url + "/readiness", p)
    return url, p


def body(model: str, i: int, tokens: int, words: int) -> bytes:
    prompt = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words)) + f" #{i}"
    return json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                       "max_tokens": tokens, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()


async def one(session: aiohttp.ClientSession, url: str, data: bytes) -> dict[str, Any]:
    """One streamed chat: TTFT (ms), ITLs (ms), reads, bytes and SSE events as the client receives them."""
    t0 = time.perf_counter()
    times: list[float] = []
    reads = nbytes = events = 0
    buf = b""
    async with session.post(url + "/v1/chat/completions", data=data,
                            headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.read())[:200]!r}"}
        async for chunk in r.content.iter_any():
            now = time.perf_counter()
            reads += 1
            nbytes += len(chunk)
            buf += chunk
            *evs, buf = buf.split(b"\n\n")
            for ev in evs:
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                events += 1
                if b'"content":"' in ev.replace(b": ", b":") and b'"content":""' not in ev.replace(b": ", b":"):
                    times.append(now)
    if not times:
        return {"error": "no tokens"}
    return {"ttft": (times[0] - t0) * 1e3, "itl": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
            "tokens": len(times), "reads": reads, "bytes": nbytes, "events": events}


def own_cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    """User+system CPU seconds so far of the given processes and their children by kind (a child's own kind
    when ``loadgen``'s ``_kind`` names one: a node's stand-in vLLM is ``vllm_api``, else its parent's), this
    process as ``client``: on a shared machine, only what this benchmark started counts."""
    out: dict[str, float] = {"client": sum(os.times()[:2])}

    def walk(proc: psutil.Process, kind: str) -> None:
        try:
            k = _kind(" ".join(proc.cmdline())) or kind
            c = proc.cpu_times()
            out[k] = out.get(k, 0.0) + c.user + c.system
            children = proc.children()
        except psutil.Error:
            return
        for ch in children:
            walk(ch, k)

    for kind, ps in pids.items():
        out.setdefault(kind, 0.0)
        for pid in ps:
            try:
                walk(psutil.Process(pid), kind)
            except psutil.Error:
                pass
    return out


def router_conns(pid: int | None, ports: set[int]) -> set[tuple[int, int]]:
    """(local port, remote port) of the router's established TCP connections to the workers."""
    if pid is None:
        return set()
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {(c.laddr.port, c.raddr.port) for c in conns if c.raddr and c.raddr.port in ports and c.status == "ESTABLISHED"}


async def block(session: aiohttp.ClientSession, targets: list[str], args: argparse.Namespace, seed: int,
                router_pid: int | None, worker_ports: set[int], pids: dict[str, list[int]] | None) -> dict[str, Any]:
    n = args.requests
    results: list[dict[str, Any]] = []
    nxt = 0
    seen: set[tuple[int, int]] = set()
    done = asyncio.Event()

    sampler_cpu = 0.0

    def sample_once() -> None:  # in a thread: psutil reads /proc/net/tcp*, slow enough to stall the event loop
        nonlocal sampler_cpu
        t = time.thread_time()
        seen.update(router_conns(router_pid, worker_ports))
        sampler_cpu += time.thread_time() - t  # not the client's cost per token: taken off below

    async def sample() -> None:
        while router_pid is not None and not done.is_set():
            await asyncio.to_thread(sample_once)
            try:
                await asyncio.wait_for(done.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    async def stream() -> None:
        nonlocal nxt
        while nxt < n:
            i = nxt
            nxt += 1
            results.append(await one(session, targets[i % len(targets)], body(args.model, seed * n + i, args.tokens, args.prompt_words)))

    sampler = asyncio.create_task(sample())
    cpu_now = (lambda: own_cpu(pids)) if pids else machine_cpu
    cpu0, t0 = cpu_now(), time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(args.streams)))
    wall = time.perf_counter() - t0
    done.set()
    await sampler  # (its last look's CPU is in sampler_cpu, taken off the client's)
    cpu1 = cpu_now()
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    itl = sorted(x for r in ok for x in r["itl"])
    ttft = sorted(r["ttft"] for r in ok)
    cpu = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in set(cpu0) | set(cpu1)}
    cpu["client"] = cpu.get("client", 0.0) - sampler_cpu
    return {
        "requests": n, "ok": len(ok), "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "wall_s": wall, "tok_s": tokens / wall,
        "ttft_p50": quantile(ttft, 0.5), "ttft_p90": quantile(ttft, 0.9),
        "itl_p50": quantile(itl, 0.5), "itl_p90": quantile(itl, 0.9), "itl_p99": quantile(itl, 0.99),
        "itl_mean": statistics.fmean(itl) if itl else None,
        "reads_per_event": sum(r["reads"] for r in ok) / max(1, sum(r["events"] for r in ok)),
        "bytes_per_event": sum(r["bytes"] for r in ok) / max(1, sum(r["events"] for r in ok)),
        "cores": {k: v / wall for k, v in cpu.items()},
        "us_per_token": {k: v / max(1, tokens) * 1e6 for k, v in cpu.items()},
        "router_conns_seen": len(seen),
    }


async def capture(session: aiohttp.ClientSession, workers: list[str], router: str, model: str) -> dict[str, Any]:
    """One chat sent straight to worker 0 and one through the router (to whichever worker it picks): what each
    worker recorded (``/_fake/requests``), compared."""
    for w in workers:
        await session.delete(w + "/_fake/requests")
    data = body(model, 0, 8, 16)
    await one(session, workers[0], data)
    direct = (await (await session.get(workers[0] + "/_fake/requests")).json())[-1]
    for w in workers:
        await session.delete(w + "/_fake/requests")
    await one(session, router, data)
    seen = []
    for w in workers:
        seen += await (await session.get(w + "/_fake/requests")).json()
    via = [r for r in seen if r["path"] == "/v1/chat/completions"][-1]
    db, vb = direct["body"], via["body"]
    return {
        "fields_added": {k: vb[k] for k in vb if k not in db},
        "fields_changed": {k: [db[k], vb[k]] for k in db if k in vb and db[k] != vb[k]},
        "fields_dropped": [k for k in db if k not in vb],
        "headers_direct": direct["headers"], "headers_via_router": via["headers"],
        "worker_requests_per_chat": {p: sum(1 for r in seen if r["path"] == p) for p in {r["path"] for r in seen}},
    }


def summarize(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in ("direct", "router"):
        bs = [b[path] for b in blocks]
        keys = ["tok_s", "ttft_p50", "itl_p50", "itl_p90", "itl_mean", "reads_per_event", "bytes_per_event"]
        out[path] = {k: statistics.median(b[k] for b in bs) for k in keys}
        kinds = sorted({k for b in bs for k in b["us_per_token"]})
        out[path]["us_per_token"] = {k: statistics.median(b["us_per_token"].get(k, 0.0) for b in bs) for k in kinds}
        out[path]["cores"] = {k: statistics.median(b["cores"].get(k, 0.0) for b in bs) for k in kinds}
    diffs: dict[str, Any] = {}
    for k in ("tok_s", "ttft_p50", "itl_p50", "itl_p90", "itl_mean"):
        d = [b["router"][k] - b["direct"][k] for b in blocks]
        diffs[k] = {"median": statistics.median(d), "mean_ci95": bootstrap(d, statistics.fmean, 2000, 0)}
    for kind in ("router", "vllm_api", "vllama", "client"):
        d = [b["router"]["us_per_token"].get(kind, 0.0) - b["direct"]["us_per_token"].get(kind, 0.0) for b in blocks]
        diffs[f"us_per_token.{kind}"] = {"median": statistics.median(d), "mean_ci95": bootstrap(d, statistics.fmean, 2000, 0)}
    out["router_minus_direct"] = diffs
    return out


def report(s: dict[str, Any], cap: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    lines = [f"router hop: {meta}"]
    if cap:
        lines.append(f"capture: fields the router adds to the body: {cap['fields_added']}; changed: "
                     f"{cap['fields_changed']}; dropped: {cap['fields_dropped']}")
        lines.append(f"capture: headers direct {sorted(cap['headers_direct'])} / via router {sorted(cap['headers_via_router'])}")
        lines.append(f"capture: requests at the workers for one chat through the router: {cap['worker_requests_per_chat']}")
    lines.append("| path | tok/s | TTFT p50 | ITL p50 | p90 | mean | reads/event | bytes/event | µs CPU/token by kind | cores by kind |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for path in ("direct", "router"):
        p = s[path]
        us = ", ".join(f"{k} {v:.0f}" for k, v in p["us_per_token"].items() if abs(v) >= 0.5)
        cores = ", ".join(f"{k} {v:.2f}" for k, v in p["cores"].items() if abs(v) >= 0.005)
        lines.append(f"| {path} | {p['tok_s']:.0f} | {p['ttft_p50']:.1f} | {p['itl_p50']:.1f} | {p['itl_p90']:.1f} | "
                     f"{p['itl_mean']:.1f} | {p['reads_per_event']:.2f} | {p['bytes_per_event']:.0f} | {us} | {cores} |")
    lines.append("router − direct, paired blocks (median; 95 % CI of the mean):")
    for k, d in s["router_minus_direct"].items():
        lo, hi = d["mean_ci95"]
        lines.append(f"  {k}: {d['median']:+.2f} ({lo:+.2f} .. {hi:+.2f})")
    return "\n".join(lines)


def summarize_loadgen(folder: str) -> str:
    """A table of ``fleet.sh hop``'s runs: per path (vllm, node, router, front) and round, the output tok/s of
    its loadgens together (``alone``: one node's vLLM by itself), TTFT/TPOT/ITL p50 (median over its loadgens), and the machine's cores busy and CPU
    µs per output token by process kind."""
    import glob
    import re

    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for f in sorted(glob.glob(os.path.join(folder, "hop-*-r*-*.json"))):
        m = re.match(r"hop-(\w+)-r(\d+)-(\w+)\.json$", os.path.basename(f))
        if m:
            runs.setdefault((m.group(1), int(m.group(2))), []).append(json.load(open(f))["levels"][0]["runs"][0])
    kinds = ["client", "other", "router", "vllama_front", "vllama", "vllm_api", "vllm_engine"]
    lines = ["| path | round | loadgens | ok / requests | output tok/s | TTFT p50 / p90 | TPOT p50 | ITL p50 | cores busy: "
             + " / ".join(kinds) + " | µs CPU per token: " + " / ".join(kinds) + " | wall s |", "|" + "---|" * 11]
    order = {"alone": 0, "vllm": 1, "node": 2, "router": 3, "front": 4}
    for (path, r), rs in sorted(runs.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        tok = sum(x["output_tok_s"] for x in rs)
        med = lambda key, q: statistics.median(x[key][q] for x in rs)  # noqa: E731
        cores = rs[0].get("machine_cores") or {}
        # the other loadgens of a parallel run are "other" in the first one's machine-wide view: count them as client
        wall = max(x["wall_s"] for x in rs)
        client = sum(x["client_cpu_util"] for x in rs)
        c = {k: cores.get(k, 0.0) for k in kinds}
        c["other"] = max(0.0, c["other"] - (client - c["client"]))
        c["client"] = client
        lines.append(f"| {path} | {r} | {len(rs)} | {sum(x['ok'] for x in rs)} / {sum(x['requests'] for x in rs)} | {tok:,.0f} | "
                     f"{med('ttft_ms', 'p50'):.0f} / {med('ttft_ms', 'p90'):.0f} | {med('tpot_ms', 'p50'):.1f} | {med('itl_ms', 'p50'):.1f} | "
                     + " / ".join(f"{c[k]:.1f}" for k in kinds) + " | " + " / ".join(f"{c[k] / tok * 1e6:.0f}" for k in kinds)
                     + f" | {wall:.1f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="stand-in vLLMs to start")
    p.add_argument("--token-delay", type=float, default=0.02, help="stand-ins: s per token")
    p.add_argument("--nodes", action="store_true", help="the workers are vllama nodes (vllama serve --model, one worker "
                   "each) supervising the stand-ins, as in the fleet: direct means each node's /v1 passthrough")
    p.add_argument("--direct", default="", help="running workers' URLs, comma-separated (no stand-ins started)")
    p.add_argument("--router", default="", help="a running router's URL (with --direct)")
    p.add_argument("--model", default="m")
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--router-arg", action="append", default=[], help="extra vllm-router flag (repeatable; --router-arg=--x)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--requests", type=int, default=0, help="requests per block (default 3 x streams)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=128)
    p.add_argument("--blocks", type=int, default=6, help="pairs of blocks (direct, router), the order alternating")
    p.add_argument("--json", default=None)
    p.add_argument("--summarize-loadgen", metavar="DIR", default=None, help="only print the table of fleet.sh hop's runs in DIR")
    a = p.parse_args(argv)
    a.requests = a.requests or 3 * a.streams
    return a


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    router_pid = None
    pids: dict[str, list[int]] | None = None  # stand-ins: the CPU of our own processes only
    try:
        if args.direct:
            workers, router = args.direct.split(","), args.router
            router_pid = next((p.pid for p in psutil.process_iter(["cmdline"]) if "vllm-router" in " ".join(p.info["cmdline"] or [])), None)
        else:
            start = start_nodes if args.nodes else start_standins
            workers, procs = start(args.workers, args.token_delay, args.model)
            router, rp = start_router(workers, args.policy, args.router_arg)
            procs.append(rp)
            router_pid = rp.pid
            pids = {"vllama" if args.nodes else "vllm_api": [p.pid for p in procs[:-1]], "router": [rp.pid]}
        ports = {int(w.rsplit(":", 1)[1].split("/")[0]) for w in workers}
        async with make_session() as session:
            cap = None if args.direct or args.nodes else await capture(session, workers, router, args.model)
            for t in (workers, [router]):  # warm both paths' connections
                await asyncio.gather(*(one(session, t[i % len(t)], body(args.model, -1 - i, 4, 8)) for i in range(8)))
            threads = len(psutil.Process(router_pid).threads()) if router_pid else None
            blocks = []
            for b in range(args.blocks):
                order = ("direct", "router") if b % 2 == 0 else ("router", "direct")
                pair = {}
                for path in order:
                    pair[path] = await block(session, workers if path == "direct" else [router], args, 2 * b + (path == "router"),
                                             router_pid if path == "router" else None, ports, pids)
                    print(f"block {b} {path}: {pair[path]['tok_s']:.0f} tok/s, ITL p50 {pair[path]['itl_p50']:.1f} ms, "
                          f"µs/tok {({k: round(v) for k, v in pair[path]['us_per_token'].items() if abs(v) >= 0.5})}, "
                          f"router conns {pair[path]['router_conns_seen']}, errors {pair[path]['errors']}", flush=True)
                blocks.append(pair)
        meta = {"workers": len(workers), "nodes": "vllama" if args.nodes else "stand-in", "streams": args.streams, "requests_per_block": args.requests,
                "tokens": args.tokens, "policy": args.policy if not args.direct else "(running router)",
                "token_delay_s": None if args.direct else args.token_delay, "router_threads": threads,
                "cpus": len(os.sched_getaffinity(0))}
        s = summarize(blocks)
        return {"meta": meta, "capture": cap, "summary": s, "blocks": blocks, "report": report(s, cap, meta)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize_loadgen:
        print(summarize_loadgen(args.summarize_loadgen))
        return 0
    out = asyncio.run(main_async(args))
    print(out["report"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
