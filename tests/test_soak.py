"""A short soak (``benchmarks/soak.py``, 150 s): ``vllama serve`` supervising the stand-in vLLM under mixed
traffic from several keys (``ollama`` and ``openai`` clients, streamed and not, clients that leave mid-stream),
a keys-file reload every 20 s, one vLLM restart (SIGKILL) and a storm of 50 SIGHUPs in a second.

Every request is answered or ends with an error in its route's shape (never a stream cut silently, never a hang
past its deadline), no 500 is logged, and RSS and open files of every vllama process stay flat after the
warm-up (the driver's docstring defines flat). The 30-minute run of the same driver is in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.long  # started before the other stand-in tests (conftest.py)
@pytest.mark.timeout(600)  # 150 s of traffic, plus vllama's start and stop: minutes on a loaded 2-core machine
def test_a_short_soak_answers_every_request_and_stays_flat(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration", "150", "--hup-every", "20",
                          "--workdir", str(tmp_path / "work"), "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert out.exists(), f"the soak did not finish:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    r = json.loads(out.read_text())
    shown = run.stdout[-6000:]
    assert r["checks"] == dict.fromkeys(r["checks"], True), shown
    assert r["outcomes"].get("ok", 0) > 100 and r["outcomes"].get("left", 0) > 10, shown  # the traffic really ran
    assert run.returncode == 0, shown
