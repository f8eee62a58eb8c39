"""Fair sharing on the real vLLM (issue 27): with a keys file, vllama runs vLLM with
``--scheduling-policy priority`` and sets each request's ``priority``; the real vLLM 0.32 accepts
both, through the Ollama routes and the OpenAI passthrough, for a user key and an admin key.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import ollama
import openai

from .conftest import BASE_ARGS


def test_keys_file_runs_vllm_with_priority_scheduling_and_requests_carry_priorities(start_real, tiny_model):
    keys = tiny_model.parent / "keys.toml"
    keys.write_text('[[keys]]\nname = "root"\nkey = "sk-root"\nrole = "admin"\n\n'
                    '[[keys]]\nname = "alice"\nkey = "sk-alice"\npriority = 2\n')
    v = start_real("many-users", model=tiny_model, flags=["--served-model-name", "tiny", "--api-key-file", str(keys)],
                   vllm_args=BASE_ARGS)
    v.wait_ready()
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
