"""/api/copy makes an alias every worker knows and later runs keep; /api/delete of it removes it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import httpx
import pytest
from ollama import Client, ResponseError

from conftest import ROOT, SERVED, free_port, start_proxy, stop


@pytest.fixture
def state_dir():
    with tempfile.TemporaryDirectory(prefix="vllama-state-") as d:
        yield d


def test_copy_makes_an_alias_and_delete_removes_it(fake, state_dir, upstream_requests):
    p = start_proxy(fake.url, env={"VLLAMA_STATE_DIR": state_dir})
    try:
        client = Client(host=p.url)
        r = httpx.post(p.url + "/api/copy", json={"source": SERVED, "destination": "team/assistant:v1"})
        assert r.status_code == 200 and r.content == b""  # Ollama answers an empty 200
        assert "team/assistant:v1" in [m.model for m in client.list().models]
        assert client.generate(model="team/assistant:v1", prompt="hi", stream=False).response.startswith("tok0")
        assert upstream_requests("/v1/chat/completions")[-1]["body"]["model"] == SERVED  # vLLM sees its own name
        assert client.show("team/assistant:v1").capabilities
        assert client.show("Team/Assistant:V1").capabilities  # names compare without case, as Ollama's
        # a copy of the copy names the same served model
        client.copy("team/assistant:v1", "second")
        assert client.chat(model="second", messages=[{"role": "user", "content": "hi"}]).message.content
        # delete removes the name, not the model
        assert client.delete("team/assistant:v1").status == "success"
        with pytest.raises(ResponseError) as e:
            client.generate(model="team/assistant:v1", prompt="hi")
        assert e.value.status_code == 404
        assert client.generate(model=SERVED, prompt="hi").response
        with pytest.raises(ResponseError) as e:
            client.delete("team/assistant:v1")  # gone: neither an alias nor a hub model in the cache
        assert e.value.status_code == 404
    finally:
        stop(p.proc)


@pytest.mark.parametrize("body,status,error", [
    ({"source": SERVED}, 400, "source and destination are required"),
    ({"source": "", "destination": "x"}, 400, "source and destination are required"),
    ({"source": SERVED, "destination": "bad name!"}, 400, 'destination "bad name!" is invalid'),
    ({"source": "nothing-here", "destination": "x"}, 404, "model 'nothing-here' not found: it is not a name in vllama's "
     "library (72 Ollama names, see docs/library.md); a Hugging Face model is named by its id, org/name (e.g. "
     "Qwen/Qwen2.5-7B-Instruct)"),
    ({"source": SERVED, "destination": SERVED}, 200, None),  # the same model: nothing to refuse
])
def test_copy_errors(proxy, body, status, error):
    r = httpx.post(proxy.url + "/api/copy", json=body)
    assert r.status_code == status, r.text
    if error:
        assert r.json() == {"error": error}


def test_every_worker_and_the_next_run_know_the_alias(fake, state_dir):
    p = start_proxy(fake.url, "--workers", "3", env={"VLLAMA_STATE_DIR": state_dir})
    try:
        assert httpx.post(p.url + "/api/copy", json={"source": SERVED, "destination": "shared"}).status_code == 200
        # and a model made with /api/create (issue 42.4: the workers learn of both by a count in shared memory)
        assert httpx.post(p.url + "/api/create", json={"model": "made", "from": SERVED, "stream": False}).status_code == 200
        # new connections land on any of the three processes (SO_REUSEPORT): all resolve them at once
        for _ in range(30):
            with httpx.Client() as c:
                assert c.post(p.url + "/api/show", json={"model": "shared"}).status_code == 200
                assert c.post(p.url + "/api/show", json={"model": "made"}).json()["details"]["parent_model"] == SERVED
    finally:
        stop(p.proc)
    p = start_proxy(fake.url, env={"VLLAMA_STATE_DIR": state_dir})
    try:
        assert {"shared:latest", "made:latest"} <= {m.model for m in Client(host=p.url).list().models}
    finally:
        stop(p.proc)


def test_cli_cp_and_rm(proxy):
    def vllama(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vllama_proxy", *args, "--host", proxy.url], cwd=ROOT,
                              capture_output=True, text=True, timeout=30)

    r = vllama("cp", SERVED, "cli-copy")
    assert r.returncode == 0 and r.stdout == "copied 'fake-model' to 'cli-copy'\n"
    assert "cli-copy:latest" in vllama("list").stdout
    r = vllama("rm", "cli-copy")
    assert r.returncode == 0 and r.stdout == "deleted 'cli-copy'\n"
    assert "cli-copy" not in vllama("list").stdout
    r = vllama("cp", "missing", "x")
    assert r.returncode == 1 and "model 'missing' not found" in r.stderr


def test_a_second_server_on_the_same_state_dir_refuses_with_one_line(fake, state_dir):
    """Two vllama serve of one user shared ~/.local/state/vllama: the second's cp, create and usage landed in
    the first's files, where the first served them. Now the second exits 1 with one line naming the first (its
    pid and port) and --state-dir; the first keeps serving, and with its own directory a second one starts."""
    first = start_proxy(fake.url, env={"VLLAMA_STATE_DIR": state_dir})
    try:
        port = str(free_port())
        second = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--upstream", fake.url, "--port", port],
                                env={**os.environ, "VLLAMA_STATE_DIR": state_dir}, cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 1
        (line,) = second.stderr.strip().splitlines()
        assert state_dir in line and f"pid {first.proc.pid}" in line and f":{first.port}" in line and "--state-dir" in line
        assert httpx.get(first.url + "/api/tags").status_code == 200
        with tempfile.TemporaryDirectory(prefix="vllama-state-") as other:
            third = start_proxy(fake.url, env={"VLLAMA_STATE_DIR": other})
            try:
                Client(host=third.url).copy(SERVED, "only-on-third")
                assert "only-on-third" not in [m.model.removesuffix(":latest") for m in Client(host=first.url).list().models]
            finally:
                stop(third.proc)
    finally:
        stop(first.proc)


def test_v1_models_lists_every_name_that_answers(serve, hub):
    """As Ollama's ``/v1/models``: the served model, its aliases and the models created from it, each a name an
    OpenAI client can send (before, only the served name was listed, though the others answer)."""
    import openai

    from conftest import place
    place(hub, "acme/tiny-prod")
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod")
    s.wait_ready()
    s.client.copy("prod", "assistant:v1")
    s.client.create(model="terse", from_="prod", system="Be terse.")
    oa = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
    listed = {m.id: m for m in oa.models.list().data}
    assert set(listed) == {"prod", "assistant:v1", "terse:latest"}
    assert listed["terse:latest"].parent == "prod" and listed["assistant:v1"].root == listed["prod"].root
    for name in listed:
        assert oa.models.retrieve(name).id == name
        assert oa.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices
