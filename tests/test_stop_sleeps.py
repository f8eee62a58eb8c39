"""Issue 37.5: ``vllama stop M`` then ``vllama run M`` was a cold start (217 s on the CPU, 100+ s
on a GPU). A model vllama launches for ``--model`` now runs with vLLM's sleep mode where vLLM can
(a GPU counted, host RAM for the weights: the on-demand rule of ``supervisor/warm.py``), so ``stop``
puts vLLM to sleep (its GPU memory freed, the process kept), ``ps`` no longer lists it (as Ollama),
the next request wakes it, and it is stopped for real after ``--sleep-unload-after`` asleep.

The stand-in vLLM serves ``/sleep`` and ``/wake_up``; ``tests/fake_nvml`` makes NVML report one GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime

import pytest
from ollama import Client

from conftest import ROOT, TESTS, alive, get_json, log_events

ONE_GPU = {"PYTHONPATH": os.pathsep.join([str(TESTS / "fake_nvml"), os.environ.get("PYTHONPATH", "")]),
           "FAKE_NVML_GPUS": "80:79"}


def launched(v) -> list[list[str]]:
    return [json.loads(x)["argv"] for x in v.log.read_text().splitlines() if '"launched"' in x]


def fake_url(v) -> str:
    argv = launched(v)[-1]
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def vllama_cli(v, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllama_proxy", *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "OLLAMA_HOST": v.url})


def stamp(line: dict) -> float:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def since(body: dict) -> float:
    return datetime.fromisoformat(body["since"].replace("Z", "+00:00")).timestamp()


def test_stop_sleeps_and_run_wakes(vllama):
    v = vllama(env=ONE_GPU, flags=["--keep-alive", "-1"])  # the defaults: no flag asks for sleep
    v.wait_state("ready")
    assert "--enable-sleep-mode" in launched(v)[0]  # nothing after --: vllama chose it
    decided = [json.loads(x) for x in v.log.read_text().splitlines() if '"sleep_on_stop"' in x]
    assert [(d["model"], d["sleep"]) for d in decided] == [("tiny", True)] and "holds the weights" in decided[0]["reason"]
    server = v.server_pid()
    client = Client(host=v.url)
    assert [m.model for m in client.ps().models] == ["tiny:latest"]

    r = vllama_cli(v, "stop", "tiny")
    assert r.returncode == 0 and r.stdout == "", r.stderr
    v.wait_state("sleeping", timeout=10)
    assert client.ps().models == []  # not listed as loaded, as Ollama after a stop
    assert get_json(fake_url(v) + "/_fake/stats")["sleeping"] == 1 and alive(server)  # asleep, not stopped

    r = vllama_cli(v, "run", "tiny", "hello")
    assert r.returncode == 0 and r.stdout.startswith("tok0"), r.stderr
    assert v.server_pid() == server and alive(server)  # woken, not started again
    assert get_json(fake_url(v) + "/_fake/stats")["wakes"] == 1
    assert len(launched(v)) == 1 and [m.model for m in client.ps().models] == ["tiny:latest"]
    assert v.stop() == 0


@pytest.mark.timeout(400)  # its waits are failure bounds; beside a loaded machine the suite's 120 s is not
def test_the_real_unload_comes_after_the_deadline_asleep(vllama):
    v = vllama(env=ONE_GPU, flags=["--keep-alive", "-1", "--sleep-unload-after", "3s"])
    v.wait_state("ready")
    server = v.server_pid()
    # stopped, it sleeps; after --sleep-unload-after asleep, vLLM is stopped for real
    assert vllama_cli(v, "stop", "tiny").returncode == 0
    # the state lines, not /ready polled: a loaded machine's poll can miss the 3 s asleep (bounds are a failure's)
    deadline = time.monotonic() + 120
    while not [e for e in log_events(v.log) if e.get("event") == "state" and e.get("to") == "unloaded"]:
        assert time.monotonic() < deadline, [e for e in log_events(v.log) if e.get("event") == "state"]
        time.sleep(0.05)
    states = [e for e in log_events(v.log) if e.get("event") == "state"]
    asleep = next(e for e in states if e["to"] == "sleeping")
    unloaded = next(e for e in states if e["to"] == "unloaded")
    assert stamp(unloaded) - stamp(asleep) >= 3 - 0.05  # not before the deadline
    deadline = time.monotonic() + 60
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(server)
    unload_line = [json.loads(x) for x in v.log.read_text().splitlines() if '"to":"unloaded"' in x.replace(" ", "")]
    assert unload_line and "--sleep-unload-after" in unload_line[-1]["reason"]
    # and a request after the real unload starts it anew
    assert vllama_cli(v, "run", "tiny", "hi").stdout.startswith("tok0")
    assert len(launched(v)) == 2
    assert v.stop() == 0


def test_turned_off_a_stop_stops_as_before(vllama):
    v = vllama(env=ONE_GPU, flags=["--keep-alive", "-1", "--no-sleep-on-stop"])
    v.wait_state("ready")
    assert "--enable-sleep-mode" not in launched(v)[0]
    server = v.server_pid()
    assert vllama_cli(v, "stop", "tiny").returncode == 0
    v.wait_state("unloaded", timeout=10)
    unload_line = [json.loads(x) for x in v.log.read_text().splitlines() if '"to":"unloaded"' in x.replace(" ", "")]
    assert unload_line and unload_line[-1]["reason"] == "keep_alive expired; stopped: vLLM runs without sleep mode"
    deadline = time.monotonic() + 10
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(server)
    assert v.stop() == 0


def test_eviction_puts_an_idle_model_to_sleep_and_the_swap_back_is_a_wake(vllama, tmp_path):
    """Two configured models that do not fit together on the one GPU, with no sleep_mode given: the
    pool's eviction still makes room, and with the sleep chosen for them the way back is a wake."""
    from test_models_pool import config, events, model_block, wait_states

    ledger = tmp_path / "gpu-ledger.json"  # the stand-ins' shared GPU: a start without room fails
    cfg = config(tmp_path, model_block(tmp_path, "a", gpu_memory_utilization=0.6),
                 model_block(tmp_path, "b", gpu_memory_utilization=0.6, preload=False), top='keep_alive = "-1"\n')
    v = vllama(config=cfg, env={**ONE_GPU, "FAKE_VLLM_GPU_LEDGER": str(ledger)})
    wait_states(v, a="ready", b="unloaded")
    client = Client(host=v.url, timeout=30)
    for model in ("b", "a"):
        assert client.generate(model=model, prompt="x", stream=False).response.startswith("tok0")
    assert events(ledger) == [["start", "a"], ["sleep", "a"], ["start", "b"], ["sleep", "b"], ["wake", "a"]]
    wait_states(v, a="ready", b="sleeping")
    assert v.stop() == 0
