"""A chat three times the context answers on the real vLLM, its oldest turns dropped (``api/request/context_fit.py``,
Ollama's ``truncate`` and ``shift``): vLLM's own count through its chat template, checked against what vLLM
reports it ran. On the shared tool-model server (``--max-model-len 2048``)."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from .conftest import TOOL_NAME, RealVllama


@pytest.fixture
def server(tool_server: RealVllama) -> RealVllama:
    tool_server.wait_ready()
    return tool_server


def _vllm_url(server: RealVllama) -> str:
    argv = next(json.loads(x)["argv"] for x in server.log.read_text().splitlines() if '"launched"' in x and '"argv"' in x)
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def test_a_chat_three_times_the_context_drops_its_oldest_turns_and_answers(server):
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(60):
        msgs.append({"role": "user", "content": f"Question number {i}: " + "tell me about the weather in Paris " * 6})
        msgs.append({"role": "assistant", "content": f"Answer number {i}: " + "it is sunny and warm today " * 6})
    msgs.append({"role": "user", "content": "And tomorrow?"})
    vllm = _vllm_url(server)
    whole = httpx.post(vllm + "/tokenize", json={"model": TOOL_NAME, "messages": msgs}, timeout=60).json()["count"]
    assert whole > 3 * 2048, whole
    r = ollama.Client(host=server.url, timeout=300).chat(model=TOOL_NAME, messages=msgs, options={"num_predict": 8})
    assert r.done and r.eval_count >= 1
    event = [json.loads(x) for x in server.log.read_text().splitlines() if '"context_fit"' in x][-1]
    assert event["messages_before"] == len(msgs) and 2 < event["messages_after"] < len(msgs)
    kept = [msgs[0], *msgs[len(msgs) - event["messages_after"] + 1:]]  # the system message, then the latest turns
    counted = httpx.post(vllm + "/tokenize", json={"model": TOOL_NAME, "messages": kept, "add_generation_prompt": True},
                         timeout=60).json()["count"]
    assert r.prompt_eval_count == counted <= 2048 - 8, (r.prompt_eval_count, counted)
    r = httpx.post(server.url + "/api/chat", json={"model": TOOL_NAME, "messages": msgs, "truncate": False, "stream": False}, timeout=300)
    assert r.status_code == 400 and r.json()["error"].startswith("input length exceeds maximum context length"), r.text
