"""LoRA adapters at create time (issue 30): what is refused with a 400, and the limits vLLM is started with.

The shipped adapter (``tests/assets/tool-lora``) against the shipped tool model's config, and
copies of it changed to break one rule each; the real vLLM serving it is in
``tests/real_engine/test_real_adapters.py``.
"""

from __future__ import annotations

import json
import shutil
import struct
import threading
import time

import pytest

from conftest import ROOT, log_events, wait_events
from vllama_proxy.errors import BadRequest
from vllama_proxy.models.adapters import LoraPlan, check_adapter, lora_plan
from vllama_proxy.models.launch_spec import vllm_arg
from vllama_proxy.models.created import CreatedModel

LORA = ROOT / "tests" / "assets" / "tool-lora"
BASE_CONFIG = json.loads((ROOT / "tests" / "assets" / "tool-model" / "config.json").read_text())


@pytest.fixture
def lora(tmp_path):
    d = tmp_path / "lora"
    shutil.copytree(LORA, d)
    return d


def test_the_shipped_adapter_fits_the_tool_model(lora):
    assert check_adapter(lora, BASE_CONFIG, str(ROOT / "tests" / "assets" / "tool-model")) == 8


def test_base_mismatch_by_shape_and_by_layers(lora):
    bigger = {**BASE_CONFIG, "hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8}
    with pytest.raises(BadRequest, match="base mismatch: the adapter's .* has size (384|1024)"):
        check_adapter(lora, bigger, "/models/other")
    with pytest.raises(BadRequest, match="base mismatch: the adapter has layer [45], the model 4 layers"):
        check_adapter(lora, {**BASE_CONFIG, "num_hidden_layers": 4}, "/models/other")


def test_base_mismatch_by_repo(lora):
    cfg = json.loads((lora / "adapter_config.json").read_text())
    (lora / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "Qwen/Qwen2.5-7B-Instruct"}))
    with pytest.raises(BadRequest, match="made for Qwen/Qwen2.5-7B-Instruct, the model is meta-llama/Llama-3.1-8B"):
        check_adapter(lora, BASE_CONFIG, "meta-llama/Llama-3.1-8B")


def test_rank_over_the_limit_gguf_and_not_lora(lora, tmp_path):
    cfg = json.loads((lora / "adapter_config.json").read_text())
    (lora / "adapter_config.json").write_text(json.dumps({**cfg, "r": 1024}))
    with pytest.raises(BadRequest, match="rank 1024 is over vLLM's largest --max-lora-rank"):
        check_adapter(lora, BASE_CONFIG, "x")
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "adapter.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3))
    with pytest.raises(BadRequest, match="GGUF adapters are not served"):
        check_adapter(gguf, BASE_CONFIG, "x")
    (lora / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    with pytest.raises(BadRequest, match="not LoRA"):
        check_adapter(lora, BASE_CONFIG, "x")


def test_limits_grow_only_when_they_must(lora, tmp_path):
    def made(name, path, base="tool"):
        return CreatedModel(name=name, base=base, parent=base, adapters={name: str(path)})

    assert lora_plan([], "tool") == LoraPlan() and LoraPlan().args() == []
    one = lora_plan([made("a", lora)], "tool")
    assert one.args() == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16", "--lora-modules", f"a={lora}"]
    assert not LoraPlan().covers(one)  # LoRA off -> on: a restart
    two = lora_plan([made("a", lora), made("b", lora), made("c", lora, base="other")], "tool")
    assert one.covers(two) and two.modules.keys() == {"a", "b"}  # same rank, within 4: loaded at run time
    big = tmp_path / "big"
    shutil.copytree(lora, big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 64}))
    grown = lora_plan([made("a", lora), made("d", big)], "tool")
    assert grown.max_rank == 64 and not one.covers(grown)  # a larger rank: a restart


def test_create_with_an_adapter_of_another_base_is_a_400(client):
    """Through the real ollama client: the shipped adapter (hidden size 384) on the stand-in's model (64)."""
    import ollama

    files = {f.name: client.create_blob(f) for f in (LORA / "adapter_config.json", LORA / "adapter_model.safetensors")}
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="mango", from_="fake-model", adapters=files)
    assert e.value.status_code == 400 and e.value.error.startswith("base mismatch: the adapter's base_model.model.model.layers.")
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="mango", from_="fake-model", adapters={"adapter_config.json": files["adapter_config.json"]})
    assert e.value.status_code == 400 and "no adapter_model.safetensors" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="mango", from_="fake-model", adapters=files, files=files)
    assert e.value.status_code == 400
    assert "mango:latest" not in {m.model for m in client.list().models}


def test_adapter_sources_a_local_directory_and_a_hugging_face_repo(proxy, hub_proxy):
    """ADAPTER in a Modelfile: a PEFT directory on the server (read and checked: the shipped one does
    not fit the stand-in's model), a repo id fetched through huggingface_hub (the fake Hub: a model
    repo is no adapter, a gated one cannot be fetched)."""
    import httpx

    def create(url, adapter):
        body = {"model": "ad", "modelfile": f"FROM fake-model\nADAPTER {adapter}\n", "stream": False}
        return httpx.post(url + "/api/create", json=body, timeout=60)

    r = create(proxy.url, LORA)
    assert r.status_code == 400 and r.json()["error"].startswith("base mismatch"), r.text
    r = create(proxy.url, "/no/such/adapter")
    assert r.status_code == 400 and "no such directory" in r.json()["error"]
    r = create(hub_proxy.url, "acme/tiny-notlora")
    assert r.status_code == 400 and "no readable adapter_config.json" in r.json()["error"], r.text
    r = create(hub_proxy.url, "acme/gated-model")
    assert r.status_code == 400 and "cannot fetch it from Hugging Face" in r.json()["error"], r.text


def test_max_loras_grows_in_steps_and_the_mode_follows_the_api_servers(lora):
    """``--max-loras`` is part of vLLM's compile cache key (``LoRAConfig.compute_hash``), ``--lora-modules``
    is not: the limit grows in powers of two so that most creates keep the key. ``--adapters auto``
    declares adapters at launch when vLLM runs several API servers (runtime loading would cut them to one)."""
    from vllama_proxy.models.adapters import adapter_mode

    def made(name):
        return CreatedModel(name=name, base="tool", parent="tool", adapters={name: str(lora)})

    assert [lora_plan([made(f"a{i}") for i in range(n)], "tool").max_loras for n in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 16]
    four = lora_plan([made(f"a{i}") for i in range(4)], "tool")
    three = lora_plan([made(f"a{i}") for i in range(3)], "tool")
    assert three.declares(three) and four.declares(three)  # a deleted adapter: no restart
    assert not three.declares(four) and three.covers(four)  # a new one: a restart at launch, none at run time
    assert three.needs_restart(four, "launch") and not three.needs_restart(four, "runtime")
    assert adapter_mode("auto", ["--api-server-count", "8"]).mode == "launch"
    assert adapter_mode("auto", ["--api-server-count=1"]).mode == "runtime" and adapter_mode("auto", []).mode == "runtime"
    assert adapter_mode("runtime", ["-asc", "8"]).mode == "runtime" and adapter_mode("launch", []).mode == "launch"


def test_an_adapter_is_declared_at_launch_and_vllm_keeps_its_api_servers(vllama):
    """Issue 42.3 on the stand-in, which refuses several API servers with runtime LoRA loading as vLLM
    does: with 2 API servers (so ``--adapters auto`` is ``launch``) each created adapter restarts vLLM
    with it in ``--lora-modules`` and 2 API servers still, and is answered under its name; the base
    model's requests meanwhile wait for the start and are answered."""
    import ollama

    v = vllama(vllm_args=["--api-server-count", "2"])
    body = v.wait_state("ready")
    base = body["model"]
    client = ollama.Client(host=v.url, timeout=60)
    files = {f.name: client.create_blob(f) for f in (LORA / "adapter_config.json", LORA / "adapter_model.safetensors")}
    pids = [v.server_pid()]
    for name in ("mango", "mango2"):
        progress = [p.status for p in client.create(model=name, from_=base, adapters=files, stream=True)]
        assert progress[-1] == "success", progress
        assert any("restarted the base model with LoRA declared at launch, its API servers kept" in p
                   for p in progress), progress
        pids.append(v.server_pid())
        argv = [line["argv"] for line in log_events(v.log) if line.get("event") == "launched"][-1]
        assert vllm_arg(argv, "--api-server-count") == "2", argv
        declared = argv[argv.index("--lora-modules") + 1:]
        assert [m.split("=")[0] for m in declared] == ["mango", "mango2"][:len(pids) - 1], argv
        assert client.chat(model=name, messages=[{"role": "user", "content": "hi"}]).message.content
        assert client.chat(model=base, messages=[{"role": "user", "content": "hi"}]).message.content
    assert len(set(pids)) == 3, pids  # a restart per adapter, at launch
    modes = [line for line in log_events(v.log) if line.get("event") == "lora_mode"]
    assert modes[-1]["mode"] == "launch" and modes[-1]["adapters"] == ["mango", "mango2"], modes


def test_a_busy_base_drains_for_the_restart_and_serves_the_new_adapter(vllama):
    """Launch mode under steady load (three clients back to back, so the base is never idle): the
    restart closes the base to new requests, lets those in flight finish, restarts with the adapter
    declared, and the waiting requests are then answered; none fails, and the adapter answers. On
    runtime-only vllama the restart waited for an idle moment that never came."""
    import threading

    import httpx
    import ollama

    v = vllama(vllm_args=["--api-server-count", "2"], env={"FAKE_VLLM_TOKEN_DELAY": "0.02"})
    base = v.wait_state("ready")["model"]
    client = ollama.Client(host=v.url, timeout=60)
    files = {f.name: client.create_blob(f) for f in (LORA / "adapter_config.json", LORA / "adapter_model.safetensors")}
    done = threading.Event()
    answers: list[tuple[int, bool]] = []

    def busy() -> None:
        with httpx.Client(timeout=120) as h:
            while not done.is_set():
                r = h.post(v.url + "/api/generate", json={"model": base, "prompt": "[[tokens:25]]", "stream": False})
                answers.append((r.status_code, r.status_code == 200 and r.json()["eval_count"] == 25))

    threads = [threading.Thread(target=busy) for _ in range(3)]
    for i, t in enumerate(threads):
        t.start()
        while len(answers) < i:  # staggered by one answer each: one of them is always in flight
            threading.Event().wait(0.01)
    try:
        first = v.server_pid()
        progress = [p.status for p in client.create(model="mango", from_=base, adapters=files, stream=True)]
        assert any("restarted the base model with LoRA declared at launch" in p for p in progress), progress
        assert v.server_pid() != first
        assert client.chat(model="mango", messages=[{"role": "user", "content": "hi"}]).message.content
        during = len(answers)
        while len(answers) < during + 3:  # the clients go on after the restart
            threading.Event().wait(0.05)
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert answers and all(ok for _, ok in answers), answers
    assert any(line.get("event") == "draining" for line in log_events(v.log))


def test_adapters_runtime_overrides_auto_one_api_server_and_no_restart_for_the_second(vllama):
    """``--adapters runtime`` where auto would declare at launch: vLLM runs one API server (the
    stand-in, as vLLM, refuses runtime loading with two), the first adapter turns LoRA on (a restart),
    the second loads into the running vLLM, and both answer."""
    import ollama

    v = vllama(flags=["--adapters", "runtime"], vllm_args=["--api-server-count", "2"])
    base = v.wait_state("ready")["model"]
    client = ollama.Client(host=v.url, timeout=60)
    files = {f.name: client.create_blob(f) for f in (LORA / "adapter_config.json", LORA / "adapter_model.safetensors")}
    first = [p.status for p in client.create(model="mango", from_=base, adapters=files, stream=True)]
    assert any(p.startswith("restarted the base model with LoRA (4 adapters per batch") for p in first), first
    pid = v.server_pid()
    second = [p.status for p in client.create(model="mango2", from_=base, adapters=files, stream=True)]
    assert "loaded the adapter into the running model" in second and v.server_pid() == pid, second
    argv = [line["argv"] for line in log_events(v.log) if line.get("event") == "launched"][-1]
    assert vllm_arg(argv, "--api-server-count") == "1", argv
    for name in ("mango", "mango2", base):
        assert client.chat(model=name, messages=[{"role": "user", "content": "hi"}]).message.content
    modes = [line for line in log_events(v.log) if line.get("event") == "lora_mode"]
    assert modes[-1]["mode"] == "runtime" and modes[-1]["why"] == "--adapters runtime", modes


def _create(client, name: str, base: str, files: dict[str, str], out: list[str]) -> None:
    out.extend(p.status for p in client.create(model=name, from_=base, adapters=files, stream=True))


def test_a_create_in_launch_mode_restarts_the_base_at_once_not_at_the_next_health_check(vllama):
    """Issue 42.3, the house: the create tells the base model's owner loop (``StatusBoard.adapters_changed``,
    an ``ADAPTERS`` message), which restarts vLLM with the adapter declared at once. Before, the
    supervisor found the adapter by reading the created models at each health check (``--health-interval``):
    with 60 s the first check of the ready vLLM comes 60 s after it became ready, so a create that ends
    well before that was told."""
    import ollama

    v = vllama(flags=["--health-interval", "60"], vllm_args=["--api-server-count", "2"])
    base = v.wait_state("ready")["model"]
    ready = time.monotonic()
    client = ollama.Client(host=v.url, timeout=55)
    files = {f.name: client.create_blob(f) for f in (LORA / "adapter_config.json", LORA / "adapter_model.safetensors")}
    first = v.server_pid()
    progress: list[str] = []
    _create(client, "mango", base, files, progress)
    took = time.monotonic() - ready
    assert any("restarted the base model with LoRA declared at launch" in p for p in progress), progress
    assert took < 45, f"the create ended {took:.1f} s after ready: the restart waited for the health check"
    assert v.server_pid() != first
    argv = [line["argv"] for line in log_events(v.log) if line.get("event") == "launched"][-1]
    assert argv[argv.index("--lora-modules") + 1:][0].startswith("mango="), argv
    assert client.chat(model="mango", messages=[{"role": "user", "content": "hi"}]).message.content


def test_in_runtime_mode_a_busy_base_restarts_for_the_adapter_when_its_last_request_ends(vllama):
    """``--adapters runtime`` restarts only an idle vLLM (the first adapter turns LoRA on: a restart). A
    create while a stream is in flight: the supervisor is told, waits (``lora_restart_waits``; the stream
    goes on, the same vLLM), and the end of that stream (the board's ``IDLE``) starts the restart, not
    the next health check 60 s away."""
    import httpx
    import ollama

    v = vllama(flags=["--adapters", "runtime", "--health-interval", "60"], env={"FAKE_VLLM_TOKEN_DELAY": "0.05"})
    base = v.wait_state("ready")["model"]
    client = ollama.Client(host=v.url, timeout=55)
    files = {f.name: client.create_blob(f) for f in (LORA / "adapter_config.json", LORA / "adapter_model.safetensors")}
    first = v.server_pid()
    progress: list[str] = []
    creating = threading.Thread(target=_create, args=(client, "mango", base, files, progress))
    with httpx.Client(timeout=60) as h, h.stream("POST", v.url + "/api/generate",
                                                 json={"model": base, "prompt": "[[tokens:5000]]"}) as r:
        lines = r.iter_lines()
        assert not json.loads(next(lines))["done"]  # in flight
        creating.start()
        wait_events(v.log, "lora_restart_waits", 1, timeout=40)
        after = [json.loads(next(lines)) for _ in range(3)]  # the stream goes on: no restart under it
        assert not any(x["done"] for x in after), after
        assert v.server_pid() == first and creating.is_alive()
        ended = time.monotonic()
    # the stream closed: its request ends, the last in flight (IDLE)
    creating.join(55)
    took = time.monotonic() - ended
    assert not creating.is_alive() and any(p.startswith("restarted the base model with LoRA (4 adapters per batch") for p in progress), progress
    assert took < 45, f"the create ended {took:.1f} s after the base became idle: the restart waited for the health check"
    assert v.server_pid() != first
    assert client.chat(model="mango", messages=[{"role": "user", "content": "hi"}]).message.content
