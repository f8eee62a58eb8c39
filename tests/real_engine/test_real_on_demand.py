"""A pulled model that starts when a request names it, on the real vLLM (issue 22, part 3).

``vllama serve`` with nothing configured; the tiny model is put in its Hugging Face cache as
``acme/tiny-qwen`` (a snapshot and ``refs/main``, the layout vLLM loads from offline). The real
``ollama`` client lists it, asks for it, and the real vLLM is launched for it on demand.
"""

from __future__ import annotations

import json
import shutil

import ollama

from .conftest import BASE_ARGS


def test_a_pulled_model_starts_when_named(start_real, tiny_model):
    v = start_real("on-demand", config="", vllm_args=BASE_ARGS)
    repo = v.tmp / "hf" / "hub" / "models--acme--tiny-qwen"
    shutil.copytree(tiny_model, repo / "snapshots" / ("0" * 40), ignore=shutil.ignore_patterns("DONE"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    v.wait_live()
    client = ollama.Client(host=v.url, timeout=600)
    assert [m.model for m in client.list().models] == ["acme/tiny-qwen:latest"] and client.ps().models == []
    r = client.generate(model="acme/tiny-qwen", prompt="hi", options={"temperature": 0, "num_predict": 5})
    assert r.done and r.eval_count == 5
    assert [m.model for m in client.ps().models] == ["acme/tiny-qwen:latest"]
    chat = client.chat(model="acme/tiny-qwen:latest", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3})
    assert chat.done and chat.eval_count == 3
    launched = [json.loads(x)["argv"] for x in v.log.read_text().splitlines() if '"launched"' in x]
    assert len(launched) == 1 and launched[0][2] == "acme/tiny-qwen" and launched[0][-len(BASE_ARGS):] == BASE_ARGS
