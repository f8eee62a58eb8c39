#!/usr/bin/env python3
"""What ``--state-url`` adds to a request, on loopback (issue 43: limits across fronts).

Starts a ``redis-server`` (no persistence), the stand-in vLLM (``tests/fake_vllm.py``, no token
delay) and two ``vllama serve --upstream`` fronts with the same keys file: ``local`` without a
store, ``shared`` with ``--state-url``. The key has every limit the store shares (``rpm``, ``tpm``,
``max_in_flight``, fair sharing on), so a request to ``shared`` makes every round trip it can:
``admit`` at admission, ``finish`` at its end. One blocking client sends one
non-streamed request (1 output token) at a time, alternating between the two fronts request by
request (no drift between them), and prints the request time's p50/p90 per front and the
difference. Then the store's own calls, from one process (``RedisKeyState``: the two round trips
of a request, in turn), p50/p90 each.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/shared_state_cost.py [--n 1000] [--json OUT]

Needs ``redis-server`` on PATH and the ``redis`` package (``vllama-proxy[redis]``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from conftest import (  # the tests' own helpers
    ALIAS,
    free_port,
    start_fake,
    start_proxy,
    stop,
    write_model_dir,
)
from loadgen import percentile

KEYS = """
[[keys]]
name = "bench"
key = "sk-bench"
rpm = 1000000000
tpm = 1000000000000
max_in_flight = 1000000
"""


def _redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    """A ``redis-server`` on a free loopback port, no persistence: ``(process, url)``."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, check=False).stdout.strip() != "PONG":
        if proc.poll() is not None:
            sys.exit("redis-server did not start")
        time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def front_to_front(n: int, tmp: Path, url: str) -> dict[str, list[float]]:
    fake = start_fake(write_model_dir(tmp / "fake-model"), env={"FAKE_VLLM_TOKEN_DELAY": "0"})
    keys = tmp / "keys.toml"
    keys.write_text(KEYS)
    common = ("--api-key-file", str(keys), "--fair-share", "on", "--workers", "1")
    fronts = {"local": start_proxy(fake.url, *common), "shared": start_proxy(fake.url, *common, "--state-url", url)}
    times: dict[str, list[float]] = {k: [] for k in fronts}
    body = {"model": ALIAS, "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
    try:
        with httpx.Client(timeout=30, headers={"Authorization": "Bearer sk-bench"}) as http:
            for _ in range(50):  # warm: connections, the fronts' first requests
                for f in fronts.values():
                    http.post(f.url + "/api/generate", json=body).raise_for_status()
            for _ in range(n):
                for name, f in fronts.items():
                    t = time.perf_counter()
                    r = http.post(f.url + "/api/generate", json=body)
                    times[name].append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text
    finally:
        for s in (*fronts.values(), fake):
            stop(s.proc)
    return times


async def store_calls(n: int, url: str) -> dict[str, list[float]]:
    from vllama_proxy.api.shared_state import RedisKeyState

    s = RedisKeyState(url)
    times: dict[str, list[float]] = {"admit": [], "finish": []}
    try:
        for i in range(n + 50):
            t0 = time.perf_counter()
            await s.admit("bench", 10**9, 10**12, 10**6, count=True)
            t1 = time.perf_counter()
            await s.finish("bench", leave=True, tokens=10, served=12.0)
            t2 = time.perf_counter()
            if i >= 50:
                times["admit"].append(t1 - t0), times["finish"].append(t2 - t1)
    finally:
        await s.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="requests per front (and store calls of each kind)")
    ap.add_argument("--json", type=Path, help="write every sample here")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("needs redis-server on PATH")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        redis, url = _redis(tmp)
        try:
            fronts = front_to_front(args.n, tmp, url)
            calls = asyncio.run(store_calls(args.n, url))
        finally:
            stop(redis)

    def ms(xs: list[float], p: float) -> float:
        return percentile(sorted(xs), p) * 1000

    print(f"request time, one at a time, alternating ({args.n} each):")
    for name, xs in fronts.items():
        print(f"  {name:7s} p50 {ms(xs, 50):7.3f} ms   p90 {ms(xs, 90):7.3f} ms")
    print(f"  added   p50 {ms(fronts['shared'], 50) - ms(fronts['local'], 50):+7.3f} ms   "
          f"p90 {ms(fronts['shared'], 90) - ms(fronts['local'], 90):+7.3f} ms")
    print("store calls from one process:")
    for name, xs in calls.items():
        print(f"  {name:7s} p50 {ms(xs, 50):7.3f} ms   p90 {ms(xs, 90):7.3f} ms")
    if args.json:
        args.json.write_text(json.dumps({"fronts": fronts, "store": calls}))


if __name__ == "__main__":
    main()
