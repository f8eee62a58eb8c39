"""Quick checks of the fake vLLM server (tests/fake_vllm.py) through the real openai client."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

TESTS = Path(__file__).resolve().parent
FAKE = TESTS / "fake_vllm.py"
sys.path.insert(0, str(TESTS))
import fake_vllm  # noqa: E402
from conftest import free_port  # noqa: E402


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_fake(*extra: str, env: dict[str, str] | None = None, wait: bool = True,
               cmd: list[str] | None = None):
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_VLLM_")}
    full_env.update(env or {})
    argv = (cmd or [sys.executable, str(FAKE)]) + [
        "serve", "org/model", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "foo", "--max-model-len", "4096",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *extra]
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    if wait:
        # a bound for a hang, not a timing: alone in CI, beside the real tier's vLLM starts at nice -5, one took
        # over 10 s to print its first line (conftest.wait_http)
        deadline = time.monotonic() + 120
        while True:
            try:
                if http_get(base + "/health", 0.5)[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("fake vllm did not start: " + proc.stderr.read().decode())
            time.sleep(0.02)
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr:
        proc.stderr.close()


@pytest.fixture(scope="module")
def fake():
    proc, base = start_fake(env={"FAKE_VLLM_EMBED_DIM": "8"})
    yield base
    stop(proc)


@pytest.fixture
def client(fake):
    return openai.OpenAI(base_url=fake + "/v1", api_key="x", max_retries=0, timeout=10)


def toks(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


def test_basic_endpoints(fake):
    assert http_get(fake + "/health") == (200, b"")
    assert json.loads(http_get(fake + "/version")[1]) == {"version": "0.26.0"}
    models = json.loads(http_get(fake + "/v1/models")[1])
    assert [m["id"] for m in models["data"]] == ["foo"]
    assert models["data"][0]["root"] == "org/model"
    assert models["data"][0]["max_model_len"] == 4096


def test_completions(client, fake):
    r = client.completions.create(model="foo", prompt="hello there")
    assert r.choices[0].text == toks(8)
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, 8)

    r = client.completions.create(model="foo", prompt="x [[tokens:100]]")
    assert r.choices[0].text == toks(16) and r.choices[0].finish_reason == "length"

    r = client.completions.create(model="foo", prompt="x", max_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == toks(5) and r.choices[0].finish_reason == "length"

    r = client.completions.create(model="foo", prompt="x", stop=["tok3"])
    assert r.choices[0].text == toks(3) and r.choices[0].finish_reason == "stop"

    chunks = list(client.completions.create(model="foo", prompt="a [[tokens:5]]", stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts == [f"tok{i} " for i in range(5)] + [""]  # vLLM: the finish in a chunk of its own
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_chat_stream_reasoning_and_json(client):
    chunks = list(client.chat.completions.create(
        model="foo", messages=[{"role": "user", "content": "hi [[tokens:2]]"}], stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert reasoning == "think0 think1 think2 " and content == toks(2)
    assert chunks[-1].choices[0].finish_reason == "stop"

    r = client.chat.completions.create(
        model="foo", messages=[{"role": "user", "content": "give json"}],
        response_format={"type": "json_object"})
    assert json.loads(r.choices[0].message.content) == {"ok": True}


def test_chat_tool_call_deltas(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    chunks = list(client.chat.completions.create(
        model="foo", messages=[{"role": "user", "content": "weather? [[tools:2]]"}],
        tools=tools, stream=True))
    calls: dict[int, dict] = {}
    fragments = 0
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            if tc.id:
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": ""}
                assert tc.function.arguments is None  # vLLM's hermes tool start has no arguments key
            else:
                calls[tc.index]["args"] += tc.function.arguments
                fragments += 1
    assert fragments >= 6
    assert [calls[i]["name"] for i in (0, 1)] == ["get_weather", "get_weather"]
    assert [json.loads(calls[i]["args"]) for i in (0, 1)] == [
        {"city": "Paris", "n": 0}, {"city": "Paris", "n": 1}]
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    r = client.chat.completions.create(
        model="foo", messages=[{"role": "user", "content": "weather? [[tool]]"}], tools=tools)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "n": 0}


def test_embeddings(client):
    with pytest.raises(openai.NotFoundError):  # a generation model has no /v1/embeddings
        client.embeddings.create(model="foo", input="x")
    proc, base = start_fake("--runner", "pooling", env={"FAKE_VLLM_EMBED_DIM": "8"})
    try:
        _check_embeddings(openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=10))
    finally:
        stop(proc)


def _check_embeddings(client):
    r = client.embeddings.create(model="foo", input=["one two", "three"])  # base64 on the wire
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == 3
    want = fake_vllm.embed_vector("one two", 8)
    assert r.data[0].embedding == pytest.approx(want, rel=1e-6)
    assert max(abs(v) for v in want) > 1.0  # not normalised
    r = client.embeddings.create(model="foo", input="three", dimensions=4,
                                 encoding_format="float")
    assert r.data[0].embedding == pytest.approx(fake_vllm.embed_vector("three", 8)[:4])


def test_errors(client, fake):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 4096"):
        client.chat.completions.create(
            model="foo", messages=[{"role": "user", "content": "x [[fault:http400]]"}],
            stream=True)
    with pytest.raises(openai.InternalServerError) as ei:
        client.completions.create(model="foo", prompt="x [[fault:http500]]")
    assert ei.value.body["message"] == "EngineCore encountered an issue"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")
    req = urllib.request.Request(fake + "/v1/chat/completions", data=b"{bad",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=2)
    body = json.loads(he.value.read())
    assert he.value.code == 400 and body["error"]["type"] == "BadRequestError"
    assert body["error"]["code"] == 400


def test_request_log_and_aborted_stream(client, fake):
    req = urllib.request.Request(fake + "/_fake/requests", method="DELETE")
    urllib.request.urlopen(req, timeout=2).read()
    before = json.loads(http_get(fake + "/_fake/stats")[1])
    stream = client.completions.create(model="foo", prompt="x [[fault:hang]]", stream=True)
    it = iter(stream)
    assert next(it).choices[0].text == "tok0 "
    assert next(it).choices[0].text == "tok1 "
    assert json.loads(http_get(fake + "/_fake/stats")[1])["in_flight"] == before["in_flight"] + 1
    stream.close()
    deadline = time.monotonic() + 30
    while True:
        stats = json.loads(http_get(fake + "/_fake/stats")[1])
        if stats["aborted"] == before["aborted"] + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert stats["aborted"] == before["aborted"] + 1
    assert stats["in_flight"] == before["in_flight"]
    assert stats["started"] == before["started"] + 1
    log = json.loads(http_get(fake + "/_fake/requests")[1])
    assert [e["path"] for e in log] == ["/v1/completions"]
    assert log[0]["body"]["prompt"] == "x [[fault:hang]]"
    assert "Authorization" in log[0]["headers"] or "authorization" in log[0]["headers"]


def test_fail_at_start_and_start_delay():
    proc, _ = start_fake(env={"FAKE_VLLM_START_DELAY": "0.6", "FAKE_VLLM_FAIL_AT_START":
                              "CUDA out of memory"}, wait=False)
    try:
        assert proc.wait(60) == 1  # a bound for a failure: its interpreter took over 5 s to start beside a CPU hog
        err = proc.stderr.read().decode()
        assert "ERROR" in err and "CUDA out of memory" in err
        assert "Loading safetensors checkpoint shards" in err
    finally:
        stop(proc)


def test_crash_after_via_bin_vllm(tmp_path):
    env = {"FAKE_VLLM_CRASH_AFTER": "1", "FAKE_VLLM_GRANDCHILD": "1",
           "FAKE_VLLM_PIDFILE": str(tmp_path / "pid"),
           "PATH": f"{TESTS / 'bin'}:{os.environ.get('PATH', '')}"}
    proc, base = start_fake(env=env, cmd=["vllm"])
    gc = int((tmp_path / "pid").read_text())
    try:
        assert int((tmp_path / "pid.server").read_text()) == proc.pid
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=5)
        got = []
        with pytest.raises((openai.APIError, Exception)):
            for ch in c.completions.create(model="foo", prompt="x [[tokens:50]]", stream=True):
                got.append(ch.choices[0].text)
        assert got == ["tok0 ", "tok1 "]
        assert proc.wait(60) == 3
        os.kill(gc, 0)  # the engine-core stand-in outlives its crashed parent
    finally:
        try:
            os.kill(gc, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stop(proc)


def test_grammar_error_and_validation_shapes(fake):
    """vLLM 0.26 (tests/fixtures/vllm-0.26/error_bad_schema*.json): xgrammar's 400, streamed after a 200."""
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}
    body = {"model": "foo", "messages": [{"role": "user", "content": "JSON please"}], "response_format": bad}
    r = httpx.post(fake + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "Grammar error: Invalid type: no-such-type", "type": "BadRequestError", "param": None, "code": 400}}
    r = httpx.post(fake + "/v1/chat/completions", json={**body, "stream": True}, timeout=10)
    assert r.status_code == 200 and r.text == (
        'data: {"error": {"message": "Grammar error: Invalid type: no-such-type", "type": "BadRequestError", '
        '"param": null, "code": 400}}\n\ndata: [DONE]\n\n')
    r = httpx.post(fake + "/v1/chat/completions", json={"model": "foo", "messages": "not a list"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
    assert r.json()["error"]["param"] == "body.messages"


def test_lockstep_streams_share_engine_steps():
    """FAKE_VLLM_LOCKSTEP: every running stream's token goes out on one step clock, as vLLM's engine
    steps its batch (issue 42's per-token CPU is measured with the tokens of a step arriving together):
    4 streams of 6 tokens that arrive together take about 6 steps, not 24. How together they arrived is
    read from the stand-in's own log (a busy machine may start one thread's request a few steps late)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    step = 0.1
    proc, base = start_fake(env={"FAKE_VLLM_TOKEN_DELAY": str(step), "FAKE_VLLM_LOCKSTEP": "1"})
    try:
        together = threading.Barrier(4)

        def one(_):
            together.wait(timeout=60)
            with httpx.stream("POST", base + "/v1/completions", timeout=30, json={
                    "model": "foo", "prompt": "hi [[tokens:6]]", "max_tokens": 6, "stream": True}) as r:
                return sum(1 for line in r.iter_lines() if line.startswith("data: {"))

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(4))) == [7] * 4  # 6 tokens and the finish chunk each
        stats = json.loads(http_get(base + "/_fake/stats")[1])
        arrived = [r["arrived"] for r in json.loads(http_get(base + "/_fake/requests")[1])]
        assert stats["generation_tokens_total"] == 24 and len(arrived) == 4
        late = math.ceil((max(arrived) - min(arrived)) / step)  # steps between the first and last arrival
        # unstepped, each stream's tokens would take their own times (and no step would be counted);
        # stepped, the last to arrive joins the steps already running (a few more for a timer at a step's
        # edge or a request parsed late on a busy machine)
        assert 6 <= stats["steps"] <= 6 + late + 4, (stats, late)
    finally:
        stop(proc)
