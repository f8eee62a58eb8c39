"""Fair sharing on the real vLLM (issue 27): with a keys file, vllama runs vLLM with
``--scheduling-policy priority`` and sets each request's ``priority``; the real vLLM 0.32 accepts
both, through the Ollama routes and the OpenAI passthrough, for a user key and an admin key. Each
key's ``cache_salt`` (``--cache-isolation key``) too, and its prefix cache is its own.

The session's ``keys_server`` (``conftest.py``, shared with test_real_gate.py, whose tests run on it first): the tiny
model with one keys file holding every key the tests use (``root`` an admin, ``alice`` with a priority, ``carol``
with a ``max_tokens`` cap). The tests run in file order: the first checks the counters and the ledger before the
second uses a key.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import ollama
import openai
import pytest

from .conftest import RealVllama


@pytest.fixture
def server(keys_server) -> RealVllama:
    return keys_server


def test_keys_file_runs_vllm_with_priority_scheduling_and_requests_carry_priorities(server):
    v = server
    (argv,) = [json.loads(x)["argv"] for x in v.log.read_text().splitlines() if '"launched"' in x]
    assert argv[-2:] == ["--scheduling-policy", "priority"]
    alice_tokens = 0
    for key in ("sk-alice", "sk-root"):
        client = ollama.Client(host=v.url, headers={"Authorization": f"Bearer {key}"}, timeout=300)
        r = client.generate(model="tiny", prompt="hi", options={"temperature": 0, "num_predict": 4})
        assert r.done and r.eval_count == 4
        chat = client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3})
        assert chat.done and chat.eval_count == 3
        oa = openai.OpenAI(base_url=v.url + "/v1", api_key=key)
        # a client's own priority is replaced by vllama's (it may not jump the queue)
        c = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       extra_body={"priority": -10**9})
        assert c.choices[0].finish_reason in ("length", "stop")
        if key == "sk-alice":  # Ollama routes count eval_count; /v1 counts vLLM's usage of a non-streamed answer
            alice_tokens = r.eval_count + chat.eval_count + c.usage.completion_tokens
    metrics = httpx.get(v.url + "/metrics", headers={"Authorization": "Bearer sk-root"}).text
    assert f'vllama_key_output_tokens_total{{key="alice",model="tiny"}} {float(alice_tokens)}' in metrics
    # the usage ledger (issue 39): one row per answered request, summing to the per-key counters
    want = {}
    for key in ("alice", "root"):
        counted = [sum(float(n) for n in re.findall(rf'^{name}{{key="{key}",model="tiny"[^}}]*}} (\S+)$', metrics, re.M))
                   for name in ("vllama_key_requests_total", "vllama_key_prompt_tokens_total", "vllama_key_output_tokens_total")]
        want[key] = tuple(int(n) for n in counted)
    assert want["alice"][0] == 3 and want["alice"][2] == alice_tokens
    deadline = time.monotonic() + 10  # another worker writes its rows within --usage-flush-interval (1 s)
    while True:
        rows = httpx.get(v.url + "/api/usage", headers={"Authorization": "Bearer sk-root"}).json()["usage"]
        got = {k: tuple(sum(r[f] for r in rows if r["key"] == k) for f in ("requests", "prompt_tokens", "output_tokens"))
               for k in ("alice", "root")}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == want
    assert httpx.get(v.url + "/readyz").json() == {"state": "ready"}


#: Stop strings a random tiny model's answer meets within a few tokens (a whole context would be slow on CPU).
STOPS = ["e", "t", "a", " "]  # vLLM takes at most 4


def test_the_real_vllm_gets_only_what_vllama_parsed_and_output_tokens_it_can_hold(server):
    """Issue 38 on the real vLLM 0.32: a body vllama cannot parse is answered by vllama (vLLM never
    sees it); ``max_tokens`` above ``max_model_len`` is vLLM 0.32's 400, so ``num_predict: 1000000``
    (fine in Ollama) and ``max_tokens: 1000000`` are clamped to the context less the prompt; a
    key's ``max_tokens`` caps every answer."""
    v = server
    root = {"Authorization": "Bearer sk-root"}
    r = httpx.post(v.url + "/v1/completions", content=b'{"model": "tiny", "prompt": "hi", "max_tokens": 1, "temperature": NaN}',
                   headers={**root, "Content-Type": "application/json"}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error" and "invalid JSON" in r.json()["error"]["message"]
    client = ollama.Client(host=v.url, headers=root, timeout=300)
    r = client.generate(model="tiny", prompt="hi", options={"temperature": 0, "num_predict": 1_000_000, "stop": STOPS})
    assert r.done
    oa = openai.OpenAI(base_url=v.url + "/v1", api_key="sk-root")
    c = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1_000_000, stop=STOPS)
    assert c.choices[0].finish_reason in ("length", "stop")
    carol = openai.OpenAI(base_url=v.url + "/v1", api_key="sk-carol")
    c = carol.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=50,
                                      extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 2


def test_every_salted_route_is_accepted_and_one_keys_prompt_is_no_cache_hit_for_another(server):
    """``--cache-isolation key`` on the real vLLM 0.32: every generating route vllama salts is accepted with the
    key's ``cache_salt``, and with a client's own combined with it (vLLM 0.30+ refuses a salt over 128
    characters or with ``/``: the key's, 64 hex characters, is neither). A prompt alice sent is then a
    prefix-cache hit when she sends it again and none when carol sends it, as vLLM counts them."""
    v = server
    hi = [{"role": "user", "content": "hi"}]
    for key in ("sk-alice", "sk-root"):
        h = {"Authorization": f"Bearer {key}"}
        client = ollama.Client(host=v.url, headers=h, timeout=300)
        assert client.generate(model="tiny", prompt="hi", options={"num_predict": 2}).done
        assert client.generate(model="tiny", prompt="hi", raw=True, options={"num_predict": 2}).done
        assert client.chat(model="tiny", messages=hi, options={"num_predict": 2}).done
        oa = openai.OpenAI(base_url=v.url + "/v1", api_key=key)
        for own in ({}, {"cache_salt": "project-x"}):
            c = oa.chat.completions.create(model="tiny", messages=hi, max_tokens=2, extra_body=own)
            assert c.choices[0].finish_reason in ("length", "stop")
            c = oa.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=own)
            assert c.choices[0].finish_reason in ("length", "stop")
            r = httpx.post(v.url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2, **own},
                           headers=h, timeout=300)
            assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
            r = httpx.post(v.url + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": hi, **own},
                           headers=h, timeout=300)
            assert r.status_code == 200 and r.json()["type"] == "message", r.text
    prompt = " ".join(f"secret{i}" for i in range(300))  # several of vLLM's 128-token CPU blocks

    def hits_after(key: str) -> float:
        def hits() -> float:
            text = httpx.get(v.url + "/vllm/metrics", headers={"Authorization": "Bearer sk-root"}, timeout=30).text
            return sum(float(n) for n in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))
        before = hits()
        r = httpx.post(v.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                       headers={"Authorization": f"Bearer {key}"}, timeout=300)
        assert r.status_code == 200, r.text
        return hits() - before

    assert hits_after("sk-alice") == 0
    assert hits_after("sk-carol") == 0  # without the salt: alice's whole prompt but its last block
    assert hits_after("sk-alice") > 0 and hits_after("sk-carol") > 0  # each key's own cache still works
