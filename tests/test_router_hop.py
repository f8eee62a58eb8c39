"""Issue 43's hop: the benchmarks that measure what vllm-router costs between the front and the nodes.

- ``benchmarks/loadgen.py --cpu-by-kind`` must count the real router as ``router``: vllm-router renames
  its process (``/proc/PID/cmdline`` reads ``vllm::router``), so matching ``vllm-router`` filed its
  CPU under ``other`` (the GPU diag of 2026-11-26 read 2.45 cores of "other" at 64.8k tok/s: the router);
  and a vllama node as ``vllama`` even when its command line ends with ``--vllm-executable .../vllm``.
- ``benchmarks/router_hop.py`` on the stand-ins behind the real router: what a worker receives through
  the router against a direct call, and the router's CPU per token, in paired blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import free_port, wait_http

pytest.importorskip("vllm_router")
ROOT = Path(__file__).resolve().parent.parent
ROUTER_BIN = Path(sys.executable).parent / "vllm-router"
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_loadgen_counts_the_real_router_as_router():
    import loadgen

    port = free_port()
    p = subprocess.Popen([str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                          "--policy", "round_robin"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/liveness", p, timeout=30)
        cmd = " ".join(psutil.Process(p.pid).cmdline())
        assert loadgen._kind(cmd) == "router", cmd
        assert "router" in loadgen.machine_cpu()
    finally:
        p.terminate()
        p.wait(10)


def test_router_hop_benchmark_on_stand_ins(tmp_path):
    out = tmp_path / "hop.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "router_hop.py"), "--streams", "4", "--requests", "8",
                        "--tokens", "4", "--token-delay", "0.01", "--blocks", "1", "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    pair = res["blocks"][0]
    assert pair["direct"]["ok"] == pair["router"]["ok"] == 8
    # the router re-serializes the body with its own defaults; the stream arrives event by event both ways
    assert "include_reasoning" in res["capture"]["fields_added"]
    assert res["capture"]["worker_requests_per_chat"] == {"/v1/chat/completions": 1}
    assert "router" in res["summary"]["router"]["us_per_token"]  # its CPU counted (too little here to be above 0)
    assert "router − direct" in res["report"]


def test_loadgen_counts_a_node_whose_command_ends_with_its_vllm_executable_as_vllama():
    """``vllama serve ... --vllm-executable /x/bin/vllm`` (router_hop.py's nodes, the test fleets) is vllama, not
    vLLM: the ``.../vllm`` ending no longer wins."""
    import loadgen

    assert loadgen._kind("python -m vllama_proxy serve --model m --vllm-executable /x/tests/bin/vllm") == "vllama"
    assert loadgen._kind("python -m vllama_proxy serve --upstream http://r:30000") == "vllama_front"
    assert loadgen._kind("/x/tests/bin/vllm serve m --port 8000") == "vllm_api"


def test_router_hop_quantiles_are_quantiles():
    """Its p50/p90/p99 were loadgen.percentile(xs, 0.5): the 0.5th percentile (that function takes percent)."""
    import router_hop

    xs = [float(x) for x in range(101)]
    assert (router_hop.quantile(xs, 0.5), router_hop.quantile(xs, 0.9), router_hop.quantile(xs, 0.99)) == (50.0, 90.0, 99.0)


def test_session_turnaround_benchmark_on_stand_ins(tmp_path):
    """benchmarks/session_turnaround.py (issue 43): the stand-ins stamp each arrival, so every request is matched to
    the stand-in that got it, and each stream's turnaround (its answer's end -> its next request at a stand-in) is
    counted, through the router alone and through a front whose one-request keys the router places and releases."""
    out = tmp_path / "t.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "session_turnaround.py"), "--paths", "rr,front-on",
                        "--baseline", "rr", "--streams", "2", "--requests", "8", "--tokens", "4", "--token-delay", "0.01",
                        "--blocks", "1", "--json", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    for path in ("rr", "front-on"):
        b = res["blocks"][0][path]
        assert b["ok"] == b["matched"] == 8 and sum(b["per_worker"]) == 8
        assert b["turnaround_p50"] is not None and b["turnaround_p50"] > 0  # 3 per stream: 6 measured
        assert b["router_connections_seen"] >= 1
    assert "front-on" in res["summary"]["minus_baseline"]
