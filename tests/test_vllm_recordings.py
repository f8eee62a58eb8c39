"""The stand-in against real vLLM 0.26 bytes (issue 13).

The recordings come from ``benchmarks/tool_model/record.py`` run on a GPU against real vLLM
serving the trained tool model with ``--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3`` (``benchmarks/tool_model/gpu_tools.sh``); see
``tests/fixtures/vllm-0.26/README.md``. With no recordings every test here is skipped.

1. ``test_stand_in_shape``: each recorded request is sent to the generating stand-in
   (tests/fake_vllm.py, nudged to the same behaviour: as many tool calls, thinking on when
   vLLM reasoned) and the two answers' outlines must agree: status, content type, the
   sequence of SSE chunk kinds (how tool-call deltas are split, where finish and usage come,
   the reasoning field's name), the key paths of every chunk kind and of JSON bodies, and
   errors' type and code. A failure names what drifted.
2. ``test_ollama_over_replay``: vllama, driven by the real ollama client, in front of the
   stand-in replaying the recorded bytes (``FAKE_VLLM_REPLAY``), gives the Ollama answer those
   bytes mean: thinking, content, tool calls whole with object arguments, streamed and not.
"""

from __future__ import annotations

import copy
import json
import math

import httpx
import pytest

import vllm_replay
from conftest import SERVED, start_fake, start_proxy, stop

RECORDINGS = vllm_replay.load()
NO_RECORDINGS = (f"no recordings in {vllm_replay.FIXTURES}: they come from benchmarks/tool_model/record.py "
                 "against real vLLM on a GPU (benchmarks/tool_model/gpu_tools.sh)")
pytestmark = pytest.mark.skipif(not RECORDINGS, reason=NO_RECORDINGS)

CHAT = sorted(n for n, r in RECORDINGS.items() if not r["request"]["path"].endswith("/embeddings"))
EMBED = sorted(n for n, r in RECORDINGS.items() if r["request"]["path"].endswith("/embeddings"))
OLLAMA_CHAT = sorted(n for n in CHAT if "ollama_request" in RECORDINGS[n])
OLLAMA_EMBED = sorted(n for n in EMBED if "ollama_request" in RECORDINGS[n])


def nudged(rec: dict) -> dict:
    """The recorded request, with the stand-in's markers for what vLLM's model did."""
    body = copy.deepcopy(rec["request"]["body"])
    if body.get("model") in vllm_replay.served_names(RECORDINGS):
        body["model"] = SERVED
    if rec["status"] != 200 or not isinstance(body.get("messages"), list):
        return body
    said = vllm_replay.accumulate(rec)
    last = next((m for m in reversed(body["messages"]) if m.get("role") == "user"), None)
    if said["tool_calls"] and last is not None:
        last["content"] = f"{last['content']} [[tools:{len(said['tool_calls'])}]]"
    if said["reasoning"]:
        body["chat_template_kwargs"] = {**(body.get("chat_template_kwargs") or {}), "enable_thinking": True}
    return body


@pytest.fixture(scope="module")
def fakes(model_dir):
    gen = start_fake(model_dir)
    emb = start_fake(model_dir, extra=["--runner", "pooling"])
    yield {"gen": gen, "embed": emb}
    stop(gen.proc)
    stop(emb.proc)


@pytest.mark.parametrize("name", CHAT + EMBED)
def test_stand_in_shape(fakes, name):
    rec = RECORDINGS[name]
    fake = fakes["embed" if name in EMBED else "gen"]
    r = httpx.post(fake.url + rec["request"]["path"], json=nudged(rec), timeout=30)
    live = {"status": r.status_code, "headers": {k.lower(): v for k, v in r.headers.items()}, "body": r.text}
    diffs = vllm_replay.differences(vllm_replay.outline(rec), vllm_replay.outline(live))
    assert not diffs, f"the stand-in drifted from vLLM {rec.get('vllm_version')} ({name}):\n  " + "\n  ".join(diffs)


@pytest.fixture(scope="module")
def replay_proxy(model_dir):
    env = {"FAKE_VLLM_REPLAY": str(vllm_replay.FIXTURES)}
    fake = start_fake(model_dir, env=env)
    proxy = start_proxy(fake.url)
    yield proxy
    stop(proxy.proc)
    stop(fake.proc)


@pytest.fixture(scope="module")
def replay_embed_proxy(model_dir):
    fake = start_fake(model_dir, env={"FAKE_VLLM_REPLAY": str(vllm_replay.FIXTURES)}, extra=["--runner", "pooling"])
    proxy = start_proxy(fake.url, vllm_args=["--runner", "pooling"])
    yield proxy
    stop(proxy.proc)
    stop(fake.proc)


def _ollama_request(name: str) -> dict:
    req = copy.deepcopy(RECORDINGS[name]["ollama_request"])
    req["model"] = SERVED  # the options are record.py's (sampling is not part of the match anyway)
    return req


@pytest.mark.skipif(not OLLAMA_CHAT, reason=NO_RECORDINGS if not RECORDINGS else "no ollama_* chat recordings")
@pytest.mark.parametrize("name", OLLAMA_CHAT)
def test_ollama_over_replay(replay_proxy, name):
    import ollama

    said = vllm_replay.accumulate(RECORDINGS[name])
    if said["reasoning"]:
        # Ollama's thinking parser (thinking/parser.go) eats the whitespace right after <think> and
        # right after </think>; vLLM's qwen3 parser passes both on ("\n" and "\n\n")
        said = {**said, "reasoning": said["reasoning"].lstrip(), "content": said["content"].lstrip()}
    client = ollama.Client(host=replay_proxy.url)
    req = _ollama_request(name)
    want_calls = [(c["name"], c["arguments"]) for c in said["tool_calls"]]

    r = client.chat(**req, stream=False)
    assert r.done and r.message.role == "assistant"
    assert (r.message.thinking or "") == said["reasoning"]
    assert r.message.content == said["content"]
    assert [(tc.function.name, dict(tc.function.arguments)) for tc in r.message.tool_calls or []] == want_calls

    chunks = list(client.chat(**req, stream=True))
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    assert "".join(c.message.thinking or "" for c in chunks) == said["reasoning"]
    assert "".join(c.message.content or "" for c in chunks) == said["content"]
    streamed = [(tc.function.name, dict(tc.function.arguments)) for c in chunks for tc in c.message.tool_calls or []]
    assert streamed == want_calls  # each call whole, once, with its arguments as an object
    if said["tool_calls"] or said["finish_reason"] == "stop":
        assert chunks[-1].done_reason == "stop"
    if RECORDINGS[name]["ollama_request"].get("format") is not None:
        json.loads(r.message.content)  # format json / a schema: the content is JSON


@pytest.mark.skipif(not OLLAMA_EMBED, reason=NO_RECORDINGS if not RECORDINGS else "no ollama_* embedding recordings")
@pytest.mark.parametrize("name", OLLAMA_EMBED)
def test_ollama_embed_over_replay(replay_embed_proxy, name):
    import ollama

    rec = RECORDINGS[name]
    vectors = [d["embedding"] for d in json.loads(rec["body"])["data"]]
    r = ollama.Client(host=replay_embed_proxy.url).embed(model=SERVED, input=rec["ollama_request"]["input"])
    assert len(r.embeddings) == len(vectors)
    for got, raw in zip(r.embeddings, vectors):
        norm = math.sqrt(sum(x * x for x in raw))
        assert got == pytest.approx([x / norm for x in raw], rel=1e-5, abs=1e-6)
