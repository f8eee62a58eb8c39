#!/usr/bin/env python3
"""What one lone request costs vllama, without vLLM (issue 42, item 4): its system calls, its CPU, its TTFT.

Starts the stand-in vLLM (``tests/fake_vllm.py``, ``FAKE_VLLM_TOKEN_DELAY`` 2 ms) and
``vllama serve --upstream`` in front of it (``--workers``, and ``--code DIR``: the ``vllama_proxy``
found in DIR, e.g. an older commit's ``git archive``, instead of this checkout's), waits for every
worker, then sends ``--n`` ``/api/generate`` requests one at a time on one keep-alive connection
(``--tokens`` output tokens each, 3 ms apart) and reports:

* **system calls per request** (``--strace``: ``strace -c -f`` attached to every vllama process
  while the requests run; the count is exact, not a timing, so it compares across loaded machines);
* **CPU per request** (psutil, user + system of every vllama process, over the requests);
* **TTFT** as the blocking client sees it, p10 / p50 / p90, and vllama's own stage timings
  (``hop_report.py stages`` over ``/metrics`` before and after).

    python benchmarks/c1_requests.py [--n 300] [--tokens 2] [--workers 1] [--code DIR] [--strace]

Always stops its subprocesses.
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from procs import Children, free_port, wait_http  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="requests measured (after 50 of warm-up)")
    ap.add_argument("--tokens", type=int, default=2, help="output tokens per request")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--code", default=None, help="a folder holding the vllama_proxy to run (default: this checkout's)")
    ap.add_argument("--strace", action="store_true", help="count the system calls per request (needs strace)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vllama-c1-"))
    env = {**os.environ, "FAKE_VLLM_TOKEN_DELAY": "0.002", "VLLAMA_STATE_DIR": str(tmp / "state")}
    children = Children()
    try:
        fport, pport = free_port(), free_port()
        fake = children.start([sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", str(tmp / "m"), "--port",
                               str(fport), "--served-model-name", "fake-model"], env, tmp / "fake.log")
        wait_http(f"http://127.0.0.1:{fport}/health", fake)
        launcher = (["-c", f"import sys; sys.path.insert(0, {a.code!r}); from vllama_proxy.cli import main; sys.exit(main())"]
                    if a.code else ["-m", "vllama_proxy"])
        proxy = children.start([sys.executable, *launcher, "serve", "--upstream", f"http://127.0.0.1:{fport}", "--port",
                                str(pport), "--workers", str(a.workers)], env, tmp / "vllama.log")
        wait_http(f"http://127.0.0.1:{pport}/", proxy)
        for _ in range(600):  # every worker listens (a worker still importing would count as the requests' CPU)
            if (tmp / "vllama.log").read_text().count("worker_listening") >= a.workers - 1:
                break
            time.sleep(0.1)
        time.sleep(2)
        conn = http.client.HTTPConnection("127.0.0.1", pport)
        body = orjson.dumps({"model": "fake-model", "prompt": f"hello [[tokens:{a.tokens}]]", "raw": True,
                             "options": {"num_predict": a.tokens}})

        def one() -> float:
            t0 = time.perf_counter_ns()
            conn.request("POST", "/api/generate", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            first = None
            while True:
                line = r.readline()
                first = first or time.perf_counter_ns()
                if not line or b'"done":true' in line:
                    break
            r.read()
            return (first - t0) / 1e3

        for _ in range(50):
            one()
        report = [sys.executable, str(HERE / "hop_report.py")]
        subprocess.run([*report, "metrics", f"http://127.0.0.1:{pport}", str(tmp / "m0")], check=True)
        procs = [psutil.Process(proxy.pid), *psutil.Process(proxy.pid).children(recursive=True)]
        cpu = lambda: sum(p.cpu_times().user + p.cpu_times().system for p in procs)  # noqa: E731
        st = None
        if a.strace:
            st = subprocess.Popen(["strace", "-c", "-f", "-o", str(tmp / "strace.txt"),
                                   *[x for p in procs for x in ("-p", str(p.pid))]], stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached
        c0 = cpu()
        ttft = []
        for _ in range(a.n):
            ttft.append(one())
            time.sleep(0.003)
        c1 = cpu()
        if st is not None:
            st.send_signal(signal.SIGINT)
            st.wait()
        subprocess.run([*report, "metrics", f"http://127.0.0.1:{pport}", str(tmp / "m1")], check=True)
        ttft.sort()
        print(f"{a.n} requests of {a.tokens} tokens, vllama --workers {a.workers}"
              f"{' from ' + a.code if a.code else ''}, {os.cpu_count()} CPUs")
        print(f"vllama CPU per request: {(c1 - c0) / a.n * 1e6:.0f} µs")
        print(f"client TTFT µs: p10 {ttft[len(ttft) // 10]:.0f}, p50 {ttft[len(ttft) // 2]:.0f}, p90 {ttft[9 * len(ttft) // 10]:.0f}")
        if st is not None:
            calls: dict[str, int] = {}
            for line in (tmp / "strace.txt").read_text().splitlines():
                p = line.split()
                if len(p) >= 5 and p[-1] != "total" and p[3].isdigit():
                    calls[p[-1]] = int(p[3])
            per = {k: round(v / a.n, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v >= a.n // 4}
            print(f"system calls per request: {sum(calls.values()) / a.n:.1f} ({per})")
        subprocess.run([*report, "stages", str(tmp / "m0"), str(tmp / "m1")], check=True)
    finally:
        children.stop_all()


if __name__ == "__main__":
    main()
