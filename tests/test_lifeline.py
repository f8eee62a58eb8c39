"""lifeline.py: launch records, and stopping a tree an earlier vllama left (issue 19.3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from vllama_proxy.supervisor import lifeline

# A root in a new session (as vllama launches vLLM) that starts a child titled like vLLM's engine
# core, whose environment, as with vLLM's setproctitle, no longer shows the marker; then the root
# is killed, as a SIGKILLed vLLM API server would be, leaving the engine core orphaned.
ROOT = """
import os, subprocess, sys, time
env = {k: v for k, v in os.environ.items() if k != "VLLAMA_TREE"}
child = subprocess.Popen(["VLLM::EngineCore", "-c", "import time; time.sleep(120)"], executable=sys.executable, env=env)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_an_orphaned_engine_core_of_a_dead_vllama_is_stopped(tmp_path):
    marker = lifeline.new_marker()
    root = subprocess.Popen([sys.executable, "-c", ROOT], env={**os.environ, lifeline.MARKER: marker},
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    engine = int(root.stdout.readline())
    # a record as a vllama that has since died wrote it: its owner is a process that is gone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "children").mkdir()
    (tmp_path / "children" / f"{marker}.json").write_text(json.dumps({
        "marker": marker, "pgid": root.pid, "model": "m", "owner_pid": dead.pid, "owner_started": 0.0,
        "launched": time.time() - 5}))
    os.kill(root.pid, signal.SIGKILL)
    root.wait()
    assert psutil.Process(engine).is_running() and lifeline.marked(marker) == []  # only findable by session + title
    stopped = lifeline.stop_stale(tmp_path, grace=2)
    assert [b["pids"] for b in stopped] == [[engine]]
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE
    assert list((tmp_path / "children").glob("*.json")) == []


def test_a_record_of_a_running_vllama_is_left_alone(tmp_path):
    marker = lifeline.new_marker()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, lifeline.MARKER: marker},
                            start_new_session=True)
    try:
        owner = psutil.Process(proc.pid)  # stands for another vllama that is alive
        (tmp_path / "children").mkdir()
        (tmp_path / "children" / f"{marker}.json").write_text(json.dumps({
            "marker": marker, "pgid": proc.pid, "model": "m", "owner_pid": owner.pid, "owner_started": owner.create_time(),
            "launched": time.time()}))
        assert lifeline.stop_stale(tmp_path, grace=1) == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
