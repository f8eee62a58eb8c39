"""``benchmarks/vllm_gauges.py`` finds vLLM's per-API-server gauges.

vLLM's API servers name themselves with ``setproctitle`` (``VLLM::APIServer_0``), which zero-fills the start of the
memory ``/proc/PID/environ`` shows: ``psutil.Process.environ()`` then returns nothing and the directory in
``PROMETHEUS_MULTIPROC_DIR`` went unfound (the GPU run of 2026-11-28, ``benchmarks/RESULTS.md``). A stand-in process
does what such an API server does: the variable in its environment at exec, a ``mostrecent`` gauge of vLLM's name
written to the directory, then the title.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import vllm_gauges  # noqa: E402

pytest.importorskip("setproctitle")

API_SERVER = """
import sys
from prometheus_client import Gauge
Gauge("vllm:num_requests_running", "running", ["engine"], multiprocess_mode="mostrecent").labels("0").set(645)
import setproctitle
setproctitle.setproctitle("VLLM::APIServer_0")
print("ready", flush=True)
sys.stdin.read()
"""

OTHER = """
import sys
from prometheus_client import Counter
Counter("vllama_requests", "not vLLM's").inc()
print("ready", flush=True)
sys.stdin.read()
"""


def _start(code: str, directory: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)})
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"  # its files are written and open
    return p


def test_an_api_server_named_by_setproctitle_is_found_with_its_gauge(tmp_path: Path) -> None:
    vllm_dir, other_dir = tmp_path / "vllm", tmp_path / "other"
    vllm_dir.mkdir()
    other_dir.mkdir()
    procs = [_start(API_SERVER, vllm_dir), _start(OTHER, other_dir)]
    try:
        server = procs[0]
        assert Path(f"/proc/{server.pid}/cmdline").read_bytes().startswith(b"VLLM::APIServer_0")
        found = vllm_gauges.vllm_dirs(None)
        assert server.pid in found.get(str(vllm_dir), []), found
        rows = vllm_gauges.read(str(vllm_dir))
        assert [(r["name"], r["value"], r["pid"], r["alive"]) for r in rows] == [
            ("vllm:num_requests_running", 645.0, str(server.pid), True)]
        assert vllm_gauges.read(str(other_dir)) == []  # a directory of no vLLM: main() leaves it out
    finally:
        for p in procs:
            p.kill()
            p.wait()
