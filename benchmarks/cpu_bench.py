#!/usr/bin/env python3
"""CPU-only benchmark of the proxy: vllama (Ollama NDJSON) vs direct (OpenAI SSE) against the fake vLLM.

Runs anywhere (no GPU): starts ``tests/fake_vllm.py`` (tokens paced by
``FAKE_VLLM_TOKEN_DELAY``) and ``python -m vllama_proxy serve --upstream <fake>`` as
subprocesses on free loopback ports, then drives both with ``loadgen`` at each
concurrency level, alternating proxy / direct for ``--rounds`` rounds:

* ``proxy``: ``ollama`` protocol -> vllama -> fake ``/v1/completions``;
* ``direct``: ``openai`` protocol straight to the fake.

``--api chat`` compares ``/api/chat`` through vllama with ``/v1/chat/completions`` direct instead;
``--floor`` puts ``aiohttp_floor.py`` (a bare aiohttp relay, no product) in vllama's place: the
least a proxy on this stack costs per token on this machine.

Reported per (level, target): tokens/s, TTFT/TPOT/E2E, and the CPU each process
spent per streamed output token (psutil user+system time, before/after each run,
divided by the output tokens that run delivered). The proxy's µs/token is the number
that matters: it is what one token costs the proxy, whatever machine this runs on.

Fairness on a small machine: the fake paces tokens with a sleep *after* each write, so
anything that steals its CPU stretches its pacing. With 2+ CPUs the proxy is pinned
to the last CPU and the fake and this load generator to the others (``--no-pin``
turns that off), so the fake and the client face the same CPU in both runs and the
proxy's work does not preempt the fake; the token delay (0.02 s) keeps the fake and
the client well below one core at the default levels. The tokens/s ratio then shows
whether one proxy core keeps up with the offered rate (levels x 1/delay tokens/s);
the µs/token column shows what it costs. Total CPU use per process is printed too:
a process near 100 % of its core(s) is the bottleneck of that row.

Always stops its subprocesses (``finally``, ``atexit``, SIGTERM/SIGHUP).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402
from procs import Children, free_port, wait_http  # noqa: E402
from loadgen import PromptFactory, Run, Target, Workload  # noqa: E402

MODEL = "fake-model"


# --------------------------------------------------------------------------- processes


def _on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def pinning(enabled: bool) -> tuple[set[int] | None, set[int] | None]:
    """``(cpus for the proxy, cpus for the fake and the client)``, or ``(None, None)``."""
    if not enabled or not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[-1]}, set(cpus[:-1])


# --------------------------------------------------------------------------- the benchmark


def _cpu(p: psutil.Process) -> float:
    """CPU seconds (user + system) of ``p`` and its live descendants (``--workers N``: the workers
    are the main process's children)."""
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        try:
            t = q.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


async def bench(args: argparse.Namespace, proxy_url: str, fake_url: str, procs: dict[str, psutil.Process],
                log_fn=loadgen.log) -> list[dict[str, Any]]:
    if args.api == "chat":
        targets = [Target("proxy", "ollama-chat", proxy_url), Target("direct", "openai-chat", fake_url)]
    else:
        targets = [Target("proxy", "ollama", proxy_url), Target("direct", "openai", fake_url)]
    wl = Workload(MODEL, args.output_tokens, args.prompt_words, 0.0, True)
    prompts = PromptFactory(args.prompt_words, args.seed)
    n_for = loadgen.requests_formula(args.requests_per_level)
    levels = []
    async with loadgen.make_session() as session:
        for t in targets:
            run = await loadgen.run_level(session, t, wl, prompts, min(args.warmup, 8), args.warmup)
            s = loadgen.summarize([run])
            if s["ok"] != s["requests"]:
                raise SystemExit(f"warmup against {t.name} failed: {s['error_samples']}")
        for c in args.level_list:
            n = n_for(c)
            log_fn(f"level c={c}: {n} requests per target and round, offered {c / args.token_delay:.0f} tok/s")
            runs: list[Run] = []
            for r in range(args.rounds):
                for t in targets:
                    before = {k: _cpu(p) for k, p in procs.items()}
                    run = await loadgen.run_level(session, t, wl, prompts, c, n, r)
                    after = {k: _cpu(p) for k, p in procs.items()}
                    run.extra = {"cpu_s": {**{k: after[k] - before[k] for k in procs}, "client": run.client_cpu}}
                    runs.append(run)
                    log_fn(loadgen.progress(run) + ", proxy CPU "
                           + f"{run.extra['cpu_s']['proxy'] / run.wall * 100:.0f}%")
            summary = {}
            for t in targets:
                mine = [x for x in runs if x.target.name == t.name]
                s = loadgen.summarize(mine)
                s.pop("extra", None)
                cpu = {k: sum(x.extra["cpu_s"][k] for x in mine) for k in mine[0].extra["cpu_s"]}
                tokens = s["output_tokens"]
                s["cpu_s"] = {k: round(v, 4) for k, v in cpu.items()}
                s["cpu_util"] = {k: round(v / s["wall_s"], 3) for k, v in cpu.items()}
                s["cpu_us_per_token"] = {k: round(v * 1e6 / tokens, 2) if tokens else None for k, v in cpu.items()}
                summary[t.name] = s
            ratio = {"concurrency": c, **loadgen.compare(summary["proxy"], summary["direct"]),
                     "proxy_cpu_us_per_token": summary["proxy"]["cpu_us_per_token"]["proxy"]}
            levels.append({"concurrency": c, "requests_per_run": n, "offered_tok_s": round(c / args.token_delay, 1),
                           "runs": [{**loadgen.summarize([x]), "round": x.round} for x in runs],
                           "summary": summary, "ratios": {"proxy": ratio}})
    return levels


def table(levels: list[dict[str, Any]]) -> str:
    f = loadgen._f
    lines = ["| c | target | reqs | ok | err | tok/s | TTFT p50 ms | TPOT p50 ms | E2E p50 ms "
             "| proxy µs/tok | fake µs/tok | client µs/tok | proxy CPU | fake CPU | client CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        for s in lv["summary"].values():
            us, util = s["cpu_us_per_token"], s["cpu_util"]
            lines.append(
                f"| {lv['concurrency']} | {s['target']} | {s['requests']} | {s['ok']} | {s['errors']} | "
                f"{f(s['output_tok_s'], 0)} | {f(s['ttft_ms']['p50'])} | {f(s['tpot_ms']['p50'], 2)} | "
                f"{f(s['e2e_ms']['p50'], 0)} | {f(us['proxy'])} | {f(us['fake'])} | {f(us['client'])} | "
                f"{util['proxy'] * 100:.0f}% | {util['fake'] * 100:.0f}% | {util['client'] * 100:.0f}% |")
    lines += ["", "| c | offered tok/s | tok/s proxy/direct | TTFT p50 Δ ms | TPOT p50 Δ ms | E2E p50 Δ ms "
                  "| proxy CPU µs per token |",
              "|---|---|---|---|---|---|---|"]
    for lv in levels:
        r = lv["ratios"]["proxy"]
        lines.append(f"| {lv['concurrency']} | {lv['offered_tok_s']:.0f} | {f(r['tok_s_ratio'], 3)} | "
                     f"{f(r['ttft_p50_delta_ms'], 2)} | {f(r['tpot_p50_delta_ms'], 3)} | "
                     f"{f(r['e2e_p50_delta_ms'], 1)} | {f(r['proxy_cpu_us_per_token'])} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--levels", default="32,256", help="comma-separated concurrency levels")
    p.add_argument("--requests-per-level", default="max(128,2*c)",
                   help="requests per level, target and round: a number or a formula of c")
    p.add_argument("--rounds", type=int, default=2, help="alternating proxy/direct rounds per level")
    p.add_argument("--token-delay", type=float, default=0.02, help="FAKE_VLLM_TOKEN_DELAY: seconds per token")
    p.add_argument("--api", choices=("generate", "chat"), default="generate",
                   help="proxy /api/generate vs direct /v1/completions, or /api/chat vs /v1/chat/completions")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=128)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the proxy to its own CPU (and the fake + client to the others)")
    p.add_argument("--proxy-arg", action="append", default=[], help="extra argument to `vllama serve` (repeatable)")
    p.add_argument("--floor", action="store_true",
                   help="measure benchmarks/aiohttp_floor.py (a bare aiohttp relay) in vllama's place (needs --api chat)")
    p.add_argument("--keep-logs", action="store_true", help="print where the subprocess logs are and keep them")
    p.add_argument("--no-uvloop", action="store_true", help="client on asyncio's default loop")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    args.level_list = [int(x) for x in args.levels.split(",") if x.strip()]
    if args.floor and args.api != "chat":
        p.error("--floor relays /api/chat only: add --api chat")
    if args.token_delay <= 0:
        p.error("--token-delay must be > 0 (0 makes the fake CPU-bound and the comparison meaningless)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loadgen.raise_nofile()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (`cmd &`)
    proxy_cpus, other_cpus = pinning(not args.no_pin)
    children = Children()
    tmp = Path(tempfile.mkdtemp(prefix="vllama-cpu-bench-"))
    try:
        if other_cpus:
            os.sched_setaffinity(0, other_cpus)
        env = {**os.environ, "FAKE_VLLM_TOKEN_DELAY": str(args.token_delay), "FAKE_VLLM_LOG_MAX": "64"}
        fport, pport = free_port(), free_port()
        fake = children.start([sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", str(tmp / MODEL),
                               "--host", "127.0.0.1", "--port", str(fport), "--served-model-name", MODEL,
                               "--max-model-len", "100000"], env, tmp / "fake.log", other_cpus)
        fake_url = f"http://127.0.0.1:{fport}"
        wait_http(fake_url + "/health", fake)
        serve = [str(HERE / "aiohttp_floor.py")] if args.floor else ["-m", "vllama_proxy", "serve", *args.proxy_arg]
        proxy = children.start([sys.executable, *serve, "--upstream", fake_url, "--port", str(pport)],
                               env, tmp / "proxy.log", proxy_cpus)
        proxy_url = f"http://127.0.0.1:{pport}"
        wait_http(proxy_url + "/", proxy)
        loadgen.log(f"fake vLLM pid {fake.pid} on {fake_url} (token delay {args.token_delay} s), "
                    f"proxy pid {proxy.pid} on {proxy_url}; pinning: "
                    + (f"proxy CPU {sorted(proxy_cpus)}, fake + client CPU {sorted(other_cpus)}"
                       if proxy_cpus else "off"))
        procs = {"proxy": psutil.Process(proxy.pid), "fake": psutil.Process(fake.pid)}
        t0 = time.monotonic()
        levels = loadgen.run_loop(bench(args, proxy_url, fake_url, procs), not args.no_uvloop)
        elapsed = time.monotonic() - t0
        for name, p in (("fake", fake), ("proxy", proxy)):
            if p.poll() is not None:
                raise SystemExit(f"the {name} exited with {p.returncode} during the benchmark (log: {tmp})")
    finally:
        children.stop_all()
        if not args.keep_logs:
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        else:
            loadgen.log(f"logs kept in {tmp}")
    text = table(levels)
    print(text)
    errors = sum(s["errors"] for lv in levels for s in lv["summary"].values())
    if args.json:
        out = {**loadgen.environment(), "benchmark": "cpu_bench",
               "config": {k: v for k, v in vars(args).items() if k != "level_list"},
               "pinning": {"proxy": sorted(proxy_cpus) if proxy_cpus else None,
                           "fake_and_client": sorted(other_cpus) if other_cpus else None},
               "workload": {"model": MODEL, "output_tokens": args.output_tokens, "prompt_words": args.prompt_words},
               "baseline": "direct", "elapsed_s": round(elapsed, 2), "levels": levels, "table": text}
        Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
        loadgen.log(f"wrote {args.json}")
    loadgen.log(f"benchmark time {elapsed:.0f} s" + (f"; {errors} request(s) failed" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        loadgen.log("interrupted; subprocesses stopped")
        sys.exit(130)
