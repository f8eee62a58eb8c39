"""POST /api/create (issue 30): a name on a served model with its own system prompt, options and messages.

The real ollama client against vllama and the fake vLLM (what vLLM received is read back from the
fake); the real vLLM's side is in ``tests/real_engine/test_real_create.py``.
"""

from __future__ import annotations

import httpx
import pytest
from ollama import ResponseError

from conftest import SERVED, start_proxy, stop
from vllama_proxy.models.created import parse_modelfile

MARIO = "You are Mario from Super Mario Bros."


def system_of(client, name: str) -> str:
    """``/api/show``'s ``system`` (Ollama's ShowResponse has it; ollama-python's model leaves it out)."""
    return client._request_raw("POST", "/api/show", json={"model": name}).json().get("system", "")


@pytest.fixture
def mario(client):
    client.create(model="mario", from_=SERVED, system=MARIO, parameters={"temperature": 0.25, "stop": ["</s>", "END"]},
                  messages=[{"role": "user", "content": "who are you?"}, {"role": "assistant", "content": "It's-a me!"}],
                  license="MIT")
    yield "mario"
    try:
        client.delete("mario")
    except ResponseError:
        pass


def test_chat_through_a_created_model_gets_its_system_messages_and_options(client, mario, upstream_requests):
    r = client.chat(model=mario, messages=[{"role": "user", "content": "hi"}], options={"stop": ["x"]}, stream=False)
    assert r.model == mario and r.done
    (sent,) = upstream_requests("/v1/chat/completions")
    body = sent["body"]
    assert body["model"] == SERVED  # served by the base's vLLM
    assert body["messages"] == [{"role": "system", "content": MARIO}, {"role": "user", "content": "who are you?"},
                                {"role": "assistant", "content": "It's-a me!"}, {"role": "user", "content": "hi"}]
    assert body["temperature"] == 0.25 and body["stop"] == ["x"]  # the request's own options win
    # a system message of the request's own replaces the model's (after the model's messages, as Ollama's ChatHandler)
    client.chat(model=mario, messages=[{"role": "system", "content": "be Luigi"}, {"role": "user", "content": "hi"}], stream=False)
    sent = upstream_requests("/v1/chat/completions")[-1]["body"]["messages"]
    assert [m["content"] for m in sent] == ["who are you?", "It's-a me!", "be Luigi", "hi"]


def test_generate_through_a_created_model(client, mario, upstream_requests):
    client.generate(model=mario, prompt="jump", stream=False)
    (sent,) = upstream_requests("/v1/chat/completions")
    assert sent["body"]["messages"][0] == {"role": "system", "content": MARIO}
    assert sent["body"]["messages"][-1] == {"role": "user", "content": "jump"}
    assert sent["body"]["stop"] == ["</s>", "END"]


def test_listed_shown_and_the_modelfile_round_trips(client, mario, proxy):
    tags = {m.model: m for m in client.list().models}
    assert tags["mario:latest"].details.parent_model == SERVED
    show = client.show(mario)
    assert system_of(client, mario) == MARIO and show.details.parent_model == SERVED
    assert "temperature 0.25" in show.parameters and 'stop "END"' in show.parameters
    assert show.license == "MIT"
    again = parse_modelfile(show.modelfile)
    assert again == {"from": SERVED, "system": MARIO, "parameters": {"temperature": 0.25, "stop": ["</s>", "END"]},
                     "messages": [{"role": "user", "content": "who are you?"}, {"role": "assistant", "content": "It's-a me!"}],
                     "license": ["MIT"]}
    # the same Modelfile, sent as Ollama's legacy text form, makes the same model
    httpx.post(
        proxy.url + "/api/create", json={"model": "mario2", "modelfile": show.modelfile, "stream": False}, timeout=10).raise_for_status()
    assert parse_modelfile(client.show("mario2").modelfile) == again
    client.delete("mario2")
    ps = {m.model for m in client.ps().models}
    assert "mario:latest" in ps


def test_copy_and_delete(client, mario):
    client.copy(mario, "mario-copy")
    assert system_of(client, "mario-copy") == MARIO
    client.delete("mario-copy")
    with pytest.raises(ResponseError) as e:
        client.show("mario-copy")
    assert e.value.status_code == 404
    client.delete(mario)
    assert "mario:latest" not in {m.model for m in client.list().models}
    assert system_of(client, SERVED) == ""  # the base is untouched


def test_created_from_a_created_model_inherits(client, mario, upstream_requests):
    client.create(model="mario-hot", from_=mario, parameters={"temperature": 1.5})
    show = client.show("mario-hot")
    assert system_of(client, "mario-hot") == MARIO and show.details.parent_model == mario
    client.chat(model="mario-hot", messages=[{"role": "user", "content": "hi"}], stream=False)
    body = upstream_requests("/v1/chat/completions")[-1]["body"]
    assert body["temperature"] == 1.5 and body["stop"] == ["</s>", "END"] and body["messages"][0]["content"] == MARIO
    client.delete("mario-hot")


def test_progress_lines(proxy):
    r = httpx.post(proxy.url + "/api/create", json={"model": "p", "from": SERVED, "system": "s"}, timeout=10)
    lines = [line for line in r.text.splitlines() if line]
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert lines[0].startswith('{"status":"using existing layer sha256:') and lines[-2:] == ['{"status":"writing manifest"}', '{"status":"success"}']
    assert any("creating new layer sha256:" in line for line in lines)
    httpx.request("DELETE", proxy.url + "/api/delete", json={"model": "p"}, timeout=10).raise_for_status()


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"from": SERVED}, 400, "model is required"),
        ({"model": "x"}, 400, "neither 'from' or 'files' was specified"),
        ({"model": "x", "from": "nope"}, 404, "model 'nope' not found"),
        ({"model": "x", "from": SERVED, "template": "{{ .Prompt }}"}, 400, "TEMPLATE is not supported"),
        ({"model": "x", "from": SERVED, "quantize": "q4_K_M"}, 400, "quantize is not supported"),
        ({"model": "x", "from": SERVED, "parameters": {"temprature": 1}}, 400, "unknown parameter 'temprature'"),
        ({"model": "x", "from": SERVED, "parameters": {"temperature": "hot"}}, 400, "invalid parameter temperature"),
        ({"model": SERVED, "from": SERVED, "system": "s"}, 400, "is a served model"),
        ({"model": "fake:7b", "from": SERVED, "system": "s"}, 400, "is a served model or an alias"),
        ({"model": "bad name!", "from": SERVED}, 400, "is invalid"),
        ({"model": "x", "from": SERVED, "messages": [{"role": "tool", "content": "c"}]}, 400, "messages[0].role"),
        ({"model": "x", "modelfile": "FROM fake-model\nSYSTEM \"\"\"never closed"}, 400, "unterminated"),
    ],
)
def test_create_errors(proxy, body, status, words):
    r = httpx.post(proxy.url + "/api/create", json=body, timeout=10)
    assert r.status_code == status and words in r.json()["error"], r.text


def test_kept_in_the_state_directory_across_restarts(fake, tmp_path):
    import ollama

    env = {"VLLAMA_STATE_DIR": str(tmp_path / "state")}
    first = start_proxy(fake.url, env=env)
    try:
        ollama.Client(host=first.url).create(model="kept", from_=SERVED, system="still here")
    finally:
        stop(first.proc)
    second = start_proxy(fake.url, env=env)
    try:
        assert system_of(ollama.Client(host=second.url), "kept") == "still here"
    finally:
        stop(second.proc)

