#!/usr/bin/env python3
"""Where a lone request's CPU goes inside vllama, without vLLM (issue 42, item 4): a py-spy profile of one worker.

Starts the stand-in vLLM and vllama in front of it with ``--workers 1`` (``--mode upstream``: ``vllama serve
--upstream``; ``--mode supervised``: ``vllama serve --model`` launching ``tests/bin/vllm`` as ``c1fake`` does),
sends ``--n`` requests one at a time (``/api/generate`` raw or ``/api/chat``, ``--tokens`` tokens, 2 ms apart)
while ``py-spy record --nonblocking --format raw`` samples vllama's process, and prints the CPU per request
(µs, from the samples: py-spy keeps only the samples where the thread was running) by function, inclusive and
self, and the share of the request's way in (before the body goes upstream), its first token's way out and the
rest (the last line, metrics, ledger, access log) by the frames on the stack.

    python benchmarks/c1_profile.py --pyspy /tmp/pyspy/bin/py-spy [--n 2000] [--route generate|chat]
        [--mode upstream|supervised] [--code DIR] [--rate 1000] [--top 45] [--raw FILE]

py-spy is not a dependency: ``pip install --target /tmp/pyspy py-spy``. Always stops its subprocesses.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from procs import Children, free_port, wait_http  # noqa: E402

#: Frames that place a sample in a phase of the request (the first one found from the leaf up wins).
PHASES = [
    ("way out: the first token (read, decode, translate, write)", re.compile(r"^(read_some|begin|feed|write) \(.*(relay|upstream|ndjson|to_ollama)")),
    ("way in: upstream call (aiohttp client request, connection, send)", re.compile(r"^(request|_request|__aenter__) \(.*(upstream\.py|aiohttp/client\.py)")),
    ("way in: handler before upstream (parse, resolve, translate, hold)", re.compile(r"^(generate|chat) \(.*routes/(generate|chat)\.py")),
    ("way in: middlewares before the handler", re.compile(r"^(middleware|gate|cors|guard|admit|_admit|admission_mw|errors_and_access_log) \(")),
    ("aiohttp server: parse the request, dispatch", re.compile(r"^(data_received|_handle_request|start|feed_data) \(.*aiohttp/(web_protocol|http_parser)")),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pyspy", default=None, help="the py-spy executable (else --cprofile)")
    ap.add_argument("--cprofile", action="store_true", help="cProfile in vllama's process instead of py-spy: exact call "
                    "counts per request, times inflated by the profiler")
    ap.add_argument("--n", type=int, default=2000, help="requests sampled (after 100 of warm-up)")
    ap.add_argument("--tokens", type=int, default=2, help="output tokens per request")
    ap.add_argument("--route", choices=("generate", "chat"), default="generate")
    ap.add_argument("--mode", choices=("upstream", "supervised"), default="supervised")
    ap.add_argument("--code", default=None, help="a folder holding the vllama_proxy to run (default: this checkout's)")
    ap.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--raw", default=None, help="keep py-spy's collapsed stacks (or cProfile's stats) here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vllama-c1prof-"))
    env = {**os.environ, "FAKE_VLLM_TOKEN_DELAY": "0.002", "VLLAMA_STATE_DIR": str(tmp / "state"),
           "FAKE_VLLM_PYTHON": sys.executable, "VLLAMA_VLLM_EXECUTABLE": str(ROOT / "tests" / "bin" / "vllm")}
    children = Children()
    try:
        pport = free_port()
        if a.mode == "upstream":
            fport = free_port()
            fake = children.start([sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", str(tmp / "m"), "--port",
                                   str(fport), "--served-model-name", "fake-model"], env, tmp / "fake.log")
            wait_http(f"http://127.0.0.1:{fport}/health", fake)
            serve = ["--upstream", f"http://127.0.0.1:{fport}"]
        else:
            serve = ["--model", str(tmp / "m"), "--served-model-name", "fake-model", "--vllm-port", str(free_port()),
                     "--keep-alive", "-1", "--no-gpu-check"]
        # the code to run first on sys.path (a child's working directory is this checkout, which -m and -c put first)
        first = f"import sys; sys.path.insert(0, {str(Path(a.code or ROOT).resolve())!r})\n"
        launcher = ["-c", first + (_CPROFILE.replace("OUT", str(tmp / "cprofile.out")) if a.cprofile else _PLAIN)]
        proxy = children.start([sys.executable, *launcher, "serve", *serve, "--port", str(pport), "--workers", "1",
                                "--log-format", "json"], env, tmp / "vllama.log")
        conn = _ready(pport, proxy)
        if a.route == "generate":
            path, body = "/api/generate", {"model": "fake-model", "prompt": f"hello [[tokens:{a.tokens}]]", "raw": True}
        else:
            path, body = "/api/chat", {"model": "fake-model", "messages": [{"role": "user", "content": f"hello [[tokens:{a.tokens}]]"}]}
        raw = orjson.dumps({**body, "options": {"num_predict": a.tokens}})

        def one() -> None:
            conn.request("POST", path, raw, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"{path}: {r.status}")

        for _ in range(100):
            one()
        out = Path(a.raw) if a.raw else tmp / "pyspy.txt"
        if a.cprofile:
            os.kill(proxy.pid, signal.SIGUSR1)
        else:
            spy = subprocess.Popen([a.pyspy, "record", "--nonblocking", "--rate", str(a.rate), "--format", "raw", "-o", str(out),
                                    "-p", str(proxy.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.5)  # attached
        t0 = time.perf_counter()
        for _ in range(a.n):
            one()
            time.sleep(0.002)
        wall = time.perf_counter() - t0
        if a.cprofile:
            os.kill(proxy.pid, signal.SIGUSR2)
            for _ in range(100):
                if (tmp / "cprofile.out").exists():
                    break
                time.sleep(0.1)
            time.sleep(0.5)
            if a.raw:
                import shutil

                shutil.copy(tmp / "cprofile.out", a.raw)
            _report_cprofile(tmp / "cprofile.out", a)
        else:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
            _report(out, a, wall)
    finally:
        children.stop_all()


_PLAIN = "import sys\nfrom vllama_proxy.cli import main\nsys.argv[0] = 'vllama'\nsys.exit(main())\n"
#: vllama's entry point with cProfile switched on by SIGUSR1 and dumped by SIGUSR2 (the main thread's calls only).
_CPROFILE = """
import cProfile, signal, sys
from vllama_proxy.cli import main
p = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: p.enable())
def dump(*_):
    p.disable()
    p.dump_stats("OUT")
signal.signal(signal.SIGUSR2, dump)
sys.argv[0] = "vllama"
sys.exit(main())
"""


def _report_cprofile(path: Path, a: argparse.Namespace) -> None:
    import pstats

    st = pstats.Stats(str(path))
    calls = sum(v[1] for v in st.stats.values())
    tt = sum(v[2] for v in st.stats.values())
    print(f"{a.n} requests ({a.route}, {a.tokens} tokens, --mode {a.mode}{', code ' + a.code if a.code else ''}), cProfile: "
          f"{calls / a.n:.0f} function calls and {tt / a.n * 1e6:.0f} µs (profiled) per request")
    rows = [(k, v) for k, v in st.stats.items()]
    for title, key in (("cumulative", 3), ("own", 2)):
        print(f"\n| {title} µs per request | calls per request | function |\n|---|---|---|")
        for (file, line, fn), v in sorted(rows, key=lambda kv: -kv[1][key])[: a.top]:
            where = file.split("site-packages/")[-1].split("wt-c1cut13/")[-1].split("/work/main/")[-1]
            print(f"| {v[key] / a.n * 1e6:.1f} | {v[1] / a.n:.2f} | {fn} ({where}:{line}) |")


def _ready(port: int, proc: subprocess.Popen) -> http.client.HTTPConnection:
    wait_http(f"http://127.0.0.1:{port}/", proc, timeout=120)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the model served (supervised: the stand-in launched and healthy)
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", "/api/ps")
        r = conn.getresponse()
        r.read()
        conn.request("POST", "/api/generate", orjson.dumps({"model": "fake-model", "prompt": "x", "raw": True,
                                                            "options": {"num_predict": 1}}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.status == 200:
            return conn
        conn.close()
        time.sleep(0.5)
    raise TimeoutError("the model never answered")


def _report(path: Path, a: argparse.Namespace, wall: float) -> None:
    incl: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    phases: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        if frames and frames[0].startswith("process "):
            frames = frames[1:]
        if frames and frames[0].startswith("thread "):
            frames = frames[1:]
        total += n
        for f in set(frames):
            incl[f] += n
        self_[frames[-1]] += n
        for f in reversed(frames):
            hit = next((name for name, rx in PHASES if rx.search(f)), None)
            if hit:
                phases[hit] += n
                break
        else:
            phases["other (the loop, the last line, metrics, ledger, log, ...)"] += n
    us = lambda c: c / a.rate / a.n * 1e6  # noqa: E731
    print(f"{a.n} requests ({a.route}, {a.tokens} tokens, --mode {a.mode}{', code ' + a.code if a.code else ''}), "
          f"{total} samples at {a.rate}/s over {wall:.1f} s: {us(total):.0f} µs of vllama's CPU per request")
    print("\n| phase (innermost matching frame) | µs per request |\n|---|---|")
    for name, c in phases.most_common():
        print(f"| {name} | {us(c):.0f} |")
    print(f"\n| inclusive µs per request | frame |\n|---|---|")
    for f, c in incl.most_common(a.top):
        print(f"| {us(c):.0f} | {f[:150]} |")
    print(f"\n| self µs per request | frame |\n|---|---|")
    for f, c in self_.most_common(a.top):
        print(f"| {us(c):.0f} | {f[:150]} |")


if __name__ == "__main__":
    main()
