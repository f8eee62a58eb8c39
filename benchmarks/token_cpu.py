#!/usr/bin/env python3
"""vllama's CPU per streamed token, two builds side by side in paired alternating blocks (issue 42, item 1).

One stand-in vLLM (``tests/fake_vllm.py``, ``FAKE_VLLM_TOKEN_DELAY`` per engine step and
``FAKE_VLLM_LOCKSTEP=1``: every running stream's token goes out on the same step, as vLLM's engine
steps its batch) serves two ``vllama serve --upstream`` processes: ``old`` runs the package found in
``--old`` (e.g. ``git archive main vllama_proxy | tar -x -C /tmp/old``), ``new`` this checkout's. Both
are pinned to the last CPU, the stand-in and this client to the others. Per level and route, each
block sends ``--waves`` x c streamed requests (c in flight) to one build, then to the other, the first
build alternating block by block; the CPU time of each build's processes (main and ``--workers``,
every thread, from ``schedstat``) over its half of the block, divided by the output tokens the client
received, is its µs per token. Reported per level and route: each build's median, and new/old as the geometric mean of
the blocks' ratios with a 95 % bootstrap interval (``paired_stats.bootstrap``), which holds 1.0 when
the difference is not resolved at this many blocks. Routes: ``generate`` (``/api/generate``), ``chat``
(``/api/chat``), ``openai`` (``/v1/chat/completions`` passed through).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/token_cpu.py --old /tmp/old [--levels 16,64]
        [--routes generate,chat,openai] [--blocks 8] [--token-delay 0.005] [--workers 1] [--old-workers 4] [--json OUT]

``--old`` left out compares this checkout with itself (an A/A control: its interval should hold 1.0).
Units: µs of CPU per output token; tok/s as the client counted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
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
from cpu_bench import pinning  # noqa: E402
from paired_stats import bootstrap, geomean  # noqa: E402
from procs import Children, free_port, wait_http  # noqa: E402

MODEL = "fake-model"
PROTOCOL = {"generate": "ollama", "chat": "ollama-chat", "openai": "openai-chat"}


def cpu_seconds(proc: psutil.Process) -> float:
    """CPU seconds ``proc`` and its descendants (``--workers``) ran, every thread counted, to the
    nanosecond: ``/proc/PID/task/TID/schedstat``'s time on the CPU (psutil's user + system come in
    10 ms ticks, ~2.4 µs per token of a 4,096-token half block); psutil's where schedstat is missing."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            tasks = os.listdir(f"/proc/{p.pid}/task")
            for tid in tasks:
                with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
        except FileNotFoundError:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return total


def start_vllama(code: Path, fake_url: str, args: argparse.Namespace, env: dict[str, str], log: Path,
                 cpus: set[int] | None, workers: int) -> tuple[str, subprocess.Popen[bytes]]:
    """``vllama serve --upstream`` importing the package under ``code`` (its cwd, first on PYTHONPATH: the rest of
    PYTHONPATH stays after it, e.g. a GPU host's ``/tmp/vsite`` holding vllama's dependencies)."""
    port = free_port()

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllama_proxy", "serve", "--upstream", fake_url, "--port", str(port),
                                 "--workers", str(workers), *args.proxy_arg],
                                env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")])),
                                     "VLLAMA_STATE_DIR": str(log.with_suffix(".state"))},  # one per build: its lock
                                cwd=code, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out, preexec_fn=pin, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/", proc, 60)
    return url, proc


def summarize(blocks: list[dict[str, Any]], resamples: int = 10_000) -> list[dict[str, Any]]:
    """Per (level, route): each build's median µs/token and tok/s, and new/old paired by block."""
    out = []
    keys = sorted({(b["c"], b["route"]) for b in blocks}, key=lambda k: (k[0], list(PROTOCOL).index(k[1])))
    for c, route in keys:
        mine = [b for b in blocks if b["c"] == c and b["route"] == route]
        ratios = [b["new"]["us_per_token"] / b["old"]["us_per_token"] for b in mine]
        row: dict[str, Any] = {"c": c, "route": route, "blocks": len(mine)}
        for name in ("old", "new"):
            row[name] = {"us_per_token": statistics.median(b[name]["us_per_token"] for b in mine),
                         "tok_s": statistics.median(b[name]["tok_s"] for b in mine)}
        row["ratio"] = geomean(ratios)
        row["ci"] = bootstrap(ratios, geomean, resamples, 0) if len(ratios) > 1 else (None, None)
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| c | route | blocks | old µs/token | new µs/token | new/old [95 % CI] | old tok/s | new tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci"]
        ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""
        lines.append(f"| {r['c']} | {r['route']} | {r['blocks']} | {r['old']['us_per_token']:.1f} | "
                     f"{r['new']['us_per_token']:.1f} | {r['ratio']:.3f}{ci} | {r['old']['tok_s']:.0f} | {r['new']['tok_s']:.0f} |")
    return "\n".join(lines)


async def run(args: argparse.Namespace, urls: dict[str, str], procs: dict[str, psutil.Process]) -> list[dict[str, Any]]:
    wl = loadgen.Workload(MODEL, args.tokens, args.prompt_words, 0.0, True)
    prompts = loadgen.PromptFactory(args.prompt_words, 0)
    blocks = []
    async with loadgen.make_session() as session:
        for name, url in urls.items():  # warm-up: connections, the model's capabilities, first requests
            for route in args.route_list:
                target = loadgen.Target(name, PROTOCOL[route], url)
                run_ = await loadgen.run_level(session, target, wl, prompts, 4, 8)
                if any(not r.ok for r in run_.results):
                    raise SystemExit(f"warm-up against {name} {route} failed: {[r.error for r in run_.results if not r.ok][:2]}")
        for c in args.level_list:
            for route in args.route_list:
                for i in range(args.blocks):
                    order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
                    block: dict[str, Any] = {"c": c, "route": route, "block": i, "first": order[0]}
                    for name in order:
                        target = loadgen.Target(name, PROTOCOL[route], urls[name])
                        before = cpu_seconds(procs[name])
                        run_ = await loadgen.run_level(session, target, wl, prompts, c, args.waves * c, i)
                        cpu = cpu_seconds(procs[name]) - before
                        bad = [r for r in run_.results if not r.ok]
                        if bad:
                            raise SystemExit(f"{name} {route} c={c}: {len(bad)} failed: {bad[0].error}")
                        tokens = sum(r.output_tokens for r in run_.results)
                        block[name] = {"cpu_s": round(cpu, 4), "tokens": tokens, "wall_s": round(run_.wall, 3),
                                       "us_per_token": cpu * 1e6 / tokens, "tok_s": tokens / run_.wall}
                    loadgen.log(f"c={c} {route} block {i}: old {block['old']['us_per_token']:.1f} µs/token, "
                                f"new {block['new']['us_per_token']:.1f}")
                    blocks.append(block)
    return blocks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, default=None, help="a folder holding the other build's vllama_proxy/ (default: this checkout)")
    p.add_argument("--levels", default="16,64")
    p.add_argument("--routes", default="generate,chat,openai")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--waves", type=int, default=2, help="requests per block and build: waves x c")
    p.add_argument("--token-delay", type=float, default=0.005, help="seconds per engine step")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--workers", type=int, default=1, help="vllama's --workers, both builds")
    p.add_argument("--old-workers", type=int, default=0, help="the old build's --workers, if not --workers (1 vs 4: the fan-in's cost)")
    p.add_argument("--proxy-arg", action="append", default=[], help="another `vllama serve` argument (repeatable)")
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.level_list = [int(x) for x in args.levels.split(",") if x]
    args.route_list = [x for x in args.routes.split(",") if x]
    if unknown := set(args.route_list) - set(PROTOCOL):
        p.error(f"unknown route(s) {sorted(unknown)}: choose from {sorted(PROTOCOL)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loadgen.raise_nofile()
    proxy_cpus, other_cpus = pinning(not args.no_pin)
    children = Children()
    tmp = Path(tempfile.mkdtemp(prefix="vllama-token-cpu-"))
    procs_: list[subprocess.Popen[bytes]] = []
    try:
        if other_cpus:
            os.sched_setaffinity(0, other_cpus)
        env = {**os.environ, "FAKE_VLLM_TOKEN_DELAY": str(args.token_delay), "FAKE_VLLM_LOCKSTEP": "1",
               "FAKE_VLLM_LOG_MAX": "64"}
        fport = free_port()
        fake = children.start([sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", str(tmp / MODEL),
                               "--host", "127.0.0.1", "--port", str(fport), "--served-model-name", MODEL,
                               "--max-model-len", "100000"], env, tmp / "fake.log", other_cpus)
        fake_url = f"http://127.0.0.1:{fport}"
        wait_http(fake_url + "/health", fake)
        urls, procs = {}, {}
        for name, code in (("old", args.old or ROOT), ("new", ROOT)):
            workers = args.old_workers if name == "old" and args.old_workers else args.workers
            url, proc = start_vllama(code.resolve(), fake_url, args, env, tmp / f"{name}.log", proxy_cpus, workers)
            procs_.append(proc)
            urls[name], procs[name] = url, psutil.Process(proc.pid)
        loadgen.log(f"old {args.old or ROOT} on {urls['old']}, new {ROOT} on {urls['new']}, stand-in {fake_url} "
                    f"(lockstep, {args.token_delay * 1000:g} ms a step); proxies on CPU {sorted(proxy_cpus or [])}")
        t0 = time.monotonic()
        blocks = loadgen.run_loop(run(args, urls, procs), True)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs_:
            if p.poll() is None:
                p.terminate()
        for p in procs_:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        children.stop_all()
    rows = summarize(blocks)
    text = table(rows)
    print(text)
    if args.json:
        out = {**loadgen.environment(), "benchmark": "token_cpu", "elapsed_s": round(elapsed, 1),
               "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "summary": [{**r, "ci": list(r["ci"])} for r in rows], "blocks": blocks, "table": text}
        Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
        loadgen.log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
