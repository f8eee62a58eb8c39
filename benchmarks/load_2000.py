#!/usr/bin/env python3
"""The "load held" check: 2,000 concurrent streaming clients through the proxy, on any machine.

Starts the fake vLLM (``tests/fake_vllm.py``, tokens paced by ``--token-delay``) and
``vllama serve --upstream <fake>`` as subprocesses on free loopback ports, raises this
process's ``RLIMIT_NOFILE`` (the children inherit it), then opens ``--clients`` streaming
``POST /api/generate`` requests at once (``raw``, ``num_predict`` = ``--tokens``,
``ignore_eos``): with 64 tokens at 0.05 s each a stream lasts at least 3.2 s, so every
stream is open at the same time. Requests and parsing are ``benchmarks/loadgen.py``'s
(``--procs N`` splits the clients over N client processes).

Reported: requests sent / answered (an HTTP status came back) / ok / errors by kind,
**lost** responses (status 200, then the stream ended without ``done: true`` and without
an ``{"error"}`` line: the one outcome the proxy promises never to produce), total time
(first send to last byte), output tokens/s, the peak number of streams open at once (client
side, first token to last byte) and of requests in flight in the fake; for the proxy and
the fake: RSS before / peak / after (psutil, sampled every 100 ms, summed over the process
tree), open file descriptors peak (``num_fds``), ``RLIMIT_NOFILE`` (``/proc/<pid>/limits``)
and CPU seconds used during the load.

The proxy runs with its default admission (running capacity + ``--max-queue``, one bound
for all workers: 1024 + 8192 with ``--upstream``), so a burst beyond that gets Ollama's 503
"server busy"; ``--proxy-arg`` passes other flags.

Bounded: ``--clients`` requests, one burst; the burst is abandoned after ``--timeout``
seconds (counted as unanswered); traffic only to 127.0.0.1; subprocesses always stopped
(``finally``, ``atexit``, SIGTERM/SIGHUP). Exit status 1 when any request failed or was lost.

    python benchmarks/load_2000.py                      # --clients 2000 --tokens 64 --token-delay 0.05
    python benchmarks/load_2000.py --workers 2 --procs 2 --json load.json
    python benchmarks/load_2000.py --clients 5000 --tokens 8 --no-stream --workers 2 --procs 2   # the 5,000 burst
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402
from procs import Children, free_port, wait_http  # noqa: E402
from loadgen import RequestResult, Target, Workload  # noqa: E402

MODEL = "fake-model"
PROMPT = "Tell me a long story about the sea and the wind and the stars"


# --------------------------------------------------------------------------- processes


def _on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def nofile_limits(pid: int) -> tuple[str, str]:
    """``(soft, hard)`` "Max open files" of a process, from ``/proc/<pid>/limits``."""
    try:
        text = Path(f"/proc/{pid}/limits").read_text()
    except OSError:
        return "?", "?"
    m = re.search(r"^Max open files\s+(\S+)\s+(\S+)", text, re.M)
    return (m.group(1), m.group(2)) if m else ("?", "?")


# --------------------------------------------------------------------------- sampling


@dataclass
class Usage:
    """Peaks of one process tree, sampled every ``interval`` seconds in a thread."""

    proc: psutil.Process
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    fds_before: int = 0
    fds_peak: int = 0
    fds_after: int = 0
    procs_peak: int = 1
    cpu_during: float = 0.0
    _cpu0: float = 0.0

    def tree(self) -> list[psutil.Process]:
        try:
            return [self.proc, *self.proc.children(recursive=True)]
        except psutil.Error:
            return []

    def sample(self) -> tuple[int, int]:
        rss = fds = 0
        procs = self.tree()
        for p in procs:
            try:
                rss += p.memory_info().rss
                fds += p.num_fds()
            except psutil.Error:
                pass
        self.rss_peak = max(self.rss_peak, rss)
        self.fds_peak = max(self.fds_peak, fds)
        self.procs_peak = max(self.procs_peak, len(procs))
        return rss, fds

    def cpu(self) -> float:
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def before(self) -> None:
        self.rss_before, self.fds_before = self.sample()
        self.rss_peak, self.fds_peak = self.rss_before, self.fds_before
        self._cpu0 = self.cpu()

    def after(self) -> None:
        self.cpu_during = self.cpu() - self._cpu0
        self.rss_after, self.fds_after = self.sample()


class Sampler(threading.Thread):
    """Every ``interval`` s: RSS and fds of each tree, and the fake's requests in flight."""

    def __init__(self, usages: list[Usage], fake_url: str, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.usages = usages
        self.fake_url = fake_url
        self.interval = interval
        self.stop_event = threading.Event()
        self.fake_in_flight_peak = 0
        self.samples = 0

    def run(self) -> None:
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            for u in self.usages:
                u.sample()
            try:
                with urllib.request.urlopen(self.fake_url + "/_fake/stats", timeout=2) as r:
                    self.fake_in_flight_peak = max(self.fake_in_flight_peak, orjson.loads(r.read())["in_flight"])
            except (OSError, ValueError, KeyError):
                pass
            self.samples += 1
            self.stop_event.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(5)


# --------------------------------------------------------------------------- the burst


def classify(r: RequestResult) -> str:
    """ok | lost | error_line | http_<status> | no_answer | wrong_token_count | bad_stream."""
    if r.ok:
        return "ok"
    err = r.error or ""
    if r.status is None:
        return "no_answer"
    if r.status != 200:
        return f"http_{r.status}"
    if err.startswith("error line"):
        return "error_line"
    if "output tokens, asked for" in err:
        return "wrong_token_count"
    if err.startswith("bad JSON"):
        return "bad_stream"
    return "lost"  # 200, then the stream ended (or was cut) without done:true and without an error line


def listen_drops() -> dict[str, int]:
    """This network namespace's ``TcpExt`` ListenOverflows / ListenDrops (accept-queue overflows)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return {}
    for head, vals in zip(lines[::2], lines[1::2]):
        if head.startswith("TcpExt:"):
            d = dict(zip(head.split()[1:], map(int, vals.split()[1:])))
            return {k: d[k] for k in ("ListenOverflows", "ListenDrops") if k in d}
    return {}


def peak_open(results: list[RequestResult]) -> int:
    """Most streams open at once: from the first token to the last byte, client side."""
    events = []
    for r in results:
        if r.ttft is not None:
            events.append((r.start + r.ttft, 1))
            events.append((r.start + r.e2e, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


async def burst(args: argparse.Namespace, target: Target, wl: Workload) -> tuple[list[RequestResult], float, int, float]:
    """``(results, wall s, requests abandoned at --timeout, client CPU s)``: all ``--clients`` requests at once."""
    prompts = lambda: PROMPT  # noqa: E731 - the fake does not cache prompts; the same one is fine
    if args.procs > 1:
        pool = loadgen.ClientPool(args.procs, use_uvloop=not args.no_uvloop)
        try:
            run = await asyncio.wait_for(pool.run_level(target, wl, prompts, args.clients, args.clients), args.timeout)
        finally:
            pool.close()
        return run.results, run.wall, args.clients - len(run.results), run.client_cpu
    reqs = [loadgen.request_for(target, wl, prompts()) for _ in range(args.clients)]
    cpu0 = loadgen._cpu_seconds()
    async with loadgen.make_session() as session:
        tasks = [asyncio.ensure_future(loadgen.one_request(session, target, wl, *req)) for req in reqs]
        t0 = time.perf_counter()
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        results = [t.result() for t in done if not t.cancelled() and t.exception() is None]
        ends = [r.start + r.e2e for r in results]
        wall = (max(ends) if ends else time.perf_counter()) - t0
    return results, wall, len(pending), loadgen._cpu_seconds() - cpu0


async def warmup(target: Target, wl: Workload, n: int = 4) -> None:
    async with loadgen.make_session() as session:
        reqs = [loadgen.request_for(target, wl, PROMPT) for _ in range(n)]
        results = await asyncio.gather(*(loadgen.one_request(session, target, wl, *r) for r in reqs))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise SystemExit(f"warmup failed: {bad[0]}")


# --------------------------------------------------------------------------- report


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f}"


def table(out: dict[str, Any]) -> str:
    r = out["requests"]
    lines = [
        f"### load_2000: {out['config']['clients']} concurrent {'streams' if out['config']['stream'] else 'non-streamed requests'} "
        f"x {out['config']['tokens']} tokens "
        f"({out['config']['token_delay']} s/token), {out['config']['workers']} proxy worker(s), "
        f"{out['config']['procs']} client process(es), {out['env']['cpu_count']} CPUs",
        "",
        "| requests | sent | answered | ok | errors | lost | error lines | HTTP errors | no answer |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| proxy /api/generate | {r['sent']} | {r['answered']} | {r['ok']} | {r['errors']} | {r['lost']} | {r['error_line']} | "
        f"{r['http_errors']} | {r['no_answer']} |",
        "",
        "| run | total time s | output tokens | tokens/s | peak open streams (client) | peak in flight (fake) | "
        "TTFT p50 / p99 ms | E2E p50 / p99 s |",
        "|---|---|---|---|---|---|---|---|",
        f"| burst | {out['wall_s']:.2f} | {out['output_tokens']} | {out['tokens_per_s']:.0f} | {out['peak_open_streams']} | "
        f"{out['fake_in_flight_peak']} | {loadgen._f(out['ttft_ms']['p50'])} / {loadgen._f(out['ttft_ms']['p99'])} | "
        f"{loadgen._f(out['e2e_s']['p50'], 2)} / {loadgen._f(out['e2e_s']['p99'], 2)} |",
        "",
        "| process | RSS before MiB | RSS peak MiB | RSS after MiB | open fds before / peak / after | RLIMIT_NOFILE soft / hard | CPU s during load | CPU µs / token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("proxy", "fake"):
        p = out["processes"][name]
        lines.append(
            f"| {name}{' (' + str(p['procs']) + ' processes)' if p['procs'] > 1 else ''} | {_mib(p['rss_before'])} | "
            f"{_mib(p['rss_peak'])} | {_mib(p['rss_after'])} | {p['fds_before']} / {p['fds_peak']} / {p['fds_after']} | "
            f"{p['nofile'][0]} / {p['nofile'][1]} | {p['cpu_s']:.1f} | {_per_token(p['cpu_s'], out)} |")
    c = out["client"]
    lines.append(f"| client | | | | | {c['nofile'][0]} / {c['nofile'][1]} | {c['cpu_s']:.1f} | {_per_token(c['cpu_s'], out)} |")
    lq = out.get("listen_queue") or {}
    if lq:
        lines += ["", "Accept-queue overflows during the burst (this network namespace): "
                  + ", ".join(f"{k} {v}" for k, v in lq.items())]
    if out["error_samples"]:
        lines += ["", "Errors by kind: " + ", ".join(f"{k}: {v}" for k, v in sorted(out["kinds"].items()) if k != "ok")]
        lines += [f"- `{k}`: {e}" for k, e in out["error_samples"].items()]
    return "\n".join(lines)


def _per_token(cpu_s: float, out: dict[str, Any]) -> str:
    return f"{cpu_s / out['output_tokens'] * 1e6:.0f}" if out["output_tokens"] else "-"


def _dist(xs: list[float], scale: float) -> dict[str, float | None]:
    xs = sorted(x * scale for x in xs)
    return {"p50": loadgen.percentile(xs, 50), "p99": loadgen.percentile(xs, 99)}


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=2000, help="streaming requests opened at once")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per stream (num_predict, ignore_eos)")
    p.add_argument("--token-delay", type=float, default=0.05, help="FAKE_VLLM_TOKEN_DELAY: seconds per token")
    p.add_argument("--workers", type=int, default=1, help="vllama serve --workers")
    p.add_argument("--procs", type=int, default=1, help="client processes sharing the clients")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds after which unfinished requests are abandoned")
    p.add_argument("--proxy-arg", action="append", default=[], help="extra `vllama serve` argument (repeatable; --FLAG=VALUE)")
    p.add_argument("--keep-logs", action="store_true", help="keep the subprocess logs and print where they are")
    p.add_argument("--no-stream", action="store_true", help="non-streamed requests (stream: false): one JSON answer each")
    p.add_argument("--no-uvloop", action="store_true", help="client on asyncio's default loop")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.clients < 1 or args.tokens < 1 or args.procs < 1 or args.workers < 1:
        p.error("--clients, --tokens, --procs and --workers must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    nofile = loadgen.raise_nofile()  # before the children start: they inherit it
    need = args.clients // args.procs + 64
    if nofile[0] != resource.RLIM_INFINITY and nofile[0] < need:
        loadgen.log(f"warning: RLIMIT_NOFILE is {nofile[0]} < {need} sockets per client process: use --procs")
    tmp = Path(tempfile.mkdtemp(prefix="vllama-load2000-"))
    children = Children()
    try:
        (tmp / MODEL).mkdir()
        fport, pport = free_port(), free_port()
        fake_url, proxy_url = f"http://127.0.0.1:{fport}", f"http://127.0.0.1:{pport}"
        env = {**os.environ, "FAKE_VLLM_TOKEN_DELAY": str(args.token_delay), "FAKE_VLLM_LOG_MAX": "64",
               "VLLAMA_LOG_FORMAT": "json"}
        fake = children.start([sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", str(tmp / MODEL),
                               "--host", "127.0.0.1", "--port", str(fport), "--served-model-name", MODEL,
                               "--max-model-len", "100000"], env, tmp / "fake.log")
        wait_http(fake_url + "/health", fake)
        flags = ["--workers", str(args.workers), *args.proxy_arg]
        proxy = children.start([sys.executable, "-m", "vllama_proxy", "serve", "--upstream", fake_url,
                                "--host", "127.0.0.1", "--port", str(pport), *flags], env, tmp / "proxy.log")
        wait_http(proxy_url + "/", proxy)
        loadgen.log(f"fake {fake_url} (pid {fake.pid}), proxy {proxy_url} (pid {proxy.pid}, flags {' '.join(flags)}); "
                    f"client RLIMIT_NOFILE {nofile[0]}/{nofile[1]}")

        target = Target("proxy", "ollama-nostream" if args.no_stream else "ollama", proxy_url)
        wl = Workload(MODEL, args.tokens, len(PROMPT.split()), 0.0, True)
        run_loop = lambda coro: loadgen.run_loop(coro, use_uvloop=not args.no_uvloop)  # noqa: E731
        run_loop(warmup(target, wl))
        if args.workers > 1:
            time.sleep(1.0)  # let the extra workers bind
        usages = {"proxy": Usage(psutil.Process(proxy.pid)), "fake": Usage(psutil.Process(fake.pid))}
        for u in usages.values():
            u.before()
        sampler = Sampler(list(usages.values()), fake_url)
        drops0 = listen_drops()
        sampler.start()
        loadgen.log(f"burst: {args.clients} {'streams' if not args.no_stream else 'non-streamed requests'} x {args.tokens} tokens at {args.token_delay} s/token "
                    f"(offered {args.clients / args.token_delay:.0f} tokens/s)")
        try:
            results, wall, abandoned, client_cpu = run_loop(burst(args, target, wl))
        finally:
            time.sleep(1.0)  # let connections close before the "after" sample
            sampler.stop()
            for u in usages.values():
                u.after()
            drops = {k: v - drops0.get(k, 0) for k, v in listen_drops().items()}
        for name, proc in (("proxy", proxy), ("fake", fake)):
            if proc.poll() is not None:
                loadgen.log(f"warning: the {name} exited with {proc.returncode} during the load")

        kinds: dict[str, int] = {}
        samples: dict[str, str] = {}
        for r in results:
            k = classify(r)
            kinds[k] = kinds.get(k, 0) + 1
            if k != "ok" and k not in samples:
                samples[k] = (r.error or "")[:300]
        if abandoned:
            kinds["no_answer"] = kinds.get("no_answer", 0) + abandoned
            samples.setdefault("no_answer", f"{abandoned} abandoned after --timeout {args.timeout} s")
        ok = kinds.get("ok", 0)
        tokens = sum(r.output_tokens for r in results)
        out: dict[str, Any] = {
            "env": loadgen.environment(),
            "config": {"clients": args.clients, "tokens": args.tokens, "token_delay": args.token_delay,
                       "workers": args.workers, "procs": args.procs, "timeout": args.timeout, "proxy_flags": flags,
                       "stream": not args.no_stream},
            "requests": {
                "sent": args.clients,
                "answered": sum(1 for r in results if r.status is not None),
                "ok": ok,
                "errors": args.clients - ok,
                "lost": kinds.get("lost", 0),
                "error_line": kinds.get("error_line", 0),
                "http_errors": sum(v for k, v in kinds.items() if k.startswith("http_")),
                "no_answer": kinds.get("no_answer", 0),
            },
            "kinds": kinds,
            "error_samples": samples,
            "wall_s": wall,
            "output_tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "peak_open_streams": peak_open(results),
            "fake_in_flight_peak": sampler.fake_in_flight_peak,
            "samples": sampler.samples,
            "ttft_ms": _dist([r.ttft for r in results if r.ttft is not None], 1000),
            "e2e_s": _dist([r.e2e for r in results if r.ok], 1),
            "processes": {
                name: {"pid": u.proc.pid, "procs": u.procs_peak, "rss_before": u.rss_before, "rss_peak": u.rss_peak,
                       "rss_after": u.rss_after, "fds_before": u.fds_before, "fds_peak": u.fds_peak,
                       "fds_after": u.fds_after, "nofile": nofile_limits(u.proc.pid), "cpu_s": u.cpu_during}
                for name, u in usages.items()
            },
            "client": {"nofile": nofile, "cpu_s": client_cpu},
            "listen_queue": drops,
        }
        text = table(out)
        print(text)
        if args.json:
            Path(args.json).write_text(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        if args.keep_logs:
            loadgen.log(f"logs kept in {tmp}")
        return 0 if ok == args.clients else 1
    finally:
        children.stop_all()
        if not args.keep_logs:
            for f in tmp.glob("*"):
                if f.is_file():
                    f.unlink()
                else:
                    f.rmdir()
            tmp.rmdir()


if __name__ == "__main__":
    sys.exit(main())
