#!/usr/bin/env python3
"""Where a closed-loop stream's time between two engines goes under ``sticky_least_loaded`` with
one-request keys (issue 43): the client, the front, the router's session table, or its releases.

On the GPU (4x H100, 1,024 streams through the front) placement by load (the front's ``--request-sessions
on`` before ``sticky_least_loaded``) had each engine running 191-251 of its 256 with none waiting, so
~100-200 streams were between engines at any time, and TTFT p50 was twice round robin's. This benchmark
starts, on one machine, stand-in vLLMs (``tests/fake_vllm.py``, ``FAKE_VLLM_TOKEN_DELAY``, which stamps
each request's arrival), the real ``vllm-router`` twice over the same stand-ins (``round_robin`` and
``sticky_least_loaded``) and ``vllama serve --upstream`` fronts before them, and sends the same
closed-loop streaming chat load along each path in turn (blocks, the order rotating):

  ``rr``          client -> router round_robin (OpenAI chat, no key)
  ``sll``         client -> router sticky_least_loaded, each request under a key of its own
                  (``X-Session-ID``) and ``POST /finish_session`` for it when its stream ends (not awaited:
                  what the front does), so the router alone, without the front
  ``sll-nokey``   client -> router sticky_least_loaded, no key (placed, not counted)
  ``front-rr``    client -> front (``--request-sessions off``) -> router round_robin (Ollama chat)
  ``front-on``    client -> front (``--session-key system --request-sessions on``) -> sticky_least_loaded
  ``front-off``   client -> front (``--session-key system --request-sessions off``) -> sticky_least_loaded
                  (each chat's conversation key, never released)

Per block and path, from the client's clock and the stand-ins' (``time.monotonic()``: CLOCK_MONOTONIC, one
clock for every process): TTFT; ``to_worker`` (the client sent it -> the stand-in read its headers: the
front and the router on the way in); ``turnaround`` (a stream's previous answer ended at the client ->
its next request reached a stand-in: what an engine sees as the gap between two requests of a closed-loop
client); ``gap`` (the client's own part: end -> next send); the requests per stand-in and the most any
one had in flight (sampled); the CPU (user+system) of this benchmark's processes by kind per request
(``router``, ``vllama_front``, ``vllm_api`` the stand-ins, ``client``). Summary: the median over blocks of
each, and each path minus ``--baseline`` over the paired blocks (median, 95 % bootstrap CI of the mean).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/session_turnaround.py [--paths rr,sll,front-rr,front-on,front-off]
        [--workers 2] [--streams 32] [--requests 0 (4 x streams)] [--tokens 32] [--token-delay 0.02]
        [--blocks 4] [--front-workers 1] [--baseline front-rr] [--json PATH]
        [--base-root DIR --paths front-on@base,front-on,...]   (a front of another checkout, e.g. main, paired)

The same question asked of a GPU run's logs (``benchmarks/fleet.sh throughput``: the fronts' and the nodes'
access logs, ``front*.log[.gz]`` and ``a.log[.gz]``, ``b``, ... in DIR): per run, the requests in flight at the front
against those at the nodes every 5 ms (each access line's end time less its duration), so by Little's law the
time a request spends between the front and a node (both ways), the episodes where many were between them (a
connect whose SYN was dropped waits 1 s, then 2 s more), and how bursty the nodes' arrivals were::

    python benchmarks/session_turnaround.py --from-logs DIR

Whether connects were dropped at a full listen queue (a burst of new connections: a run's first wave), while a
run goes on: every 100 ms (plus the look's own time) each listening port's accept queue (``/proc/net/tcp*``, LISTEN: ``rx_queue``), its
backlog (``ss -ltn``: Send-Q) and the kernel's ``TcpExt`` ``ListenOverflows``/``ListenDrops``/``SyncookiesSent``
counted over the watch (``/proc/net/netstat``; the whole network namespace), and the connections seen to each
port (distinct remote ends: a pool's connections, new ones included); 0 seconds: until SIGTERM::

    python benchmarks/session_turnaround.py --listen-watch SECONDS --ports 30000,11501,11502

A fresh ``vllm-router`` (no workers) met by a burst of first requests as a front's workers send them at a run's
start: PROCS processes, each opening its own connections with vllama's ``Upstream`` and sending N / PROCS
``GET /list_workers`` at one instant; per checkout (this one, and ``--base-root``'s first when given), how many
were answered after 0.9 s (a SYN dropped at the router's full listen queue waits 1 s for the kernel), the
kernel's ``ListenOverflows`` over the burst, the router's backlog::

    python benchmarks/session_turnaround.py --connect-burst 1024 --procs 8 [--base-root DIR]

Units: ms for times, ms of CPU per request, tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from loadgen import make_session, percentile  # noqa: E402
from paired_stats import bootstrap  # noqa: E402
from router_hop import WORDS, free_port, own_cpu, start_router, start_standins, wait_http  # noqa: E402

PATHS = {  # name: (router policy, front flags or None (no front), how the client sends)
    "rr": ("round_robin", None, "openai"),
    "sll": ("sticky_least_loaded", None, "openai+key"),
    "sll-nokey": ("sticky_least_loaded", None, "openai"),
    "front-rr": ("round_robin", ["--session-key", "system", "--request-sessions", "off"], "ollama"),
    "front-on": ("sticky_least_loaded", ["--session-key", "system", "--request-sessions", "on"], "ollama"),
    "front-off": ("sticky_least_loaded", ["--session-key", "system", "--request-sessions", "off"], "ollama"),
}
KINDS = ("router", "vllama_front", "vllm_api", "client")


def kind(path: str) -> str:
    """A path's kind: ``front-on@base`` is ``front-on`` with the front run from ``--base-root``'s checkout."""
    return path.split("@", 1)[0]


def start_front(router: str, flags: list[str], model: str, workers: int, root: str = ROOT) -> tuple[str, subprocess.Popen[bytes]]:
    """``vllama serve --upstream router`` with ``flags`` (the package of the checkout at ``root``: PYTHONPATH)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=root, HF_HUB_OFFLINE="1", VLLAMA_STATE_DIR=tempfile.mkdtemp(prefix="turnaround-"))
    p = subprocess.Popen([sys.executable, "-m", "vllama_proxy", "serve", "--upstream", router, "--port", str(port),
                          "--workers", str(workers), "--log-level", "warning", *flags],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz", p, 60)
    return url, p


def prompt(tag: str, words: int) -> str:
    return f"{tag} " + " ".join(WORDS[(hash(tag) + k) % len(WORDS)] for k in range(words))


async def one(session: aiohttp.ClientSession, url: str, how: str, model: str, tag: str, args: argparse.Namespace,
              releases: set[asyncio.Task[Any]]) -> dict[str, Any]:
    """One streamed chat tagged ``tag`` (first word of its prompt): send, first token and end times (monotonic s)."""
    text = prompt(tag, args.prompt_words)
    headers = {"Content-Type": "application/json"}
    if how == "ollama":
        path = "/api/chat"
        body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
                "options": {"num_predict": args.tokens, "ignore_eos": True}}
    else:
        path = "/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
                "max_tokens": args.tokens, "ignore_eos": True}
    key = None
    if how == "openai+key":
        key = "r" + os.urandom(16).hex()
        headers["X-Session-ID"] = key
    sent = time.monotonic()
    first = None
    tokens = 0
    try:
        async with session.post(url + path, data=json.dumps(body).encode(), headers=headers) as r:
            if r.status != 200:
                return {"tag": tag, "error": f"HTTP {r.status}: {(await r.read())[:200]!r}"}
            async for chunk in r.content.iter_any():
                c = chunk.replace(b": ", b":")
                n = c.count(b'"content":"') - c.count(b'"content":""')
                if n > 0:
                    tokens += n
                    if first is None:
                        first = time.monotonic()
    except aiohttp.ClientError as e:
        return {"tag": tag, "error": type(e).__name__}
    end = time.monotonic()
    if key is not None:  # released once its stream ended, not awaited (the front's RouterRelease)
        t = asyncio.ensure_future(session.post(url + "/finish_session", params={"session_id": key}))
        releases.add(t)
        t.add_done_callback(releases.discard)
    if first is None:
        return {"tag": tag, "error": "no tokens"}
    return {"tag": tag, "sent": sent, "first": first, "end": end, "tokens": tokens}


def router_clients(pid: int, port: int) -> set[int]:
    """The remote ports of the router's connections on its own ``port``: one per client connection (a front's
    pooled connection, or this benchmark's), so new ones over a block are connections opened."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {c.raddr.port for c in conns if c.raddr and c.laddr.port == port}


async def block(session: aiohttp.ClientSession, path: str, target: str, workers: list[str], args: argparse.Namespace,
                seed: int, pids: dict[str, list[int]], router: tuple[int, int]) -> dict[str, Any]:
    how = PATHS[kind(path)][2]
    n, streams = args.requests, args.streams
    for w in workers:
        await session.delete(w + "/_fake/requests")
    results: list[dict[str, Any]] = []
    per_stream: dict[int, list[dict[str, Any]]] = {s: [] for s in range(streams)}
    releases: set[asyncio.Task[Any]] = set()
    nxt = 0
    done = asyncio.Event()
    peaks = [0] * len(workers)
    seen: set[int] = set()

    async def look() -> None:  # the router's client connections, in a thread (psutil reads /proc/net/tcp: slow)
        while not done.is_set():
            seen.update(await asyncio.to_thread(router_clients, *router))
            try:
                await asyncio.wait_for(done.wait(), 0.1)
            except asyncio.TimeoutError:
                pass

    async def sample() -> None:  # the most requests in flight at each stand-in
        while not done.is_set():
            for i, w in enumerate(workers):
                try:
                    async with session.get(w + "/_fake/stats") as r:
                        peaks[i] = max(peaks[i], (await r.json())["in_flight"])
                except aiohttp.ClientError:
                    pass
            try:
                await asyncio.wait_for(done.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    async def stream(s: int) -> None:
        nonlocal nxt
        while nxt < n:
            i = nxt
            nxt += 1
            r = await one(session, target, how, args.model, f"q{seed}x{i}", args, releases)
            r["stream"] = s
            results.append(r)
            per_stream[s].append(r)

    before = await asyncio.to_thread(router_clients, *router)
    sampler, looker = asyncio.create_task(sample()), asyncio.create_task(look())
    cpu0, t0 = own_cpu(pids), time.perf_counter()
    await asyncio.gather(*(stream(s) for s in range(streams)))
    if releases:
        await asyncio.gather(*releases, return_exceptions=True)
    wall = time.perf_counter() - t0
    cpu1 = own_cpu(pids)
    done.set()
    await sampler
    await looker
    arrived: dict[str, tuple[float, int]] = {}
    for wi, w in enumerate(workers):
        async with session.get(w + "/_fake/requests") as r:
            for rec in await r.json():
                if rec["path"] != "/v1/chat/completions" or not isinstance(rec["body"], dict):
                    continue
                msgs = rec["body"].get("messages") or []
                text = msgs[-1].get("content", "") if msgs else ""
                if isinstance(text, str) and text:
                    arrived[text.split(" ", 1)[0]] = (rec["arrived"], wi)
    ok = [r for r in results if "error" not in r]
    ttft = sorted((r["first"] - r["sent"]) * 1e3 for r in ok)
    to_worker = sorted((arrived[r["tag"]][0] - r["sent"]) * 1e3 for r in ok if r["tag"] in arrived)
    turnaround, gap = [], []
    for rs in per_stream.values():
        for prev, cur in zip(rs, rs[1:]):
            if "error" in prev or "error" in cur or cur["tag"] not in arrived:
                continue
            turnaround.append((arrived[cur["tag"]][0] - prev["end"]) * 1e3)
            gap.append((cur["sent"] - prev["end"]) * 1e3)
    turnaround.sort()
    gap.sort()
    per_worker = [sum(1 for r in ok if arrived.get(r["tag"], (0, -1))[1] == wi) for wi in range(len(workers))]
    cpu = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in KINDS}
    tokens = sum(r["tokens"] for r in ok)
    q = lambda xs, p: percentile(xs, p)  # noqa: E731 - loadgen's percentile takes percent
    return {
        "requests": n, "ok": len(ok), "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "wall_s": wall, "tok_s": tokens / wall, "req_s": len(ok) / wall,
        "ttft_p50": q(ttft, 50), "ttft_p90": q(ttft, 90),
        "to_worker_p50": q(to_worker, 50), "to_worker_p90": q(to_worker, 90), "to_worker_max": max(to_worker, default=None),
        # a connect whose SYN was dropped (a listen queue full) is sent again after 1 s (Linux's initial RTO)
        "to_worker_over_900ms": sum(1 for x in to_worker if x > 900),
        "turnaround_p50": q(turnaround, 50), "turnaround_p90": q(turnaround, 90),
        "turnaround_mean": statistics.fmean(turnaround) if turnaround else None,
        "gap_p50": q(gap, 50), "gap_p90": q(gap, 90),
        "matched": len(to_worker), "router_connections_new": len(seen - before), "router_connections_seen": len(seen), "per_worker": per_worker, "peak_in_flight": peaks,
        "cpu_ms_per_request": {k: v / max(1, len(ok)) * 1e3 for k, v in cpu.items()},
        "cores": {k: v / wall for k, v in cpu.items()},
    }


METRICS = ["tok_s", "ttft_p50", "ttft_p90", "to_worker_p50", "to_worker_p90", "turnaround_p50", "turnaround_p90",
           "turnaround_mean", "gap_p50"]


def summarize(blocks: list[dict[str, dict[str, Any]]], baseline: str) -> dict[str, Any]:
    paths = list(blocks[0])
    out: dict[str, Any] = {}
    for p in paths:
        bs = [b[p] for b in blocks]
        out[p] = {k: statistics.median(b[k] for b in bs if b[k] is not None) for k in METRICS}
        out[p]["cpu_ms_per_request"] = {k: statistics.median(b["cpu_ms_per_request"][k] for b in bs) for k in KINDS}
        out[p]["per_worker"] = [sum(b["per_worker"][i] for b in bs) for i in range(len(bs[0]["per_worker"]))]
        out[p]["peak_in_flight"] = [max(b["peak_in_flight"][i] for b in bs) for i in range(len(bs[0]["peak_in_flight"]))]
        out[p]["router_connections_new"] = statistics.median(b["router_connections_new"] for b in bs)
        out[p]["ok"] = sum(b["ok"] for b in bs)
        out[p]["requests"] = sum(b["requests"] for b in bs)
    diffs: dict[str, Any] = {}
    if baseline in paths:
        for p in paths:
            if p == baseline:
                continue
            d: dict[str, Any] = {}
            for k in ("ttft_p50", "to_worker_p50", "turnaround_p50", "turnaround_mean"):
                xs = [b[p][k] - b[baseline][k] for b in blocks if b[p][k] is not None and b[baseline][k] is not None]
                d[k] = {"median": statistics.median(xs), "mean_ci95": bootstrap(xs, statistics.fmean, 2000, 0)} if xs else None
            for kind in KINDS:
                xs = [b[p]["cpu_ms_per_request"][kind] - b[baseline]["cpu_ms_per_request"][kind] for b in blocks]
                d[f"cpu.{kind}"] = {"median": statistics.median(xs), "mean_ci95": bootstrap(xs, statistics.fmean, 2000, 0)}
            diffs[p] = d
    out["minus_baseline"] = diffs
    return out


def report(s: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"session turnaround: {meta}",
             "| path | ok / requests | tok/s | TTFT p50 / p90 | to worker p50 / p90 | turnaround p50 / p90 / mean | client gap p50 "
             "| CPU ms per request: router / front / stand-ins / client | connections opened to the router | requests per stand-in | peak in flight |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, v in s.items():
        if p == "minus_baseline":
            continue
        c = v["cpu_ms_per_request"]
        lines.append(f"| {p} | {v['ok']} / {v['requests']} | {v['tok_s']:.0f} | {v['ttft_p50']:.1f} / {v['ttft_p90']:.1f} | "
                     f"{v['to_worker_p50']:.1f} / {v['to_worker_p90']:.1f} | {v['turnaround_p50']:.1f} / {v['turnaround_p90']:.1f} / "
                     f"{v['turnaround_mean']:.1f} | {v['gap_p50']:.2f} | "
                     + " / ".join(f"{c[k]:.2f}" for k in KINDS) + f" | {v['router_connections_new']:.0f} | {v['per_worker']} | {v['peak_in_flight']} |")
    if s["minus_baseline"]:
        lines.append(f"minus {meta['baseline']}, paired blocks (median; 95 % CI of the mean):")
        for p, d in s["minus_baseline"].items():
            parts = []
            for k, x in d.items():
                if x is not None:
                    lo, hi = x["mean_ci95"]
                    parts.append(f"{k} {x['median']:+.2f} ({lo:+.2f} .. {hi:+.2f})")
            lines.append(f"  {p}: " + "; ".join(parts))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--paths", default="rr,sll,front-rr,front-on,front-off", help=f"comma-separated, of {sorted(PATHS)}")
    p.add_argument("--workers", type=int, default=2, help="stand-in vLLMs")
    p.add_argument("--token-delay", type=float, default=0.02, help="stand-ins: s per token")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--requests", type=int, default=0, help="requests per block (default 4 x streams)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--blocks", type=int, default=4, help="rounds; each runs every path once, the order rotating")
    p.add_argument("--front-workers", type=int, default=1, help="each front's --workers")
    p.add_argument("--base-root", default=None, help="another checkout (e.g. `git archive main | tar -x -C DIR`): "
                   "a path named KIND@base runs its front from there, paired with this checkout's")
    p.add_argument("--baseline", default="front-rr", help="the path the others are paired against")
    p.add_argument("--model", default="m")
    p.add_argument("--json", default=None)
    p.add_argument("--from-logs", metavar="DIR", default=None, help="only print the table of a fleet.sh run's logs in DIR")
    p.add_argument("--listen-watch", metavar="SECONDS", type=float, default=None,
                   help="only watch the listen queues of --ports for SECONDS (beside a run)")
    p.add_argument("--ports", default="", help="with --listen-watch: listening ports, comma-separated")
    p.add_argument("--connect-burst", metavar="N", type=int, default=None,
                   help="only send N first requests at once to a fresh vllm-router from --procs processes")
    p.add_argument("--procs", type=int, default=8, help="with --connect-burst: processes (a front's workers)")
    a = p.parse_args(argv)
    a.requests = a.requests or 4 * a.streams
    unknown = {kind(x) for x in a.paths.split(",")} - set(PATHS)
    if unknown:
        p.error(f"unknown paths {sorted(unknown)}")
    if any(x.endswith("@base") for x in a.paths.split(",")) and not a.base_root:
        p.error("a path@base needs --base-root")
    return a


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    paths = args.paths.split(",")
    # as fleet.sh and `vllama serve --router` run it: sticky_least_loaded's two info lines per one-request key off
    os.environ.setdefault("RUST_LOG", "info,vllm_router_rs::policies::sticky_least_loaded=warn")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        workers, standins = start_standins(args.workers, args.token_delay, args.model)
        procs += standins
        routers: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        for policy in sorted({PATHS[kind(p)][0] for p in paths}):
            routers[policy] = start_router(workers, policy, [])
            procs.append(routers[policy][1])
        targets: dict[str, str] = {}
        fronts: list[subprocess.Popen[bytes]] = []
        for p in paths:
            policy, flags, _ = PATHS[kind(p)]
            if flags is None:
                targets[p] = routers[policy][0]
            else:
                root = args.base_root if p.endswith("@base") else ROOT
                targets[p], fp = start_front(routers[policy][0], flags, args.model, args.front_workers, root)
                procs.append(fp)
                fronts.append(fp)
        pids = {"vllm_api": [p.pid for p in standins], "router": [r[1].pid for r in routers.values()],
                "vllama_front": [p.pid for p in fronts]}
        blocks: list[dict[str, dict[str, Any]]] = []
        async with make_session() as session:
            for p in paths:  # warm every path's connections
                await asyncio.gather(*(one(session, targets[p], PATHS[kind(p)][2], args.model, f"w{p}{i}", args, set())
                                       for i in range(4)))
            for b in range(args.blocks):
                order = paths[b % len(paths):] + paths[:b % len(paths)]
                pair: dict[str, dict[str, Any]] = {}
                for p in order:
                    url, rp = routers[PATHS[kind(p)][0]]
                    pair[p] = await block(session, p, targets[p], workers, args, b * 100 + paths.index(p), pids,
                                          (rp.pid, int(url.rsplit(":", 1)[1])))
                    r = pair[p]
                    print(f"block {b} {p}: " + ", ".join(f"{k} {_fmt(r[k])}" for k in (
                        "ok", "tok_s", "ttft_p50", "to_worker_p50", "to_worker_max", "to_worker_over_900ms", "turnaround_p50",
                        "turnaround_p90", "router_connections_new", "per_worker", "peak_in_flight", "errors")), flush=True)
                blocks.append({p: pair[p] for p in paths})
        meta = {"paths": paths, "stand-ins": args.workers, "streams": args.streams, "requests_per_block": args.requests,
                "tokens": args.tokens, "token_delay_s": args.token_delay, "front_workers": args.front_workers,
                "blocks": args.blocks, "baseline": args.baseline, "cpus": len(os.sched_getaffinity(0)),
                "load_avg": os.getloadavg()}
        s = summarize(blocks, args.baseline)
        return {"meta": meta, "summary": s, "blocks": blocks, "report": report(s, meta)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _access(path: str, route: str) -> list[tuple[float, float]]:
    """``(start, end)`` in Unix seconds of each ``POST route`` in a vllama JSON log (``.gz`` or not): its
    access line's ``timestamp`` (written as the answer ended) less its ``duration_ms``."""
    import datetime
    import gzip

    out = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if d.get("event") != "request" or d.get("path") != route or d.get("method") != "POST":
                continue
            end = datetime.datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append((end - d["duration_ms"] / 1e3, end))
    return out


def _in_flight(reqs: list[tuple[float, float]], ts: list[float]) -> list[int]:
    import bisect

    starts, ends = sorted(r[0] for r in reqs), sorted(r[1] for r in reqs)
    return [bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t) for t in ts]


def from_logs(folder: str, step: float = 0.005) -> str:
    """The table of ``--from-logs``: one row per run (the front's chat requests, runs apart by > 2 s idle)."""
    import glob

    def logs(pattern: str) -> list[str]:
        return sorted(glob.glob(os.path.join(folder, pattern + ".log.gz")) or glob.glob(os.path.join(folder, pattern + ".log")))

    front = sorted(r for f in logs("front*") for r in _access(f, "/api/chat"))
    nodes = {os.path.basename(f).split(".")[0]: _access(f, "/v1/chat/completions") for f in logs("[a-h]")}
    runs: list[list[tuple[float, float]]] = []
    last_end = None
    for r in front:
        if last_end is None or r[0] - last_end > 2:
            runs.append([])
        runs[-1].append(r)
        last_end = max(last_end or r[1], r[1])
    lines = [f"{folder}: nodes {sorted(nodes)}; in flight sampled every {step * 1e3:.0f} ms",
             "steady part (from the front's first reaching 90 % of its most in flight to the last start); episodes over the whole run",
             "| run | requests | start (UTC) | req/s | in flight at the front / at the nodes (mean), per node | front - nodes: mean, p50, max; outside episodes: mean, max "
             "| -> ms per request between front and node | episodes (>= 50 between them for >= 0.5 s): at s, for s, how many "
             "| node arrivals per 50 ms: CV, max |", "|" + "---|" * 8]
    for i, run in enumerate(r for r in runs if len(r) > 100):
        t0, t1 = run[0][0], max(e for _, e in run)
        mine = {n: [x for x in v if t0 - 1 <= x[0] <= t1] for n, v in nodes.items()}
        ts = [t0 + k * step for k in range(int((t1 - t0) / step))]
        f = _in_flight(run, ts)
        per = {n: _in_flight(v, ts) for n, v in mine.items()}
        n = [sum(x) for x in zip(*per.values())] if per else [0] * len(ts)
        gap = [a - b for a, b in zip(f, n)]
        episodes, start, stalled = [], None, [False] * len(ts)
        for k, (t, g) in enumerate(zip(ts + [t1], gap + [0])):
            if g >= 50 and start is None:
                start, first, most = t, k, g
            elif g >= 50:
                most = max(most, g)
            elif start is not None:
                if t - start >= 0.5:
                    episodes.append(f"{start - t0:.1f}+{t - start:.1f}: {most}")
                    stalled[first:k] = [True] * (k - first)
                start = None
        # the steady part: from the front's first reaching 90 % of its most in flight to the run's last start
        top = max(f)
        k0 = next(k for k, x in enumerate(f) if x >= 0.9 * top)
        k1 = max(k0 + 1, min(len(ts), int((max(s for s, _ in run) - t0) / step)))
        f, n, gap, stalled = f[k0:k1], n[k0:k1], gap[k0:k1], stalled[k0:k1]
        calm = [g for g, st in zip(gap, stalled) if not st] or [0]
        per = {name: p[k0:k1] for name, p in per.items()}
        a0, a1 = ts[k0], ts[k1 - 1]
        arrivals = sorted(x[0] for v in mine.values() for x in v if a0 <= x[0] <= a1)
        w = [0] * (int((a1 - a0) / 0.05) + 1)
        for a in arrivals:
            w[int((a - a0) / 0.05)] += 1
        rate = sum(1 for s, _ in run if a0 <= s <= a1) / max(1e-9, a1 - a0)
        when = time.strftime("%H:%M:%S", time.gmtime(t0))
        lines.append(f"| {i} | {len(run)} | {when} | {rate:.0f} | {statistics.fmean(f):.0f} / {statistics.fmean(n):.0f}, "
                     f"{[round(statistics.fmean(p)) for p in per.values()]} | {statistics.fmean(gap):.1f}, {statistics.median(gap):.0f}, "
                     f"{max(gap)}; outside episodes {statistics.fmean(calm):.1f}, {max(calm)} | {statistics.fmean(gap) / rate * 1e3:.1f}; "
                     f"outside episodes {statistics.fmean(calm) / rate * 1e3:.1f} | {'; '.join(episodes) or '-'} | "
                     f"{statistics.pstdev(w) / max(1e-9, statistics.fmean(w)):.2f}, {max(w)} |")
    return "\n".join(lines)


def _listen_queues(ports: set[int], peers: dict[int, set[tuple[str, str]]]) -> dict[int, int]:
    """Each listening socket's accept queue now, summed per local port (SO_REUSEPORT: one socket per worker);
    the remote ends of the established connections to each port are added to ``peers``."""
    out: dict[int, int] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    port = int(parts[1].rsplit(":", 1)[1], 16)
                    if port not in ports:
                        continue
                    if parts[3] == "0A":  # TCP_LISTEN: rx_queue is the accept queue
                        out[port] = out.get(port, 0) + int(parts[4].split(":")[1], 16)
                    elif parts[3] == "01":  # ESTABLISHED
                        peers.setdefault(port, set()).add((name, parts[2]))
        except OSError:
            pass
    return out


def _tcp_ext() -> dict[str, int]:
    with open("/proc/net/netstat") as f:
        rows = [line.split() for line in f if line.startswith("TcpExt:")]
    return dict(zip(rows[0][1:], map(int, rows[1][1:])))


def listen_watch(seconds: float, ports: set[int]) -> str:
    """``--listen-watch``: the most connections each port's listen queue held, its backlog, the connections to
    it seen (distinct remote ends), the drops counted; ``seconds`` <= 0: until SIGTERM."""
    import signal

    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    print(f"watching the listen queues of {sorted(ports)}", flush=True)  # a caller may wait for this line
    backlog: dict[int, list[int]] = {}
    try:
        ss = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=5).stdout
        for line in ss.splitlines():  # State Recv-Q Send-Q Local:Port Peer
            f = line.split()
            port = int(f[3].rsplit(":", 1)[1])
            if port in ports:
                backlog.setdefault(port, []).append(int(f[2]))
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    before, most, t0 = _tcp_ext(), {p: 0 for p in ports}, time.monotonic()
    samples, peers = 0, {}
    while not stop[0] and (seconds <= 0 or time.monotonic() - t0 < seconds):
        for port, q in _listen_queues(ports, peers).items():
            most[port] = max(most[port], q)
        samples += 1
        time.sleep(0.1)
    after = _tcp_ext()
    drops = {k: after.get(k, 0) - before.get(k, 0) for k in ("ListenOverflows", "ListenDrops", "SyncookiesSent", "TCPReqQFullDrop",
                                                             "TCPReqQFullDoCookies")}
    return (f"listen queues over {time.monotonic() - t0:.0f} s ({samples} looks): "
            + ", ".join(f":{p} most {most[p]} (backlog {backlog.get(p, '?')}, {len(peers.get(p, ()))} connections seen)"
                        for p in sorted(ports))
            + f"; TcpExt over the watch: {drops}")


_BURST = """
import asyncio, sys, time
root, url, n, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
sys.path.insert(0, root)
from vllama_proxy.upstream import Upstream
async def main():
    up = Upstream(url)
    await up.start()
    await asyncio.sleep(max(0.0, start - time.time()))
    t0 = time.monotonic()
    async def one():
        await up.get_json("/list_workers")
        return time.monotonic() - t0
    print(*await asyncio.gather(*(one() for _ in range(n))))
    await up.close()
asyncio.run(main())
"""


def connect_burst(n: int, procs: int, roots: list[str]) -> str:
    """``--connect-burst``: per checkout, a fresh router and ``procs`` processes sending ``n`` requests at once."""
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    lines = []
    for root in roots:
        port, pport = free_port(), free_port()
        router = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(pport),
                                   "--policy", "round_robin"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}/liveness", router)
            ss = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
            start = time.time() + 2.0  # every process imports and connects nothing before this instant
            workers = [subprocess.Popen([sys.executable, "-c", _BURST, root, f"http://127.0.0.1:{port}", str(n // procs), str(start)],
                                        stdout=subprocess.PIPE, text=True) for _ in range(procs)]
            before = _tcp_ext()
            took = sorted(float(x) for w in workers for x in w.communicate(timeout=120)[0].split())
            overflows = _tcp_ext().get("ListenOverflows", 0) - before.get("ListenOverflows", 0)
        finally:
            router.terminate()
            router.wait(10)
        lines.append(f"{root}: {len(took)} requests from {procs} processes at once to a fresh vllm-router (backlog "
                     f"{ss[2] if len(ss) > 2 else '?'}): {sum(t > 0.9 for t in took)} answered after 0.9 s; p50 "
                     f"{percentile(took, 50):.2f} s, p90 {percentile(took, 90):.2f} s, max {took[-1]:.2f} s; "
                     f"ListenOverflows +{overflows} (the whole host)")
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    return f"{x:.1f}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_logs:
        print(from_logs(args.from_logs))
        return 0
    if args.connect_burst is not None:
        print(connect_burst(args.connect_burst, args.procs, ([args.base_root] if args.base_root else []) + [ROOT]))
        return 0
    if args.listen_watch is not None:  # 0: until SIGTERM
        print(listen_watch(args.listen_watch, {int(p) for p in args.ports.split(",") if p}), flush=True)
        return 0
    out = asyncio.run(main_async(args))
    print(out["report"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
