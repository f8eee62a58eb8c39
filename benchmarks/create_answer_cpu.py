#!/usr/bin/env python3
"""Create to first answer of a new adapter in ``launch`` mode, on the CPU with the stand-in vLLM (issue 42.3).

Usage: python3 benchmarks/create_answer_cpu.py [--runs 6] [--health-interval 5] [--api-servers 2]
       [--seed 1] [--label NAME] [--out FILE.json]

Starts ``vllama serve`` (the package on ``PYTHONPATH``, so a checkout of main and a branch can be
compared) over the stand-in ``tests/bin/vllm`` with ``--api-server-count 2`` (so ``--adapters auto``
declares adapters at launch), uploads ``tests/assets/tool-lora`` once, then ``--runs`` times: waits a
pause drawn uniformly from [0, --health-interval) (seeded: a create lands at a random phase of the
supervisor's health clock, as a user's does), creates ``adN`` from the base with the adapter
(``/api/create``, not streamed: it returns once vLLM restarted with it declared) and chats with ``adN``
(``/api/chat``, not streamed). Each create restarts the stand-in, which starts at once
(``FAKE_VLLM_START_DELAY`` 0): what is measured is vllama's part of a create, not vLLM's start (76 s
on the H100, ``RESULTS.md``). Prints one line per run and writes the runs as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
LORA = ROOT / "tests" / "assets" / "tool-lora"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--health-interval", type=float, default=5.0)
    ap.add_argument("--api-servers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--out")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="create-answer-") as tmp:
        model = Path(tmp) / "tiny"
        model.mkdir()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PATH": f"{ROOT / 'tests' / 'bin'}:{os.environ['PATH']}", "FAKE_VLLM_PYTHON": sys.executable,
               "VLLAMA_STATE_DIR": str(Path(tmp) / "state"), "VLLAMA_LOG_FORMAT": "json", "HF_HOME": str(Path(tmp) / "hf")}
        cmd = [sys.executable, "-m", "vllama_proxy", "serve", "--model", str(model), "--port", str(port), "--no-gpu-check",
               "--vllm-executable", str(ROOT / "tests" / "bin" / "vllm"),
               "--health-interval", str(a.health_interval), "--", "--api-server-count", str(a.api_servers)]
        log = Path(tmp) / "vllama.log"
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
        runs = []
        try:
            with httpx.Client(base_url=url, timeout=600) as h:
                deadline = time.monotonic() + 120
                while True:
                    try:
                        body = h.get("/readyz").json()
                        if body.get("state") == "ready":
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline or proc.poll() is not None:
                        lines = [x for x in log.read_text().splitlines() if '"/readyz"' not in x]
                        raise SystemExit("vllama not ready; its log:\n" + "\n".join(lines[-30:]))
                    time.sleep(0.1)
                base = body["model"]
                files = {}
                for f in ("adapter_config.json", "adapter_model.safetensors"):
                    data = (LORA / f).read_bytes()
                    digest = "sha256:" + hashlib.sha256(data).hexdigest()
                    h.post(f"/api/blobs/{digest}", content=data).raise_for_status()
                    files[f] = digest
                for i in range(a.runs):
                    pause = rng.uniform(0, a.health_interval)
                    time.sleep(pause)
                    t0 = time.monotonic()
                    r = h.post("/api/create", json={"model": f"ad{i}", "from": base, "adapters": files, "stream": False})
                    r.raise_for_status()
                    t1 = time.monotonic()
                    c = h.post("/api/chat", json={"model": f"ad{i}", "messages": [{"role": "user", "content": "hi"}], "stream": False})
                    c.raise_for_status()
                    t2 = time.monotonic()
                    run = {"run": i, "pause_s": round(pause, 3), "create_s": round(t1 - t0, 3), "first_answer_s": round(t2 - t0, 3)}
                    runs.append(run)
                    print(json.dumps(run), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    answers = [r["first_answer_s"] for r in runs]
    summary = {"label": a.label, "health_interval": a.health_interval, "api_servers": a.api_servers, "seed": a.seed, "runs": runs,
               "first_answer_mean_s": round(statistics.mean(answers), 3), "first_answer_median_s": round(statistics.median(answers), 3),
               "first_answer_max_s": max(answers), "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
