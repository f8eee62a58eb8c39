"""A chat longer than the model's context answers, as Ollama's ``truncate`` and ``shift`` (default true) make it
(``api/request/context_fit.py``): the oldest turns are dropped (the system message and the last turn kept), an output over
the room left is lowered; ``truncate: false`` keeps the refusal in Ollama's words. Against the stand-in vLLM, which
refuses a prompt over its context (``--max-model-len``) as vLLM does and counts words as tokens; the real vLLM's
count: ``tests/real_engine/test_real_context_fit.py``.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from conftest import SERVED, start_fake, start_proxy, stop


@pytest.fixture
def small(model_dir, tmp_path):
    fake = start_fake(model_dir, extra=["--max-model-len", "200"])
    proxy = start_proxy(fake.url, log=tmp_path / "vllama.log", vllm_args=["--max-model-len", "200"])
    yield proxy, fake, tmp_path / "vllama.log"
    stop(proxy.proc)
    stop(fake.proc)


def _conversation(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i} " + "word " * 20})
        msgs.append({"role": "assistant", "content": f"answer {i} " + "word " * 20})
    msgs.append({"role": "user", "content": "the last question"})
    return msgs


def test_a_chat_three_times_the_context_drops_its_oldest_turns_and_answers(small):
    proxy, fake, log = small
    msgs = _conversation(15)  # ~650 words: three times the 200-token context
    httpx.delete(fake.url + "/_fake/requests")
    r = ollama.Client(host=proxy.url).chat(model=SERVED, messages=msgs, options={"num_predict": 10})
    assert r.done and r.message.content
    sent = [c["body"]["messages"] for c in httpx.get(fake.url + "/_fake/requests").json() if c["path"] == "/v1/chat/completions"]
    assert len(sent) == 2 and sent[0] == msgs  # refused whole, then sent fitted
    kept = sent[1]
    assert kept[0] == msgs[0] and kept[-1] == msgs[-1] and len(kept) < len(msgs)
    assert kept[1:] == msgs[len(msgs) - len(kept) + 1:]  # what is dropped is the oldest turns, in order
    assert 0 < r.prompt_eval_count <= 200 - 10
    events = [json.loads(x) for x in log.read_text().splitlines() if '"context_fit"' in x]
    assert events and events[0]["messages_before"] == len(msgs) and events[0]["messages_after"] == len(kept)


def test_truncate_false_keeps_the_refusal_in_ollamas_words(small):
    proxy, _, _ = small
    r = httpx.post(proxy.url + "/api/chat", json={"model": SERVED, "messages": _conversation(15), "truncate": False,
                                                  "stream": False}, timeout=30)
    assert r.status_code == 400 and r.json()["error"].startswith("input length exceeds maximum context length"), r.text


def test_an_output_over_the_room_left_is_lowered_to_it_unless_shift_is_false(small):
    proxy, _, _ = small
    msgs = [{"role": "user", "content": "word " * 150}]
    r = ollama.Client(host=proxy.url).chat(model=SERVED, messages=msgs, options={"num_predict": 120})
    assert r.done and r.prompt_eval_count + r.eval_count <= 200
    r = httpx.post(proxy.url + "/api/chat", json={"model": SERVED, "messages": msgs, "shift": False, "stream": False,
                                                  "options": {"num_predict": 120}}, timeout=30)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"], r.text
