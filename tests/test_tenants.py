"""No tenant can harm another (issue 38): what a user key reaches, what a body it sends may do, what
a refused request may touch, which instance a name reaches, and the limits on what one asks for.

``vllama serve`` with the stand-in vLLM as its ``vllm``, models laid out in a Hugging Face cache
(``conftest.place``), a keys file with an admin, users and a Prometheus scraper's key.
"""

from __future__ import annotations

import json
import socket

import httpx
import ollama
import pytest

from conftest import place

KEYS = """
[[keys]]
name = "root"
key = "sk-root"
role = "admin"

[[keys]]
name = "alice"
key = "sk-alice"
role = "user"
models = ["acme/tiny-a"]

[[keys]]
name = "bob"
key = "sk-bob"
role = "user"
"""
#: What this issue adds to the keys file: a scraper's key, a key with a cap on each answer.
NEW_KEYS = """
[[keys]]
name = "prom"
key = "sk-prom"
role = "metrics"

[[keys]]
name = "carol"
key = "sk-carol"
max_tokens = 5
"""


def _keys(tmp_path, extra: str = ""):
    p = tmp_path / "keys.toml"
    p.write_text(KEYS + extra)
    return p


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _log(s) -> list[dict]:
    return [json.loads(x) for x in s.log.read_text().splitlines() if x.startswith("{")]


def _fake_url(argv: list[str]) -> str:
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def _sent(s, path: str, i: int = 0) -> list:
    """What the stand-in vLLM number ``i`` received on ``path``."""
    return [r for r in httpx.get(_fake_url(s.launched()[i]) + "/_fake/requests").json() if r["path"] == path]


def _prod(serve, hub, tmp_path, extra: str = ""):
    for repo in ("acme/tiny-prod", "acme/tiny-a", "acme/tiny-b"):
        place(hub, repo)
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(_keys(tmp_path, extra)),
              "--", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3")
    s.wait_ready()
    return s


@pytest.fixture
def prod(serve, hub, tmp_path):
    """The operator serves acme/tiny-prod as ``prod`` (context 2048); acme/tiny-a and -b are pulled."""
    return _prod(serve, hub, tmp_path)


@pytest.fixture
def prod_new_keys(serve, hub, tmp_path):
    """:func:`prod` with :data:`NEW_KEYS` in the keys file too."""
    return _prod(serve, hub, tmp_path, NEW_KEYS)


# -- 1. every route by allow-list, per role -------------------------------------------------------

def test_vllm_routes_that_change_the_server_are_an_admins_and_unlisted_ones_are_never_relayed(prod):
    s = prod
    lora = {"lora_name": "x", "lora_path": "/etc"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for key in ("sk-alice", "sk-bob"):
            r = httpx.post(s.url + path, json=lora, headers=_auth(key))
            assert r.status_code == 403, (path, key, r.text)
            assert f"may not call POST {path}: that needs an admin key" in r.json()["error"]["message"]  # OpenAI's shape on /v1
    r = httpx.post(s.url + "/v1/load_lora_adapter", json=lora, headers=_auth("sk-root"))
    assert r.json() == {"detail": "Not Found"}  # an admin's is relayed: the stand-in's own 404 (it has no LoRA routes)
    # routes nobody listed: 404 in vllama's words for every key, never relayed (nor a dot-segment way round)
    for path in ("/v1/sleep", "/v1/wake_up", "/v1/reset_prefix_cache", "/v1/collective_rpc", "/v1/pause",
                 "/v1/chat/completions/batch", "/v1/../sleep", "/v1/responses/abc/delete"):
        for key in ("sk-root", "sk-bob"):
            r = httpx.post(s.url + path, json={"model": "prod"}, headers=_auth(key))
            err = r.json()["error"]  # OpenAI's shape on /v1; httpx sends /v1/../sleep as /sleep, an Ollama path
            assert r.status_code == 404 and (err if ".." in path else err["message"]) == "404 page not found", (path, key)  # vllama's
    # a listed /v1 path's other methods: 405 from vllama, not relayed either
    for method in ("GET", "OPTIONS", "PUT"):
        r = httpx.request(method, s.url + "/v1/chat/completions", headers=_auth("sk-root"))
        assert r.status_code == 405 and r.json()["error"]["message"] == "method not allowed" and r.headers["Allow"] == "POST", method
    # a stored response is looked up by id alone: an admin's
    assert httpx.get(s.url + "/v1/responses/resp_1", headers=_auth("sk-bob")).status_code == 403
    # inference still reaches vLLM for a user
    r = httpx.post(s.url + "/v1/completions", json={"model": "prod", "prompt": "x", "max_tokens": 1}, headers=_auth("sk-bob"))
    assert r.status_code == 200


def test_metrics_are_an_admins_or_a_scrapers_and_a_metrics_key_reaches_nothing_else(prod_new_keys):
    s = prod_new_keys
    assert ollama.Client(host=s.url, headers=_auth("sk-bob")).generate(model="prod", prompt="x", options={"num_predict": 1}).done
    for path in ("/metrics", "/vllm/metrics", "/vllm/metrics?model=prod"):
        for key in ("sk-alice", "sk-bob"):
            r = httpx.get(s.url + path, headers=_auth(key))
            assert r.status_code == 403 and "may not read the metrics" in r.json()["error"], (path, key)
        for key in ("sk-root", "sk-prom"):
            assert httpx.get(s.url + path, headers=_auth(key)).status_code == 200, (path, key)
    assert 'key="bob"' in httpx.get(s.url + "/metrics", headers=_auth("sk-prom")).text
    for method, path in (("GET", "/api/tags"), ("POST", "/api/generate"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
        r = httpx.request(method, s.url + path, json={"model": "prod", "prompt": "x"}, headers=_auth("sk-prom"))
        err = r.json()["error"]  # Ollama's shape on /api, OpenAI's on /v1
        assert r.status_code == 403 and "role metrics" in (err["message"] if path.startswith("/v1/") else err), (method, path)


# -- 2. one parser, strict, before any decision -----------------------------------------------------

@pytest.mark.parametrize("raw", [
    b'{"model": "prod", "prompt": "x", "x": NaN}',
    b'{"model": "prod", "prompt": "x", "x": Infinity}',
    b'{"model": "prod", "prompt": "x", "x": -Infinity}',
    b'{"model": "prod", "prompt": "\\ud800"}',
    b'{"model": "prod", "prompt": "x"} trailing',
])
def test_a_body_vllama_cannot_parse_is_a_400_and_never_forwarded_with_one_model(prod, raw):
    s = prod
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    for key in ("sk-alice", "sk-root"):  # alice may not use prod; root may: neither body goes on
        r = httpx.post(s.url + "/v1/completions", content=raw, headers={**_auth(key), "Content-Type": "application/json"})
        assert r.status_code == 400, (key, r.text)
        err = r.json()["error"]  # OpenAI's error shape on /v1
        assert err["type"] == "invalid_request_error" and err["code"] == 400 and "invalid JSON" in err["message"]
        r = httpx.post(s.url + "/api/generate", content=raw.replace(b'"x"}', b'"x", "stream": false}'), headers=_auth(key))
        assert r.status_code == 400 and isinstance(r.json()["error"], str)  # Ollama's shape on /api
    assert _sent(s, "/v1/completions") == []


def test_the_model_check_runs_whatever_the_content_type_and_what_is_forwarded_is_what_was_checked(prod):
    s = prod
    body = b'{"model": "prod", "prompt": "x", "max_tokens": 1}'
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        r = httpx.post(s.url + "/v1/completions", content=body, headers={**_auth("sk-alice"), **headers})
        assert r.status_code == 403 and "alice" in r.json()["error"]["message"], headers
    # a key limited to some models may not name one vllama does not know either (vLLM may know it: an adapter)
    r = httpx.post(s.url + "/v1/completions", json={"model": "some-adapter", "prompt": "x"}, headers=_auth("sk-alice"))
    assert r.status_code == 403
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    # duplicate keys: vllama reads the last, and vLLM gets the one it read, as JSON
    r = httpx.post(s.url + "/v1/completions", content=b'{"model": "x", "prompt": "p", "model": "prod", "max_tokens": 1}',
                   headers=_auth("sk-root"))
    assert r.status_code == 200
    sent = _sent(s, "/v1/completions")[0]
    sent["body"].pop("priority", None)  # fair share's, vllama's own
    sent["body"].pop("cache_salt")  # the key's own prefix cache's, vllama's own (test_cache_salt.py)
    assert sent["body"] == {"model": "prod", "prompt": "p", "max_tokens": 1} and sent["headers"]["Content-Type"] == "application/json"


# -- 3. decide before the GPU is touched --------------------------------------------------------------

def test_a_refused_request_claims_loads_and_evicts_nothing(serve, hub, tmp_path):
    for repo in ("acme/tiny-a", "acme/tiny-b"):
        place(hub, repo)
    s = serve("--max-on-demand", "1", "--keep-alive", "-1", "--api-key-file", str(_keys(tmp_path)), "--load-timeout", "5")
    root = ollama.Client(host=s.url, headers=_auth("sk-root"), timeout=60)
    assert root.generate(model="acme/tiny-a", prompt="x", options={"num_predict": 1}).done
    alice = ollama.Client(host=s.url, headers=_auth("sk-alice"), timeout=60)
    for call in (lambda: alice.generate(model="acme/tiny-b", prompt="x"),
                 lambda: alice.generate(model="acme/tiny-b", prompt=""),  # an explicit load
                 lambda: alice.chat(model="acme/tiny-b", messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 403
    r = httpx.post(s.url + "/v1/chat/completions", headers=_auth("sk-alice"),
                   json={"model": "acme/tiny-b", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 403
    assert [a[2] for a in s.launched()] == ["acme/tiny-a"]
    assert [m.model for m in root.ps().models] == ["acme/tiny-a:latest"]
    assert not [x for x in _log(s) if x.get("event") in ("on_demand_unload", "on_demand_claim") and x.get("model") != "acme/tiny-a"]


def test_an_eviction_for_another_models_claim_is_logged_as_such(serve, hub):
    for repo in ("acme/tiny-a", "acme/tiny-b"):
        place(hub, repo)
    s = serve("--max-on-demand", "1", "--keep-alive", "-1")
    assert s.client.generate(model="acme/tiny-a", prompt="x", options={"num_predict": 1}).done
    assert s.client.generate(model="acme/tiny-b", prompt="x", options={"num_predict": 1}).done
    gone = [x for x in _log(s) if x.get("event") == "state" and x.get("model") == "acme/tiny-a" and x.get("to") in ("unloaded", "sleeping")]
    assert gone and gone[0]["reason"] == "its on-demand slot is wanted for another model", gone


# -- 4. one model, one name space -------------------------------------------------------------------

def test_the_operators_model_by_its_repo_id_is_answered_by_the_operators_instance(prod):
    s = prod
    bob = ollama.Client(host=s.url, headers=_auth("sk-bob"), timeout=60)
    for name in ("acme/tiny-prod", "ACME/tiny-prod:latest", "acme/tiny-prod:main", "hf.co/acme/tiny-prod"):
        assert bob.generate(model=name, prompt="x", options={"num_predict": 1}).done, name
        r = httpx.post(s.url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1}, headers=_auth("sk-bob"))
        assert r.status_code == 200, (name, r.text)
    assert [a[2] for a in s.launched()] == ["acme/tiny-prod"]  # no second copy in an on-demand slot
    assert {r["body"]["model"] for r in _sent(s, "/v1/completions")} == {"prod"}
    assert bob.show("acme/tiny-prod").details.family == "qwen2"


# -- 5. limits --------------------------------------------------------------------------------------

def test_output_tokens_are_clamped_to_the_context_and_to_a_keys_cap(prod_new_keys):
    s = prod_new_keys
    root = ollama.Client(host=s.url, headers=_auth("sk-root"), timeout=60)
    carol = ollama.Client(host=s.url, headers=_auth("sk-carol"), timeout=60)
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    assert root.chat(model="prod", messages=[{"role": "user", "content": "x [[tokens:2]]"}], options={"num_predict": 1_000_000}).done
    assert root.generate(model="prod", prompt="x [[tokens:2]]", raw=True, options={"num_predict": 1_000_000}).done
    for path, field in (("/v1/chat/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens"),
                        ("/v1/completions", "max_tokens")):
        body = {"model": "prod", field: 1_000_000, "prompt": "x [[tokens:2]]", "messages": [{"role": "user", "content": "x [[tokens:2]]"}]}
        if path == "/v1/completions":
            del body["messages"]
        r = httpx.post(s.url + path, json=body, headers=_auth("sk-root"))
        assert r.status_code == 200, r.text
    chats, completions = _sent(s, "/v1/chat/completions"), _sent(s, "/v1/completions")
    fake = _fake_url(s.launched()[0])
    room = 2048 - httpx.post(fake + "/tokenize", json={"model": "prod", "prompt": "x [[tokens:2]]"}).json()["count"]
    chat_room = 2048 - httpx.post(fake + "/tokenize", json={"model": "prod", "messages": chats[0]["body"]["messages"]}).json()["count"]
    assert [c["body"].get("max_tokens") for c in chats] == [chat_room, chat_room, None]  # the context less the prompt
    assert chats[2]["body"]["max_completion_tokens"] == chat_room
    assert [c["body"]["max_tokens"] for c in completions] == [room, room]
    # carol's cap: 5 tokens an answer, asked for or not
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    assert carol.generate(model="prod", prompt="x [[tokens:50]]", options={"num_predict": 100}).eval_count == 5
    assert carol.chat(model="prod", messages=[{"role": "user", "content": "x [[tokens:50]]"}]).eval_count == 5
    r = httpx.post(s.url + "/v1/chat/completions", headers=_auth("sk-carol"),
                   json={"model": "prod", "messages": [{"role": "user", "content": "x [[tokens:50]]"}]})
    assert r.json()["usage"]["completion_tokens"] == 5
    r = httpx.post(s.url + "/v1/completions", headers=_auth("sk-carol"), json={"model": "prod", "prompt": "x", "max_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3  # below the cap: as asked
    assert [c["body"]["max_tokens"] for c in _sent(s, "/v1/chat/completions")] == [5, 5, 5]  # generate, chat, /v1
    # the agents' routes too: Anthropic's max_tokens, the Responses API's max_output_tokens
    r = httpx.post(s.url + "/v1/messages", headers={"x-api-key": "sk-carol"},
                   json={"model": "prod", "max_tokens": 32000, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    r = httpx.post(s.url + "/v1/responses", headers=_auth("sk-carol"), json={"model": "prod", "input": "x"})
    assert r.status_code == 200, r.text
    assert [m["body"]["max_tokens"] for m in _sent(s, "/v1/messages")] == [5]
    assert [m["body"]["max_output_tokens"] for m in _sent(s, "/v1/responses")] == [5]


#: A key with a budget of 40 tokens a day (each answer below: 10 output tokens and a few prompt ones).
BUDGET_KEY = """
[[keys]]
name = "dave"
key = "sk-dave"
budget_tokens = 40
budget_period = "day"
"""


def _until(check, what: str, timeout: float = 30.0):
    """``check()``'s first true value, asked every 0.1 s (the ledger is written, then read back, on its own
    clock: ``--usage-flush-interval``, ``--usage-refresh-interval``); ``timeout`` is a failure's bound."""
    import time
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return got


def test_a_relayed_stream_is_charged_its_tokens_whether_or_not_the_client_asked_for_its_usage(serve, hub, tmp_path):
    """vLLM's stream carries its usage only when asked (``stream_options.include_usage``), which most
    OpenAI clients do not ask: such a stream used to leave its key's budget, tpm, fair share and ledger
    row at 0 tokens. vllama asks for it, and the client still gets the stream it asked for."""
    import openai
    place(hub, "acme/tiny-prod")
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(_keys(tmp_path, BUDGET_KEY)),
              "--usage-flush-interval", "0.1", "--usage-refresh-interval", "0.1")
    s.wait_ready()
    dave = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-dave", max_retries=0)
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    chunks = list(dave.chat.completions.create(model="prod", stream=True, messages=[{"role": "user", "content": "hi [[tokens:10]]"}]))
    assert chunks and all(c.choices and c.usage is None for c in chunks)  # no usage chunk: the client did not ask
    assert "".join(c.choices[0].delta.content or "" for c in chunks).split() == [f"tok{i}" for i in range(10)]
    texts = list(dave.completions.create(model="prod", prompt="hi [[tokens:10]]", max_tokens=10, stream=True))
    assert texts and all(c.choices and c.usage is None for c in texts)
    sent = _sent(s, "/v1/chat/completions") + _sent(s, "/v1/completions")
    assert [r["body"]["stream_options"] for r in sent] == [{"include_usage": True, "continuous_usage_stats": False}] * 2
    # a client that asks still gets its usage chunk, as vLLM wrote it
    asked = list(dave.chat.completions.create(model="prod", stream=True, stream_options={"include_usage": True},
                                              messages=[{"role": "user", "content": "hi [[tokens:1]]"}]))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 1
    # the ledger has every token: 10 + 10 + 1 output tokens
    mine = lambda: [u for u in httpx.get(s.url + "/api/usage", headers=_auth("sk-dave")).json()["usage"] if u["requests"] == 3]
    row = _until(mine, "the three answers' row")[0]
    assert row["output_tokens"] == 21 and row["prompt_tokens"] > 0
    # ... and the budget of 40 is spent: the next request is refused
    refused = lambda: httpx.post(s.url + "/v1/chat/completions", headers=_auth("sk-dave"),
                                 json={"model": "prod", "messages": [{"role": "user", "content": "x"}]}).status_code == 429
    _until(refused, "dave's budget")


def test_a_stream_its_client_leaves_is_charged_what_it_was_sent(serve, hub, tmp_path):
    """A stream cut by its client never gets vLLM's usage chunk: a key could read all but the last
    token of a long answer, leave, and be charged 0 tokens (budget, tpm, fair share, ledger), on
    ``/v1`` and on Ollama's routes alike."""
    place(hub, "acme/tiny-prod")
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(_keys(tmp_path)),
              "--usage-flush-interval", "0.1")
    s.wait_ready()
    body = {"model": "prod", "stream": True, "messages": [{"role": "user", "content": "hi [[tokens:100]] [[fault:slow]]"}]}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=_auth("sk-bob")) as r:
        tokens = []
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"tok' in line:
                tokens.append(line)
            if len(tokens) == 5:
                break  # the client leaves after 5 of 100 tokens (0.2 s each)
    row = _until(lambda: httpx.get(s.url + "/api/usage", headers=_auth("sk-bob")).json()["usage"], "the cut stream's row")[0]
    assert row["requests"] == 1 and 5 <= row["output_tokens"] < 100 and row["prompt_tokens"] > 0, row
    # the same on Ollama's /api/chat and /api/generate (5 NDJSON lines: 5 tokens)
    for n, (path, body) in enumerate((("/api/chat", {"model": "prod", "messages": [{"role": "user", "content": "hi [[tokens:100]] [[fault:slow]]"}]}),
                                      ("/api/generate", {"model": "prod", "prompt": "hi [[tokens:100]] [[fault:slow]]"})), 2):
        before = row
        with httpx.stream("POST", s.url + path, json=body, headers=_auth("sk-bob")) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 4:
                    break  # the client leaves after 5 lines
        row = _until(lambda n=n: [u for u in httpx.get(s.url + "/api/usage", headers=_auth("sk-bob")).json()["usage"]
                                  if u["requests"] == n], f"{path}'s row")[0]
        assert 5 <= row["output_tokens"] - before["output_tokens"] < 100 and row["prompt_tokens"] > before["prompt_tokens"], (path, row)


def test_a_user_key_cannot_jump_vllms_queue_with_its_own_priority_when_vllama_sets_none(serve, hub, tmp_path):
    """Fair sharing off, the operator's vLLM scheduling by priority (or an ``--upstream`` one): vllama sets
    no ``priority``, and a user's own went to vLLM as sent (``-99999``: before every other key's)."""
    place(hub, "acme/tiny-prod")
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(_keys(tmp_path)),
              "--fair-share", "off", "--", "--scheduling-policy", "priority")
    s.wait_ready()
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    chat = {"model": "prod", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    for key, priority in (("sk-bob", -99999), ("sk-bob", 5), ("sk-root", -7)):
        r = httpx.post(s.url + "/v1/chat/completions", json={**chat, "priority": priority}, headers=_auth(key))
        assert r.status_code == 200, (key, priority, r.text)
    r = httpx.post(s.url + "/v1/chat/completions", json={**chat, "priority": "-1"}, headers=_auth("sk-bob"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text  # one JSON type: vLLM would read "-1" as -1
    r = httpx.post(s.url + "/v1/responses", json={"model": "prod", "input": "x", "priority": -99999}, headers=_auth("sk-bob"))
    assert r.status_code == 200, r.text
    assert [c["body"].get("priority") for c in _sent(s, "/v1/chat/completions")] == [None, 5, -7]  # a user may yield; an admin decides
    assert [c["body"].get("priority") for c in _sent(s, "/v1/responses")] == [None]


def test_a_user_keys_request_starts_at_most_max_choices_sequences_in_vllm(prod):
    """vLLM bounds neither ``n`` nor a completion's list of prompts; each sequence holds a running slot,
    while the admission bound and the key's share count the request once (``n: 500`` went to vLLM as sent)."""
    s = prod
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    chat = {"model": "prod", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    for path, body in (("/v1/chat/completions", {**chat, "n": 500}), ("/v1/chat/completions", {**chat, "n": 17}),
                       ("/v1/chat/completions", {**chat, "n": 500, "use_beam_search": True}),
                       ("/v1/completions", {"model": "prod", "prompt": ["x"] * 17, "max_tokens": 1}),
                       ("/v1/completions", {"model": "prod", "prompt": ["x", "y"], "n": 9, "max_tokens": 1}),
                       # a list of prompt embeddings is a list of prompts too (--enable-prompt-embeds)
                       ("/v1/completions", {"model": "prod", "prompt_embeds": ["AAAA"] * 17, "max_tokens": 1}),
                       ("/v1/completions", {"model": "prod", "prompt_embeds": ["AAAA", "AAAA"], "n": 9, "max_tokens": 1})):
        r = httpx.post(s.url + path, json=body, headers=_auth("sk-bob"))
        assert r.status_code == 400, (path, r.text)
        assert "--max-choices" in r.json()["error"]["message"] and "at most 16" in r.json()["error"]["message"], r.text
    assert _sent(s, "/v1/chat/completions") == _sent(s, "/v1/completions") == []  # none reached vLLM
    for path, body in (("/v1/chat/completions", {**chat, "n": 16}), ("/v1/completions", {"model": "prod", "prompt": [1, 2, 3], "n": 16}),
                       ("/v1/completions", {"model": "prod", "prompt": [[1, 2]], "n": 16, "max_tokens": 1})):
        assert httpx.post(s.url + path, json=body, headers=_auth("sk-bob")).status_code == 200, body  # token ids: one prompt
    # an admin (the operator's own batch jobs, an open server's every caller) is not bounded
    assert httpx.post(s.url + "/v1/chat/completions", json={**chat, "n": 500}, headers=_auth("sk-root")).status_code == 200
    assert [r["body"].get("n") for r in _sent(s, "/v1/chat/completions")] == [16, 500]


def test_a_user_keys_v1_body_reaches_vllm_through_an_allow_list_of_fields(prod):
    """The /v1 inference routes relay the client's JSON; vLLM 0.32 acts on fields for the operator's own
    machinery (disaggregated prefill's kv_transfer_params, logits processors' vllm_xargs, its internal
    request_id, the multimodal processor's arguments). From a user key those are a 400 naming the field;
    fields vLLM would ignore are left out; sampling fields pass; an admin's body goes as sent."""
    s = prod
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    chat = {"model": "prod", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    for path, body in (("/v1/chat/completions", {**chat, "kv_transfer_params": {"do_remote_prefill": True}}),
                       ("/v1/chat/completions", {**chat, "vllm_xargs": {"x": 1}}),
                       ("/v1/completions", {"model": "prod", "prompt": "x", "request_id": "someone-elses"}),
                       ("/v1/chat/completions", {**chat, "mm_processor_kwargs": {"max_pixels": 10**9}}),
                       ("/v1/embeddings", {"model": "prod", "input": "x", "media_io_kwargs": {"video": {"num_frames": 10**6}}}),
                       ("/v1/rerank", {"model": "prod", "query": "q", "documents": ["d"], "mm_processor_kwargs": {"x": 1}}),
                       ("/v1/score", {"model": "prod", "text_1": "a", "text_2": "b", "request_id": "x"})):
        field = next(f for f in body if f not in ("model", "max_tokens", "messages", "prompt", "input", "query",
                                                  "documents", "text_1", "text_2"))
        r = httpx.post(s.url + path, json=body, headers=_auth("sk-bob"))
        assert r.status_code == 400 and f"invalid field '{field}'" in r.text and "admin key" in r.text, (path, r.text)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/v1/score"):
        assert _sent(s, path) == [], path
    sampling = {"temperature": 0.5, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1, "seed": 3}  # (cache_salt: test_cache_salt.py)
    r = httpx.post(s.url + "/v1/chat/completions", json={**chat, **sampling, "metadata": {"a": "b"}, "store": True},
                   headers=_auth("sk-bob"))
    assert r.status_code == 200, r.text
    sent = _sent(s, "/v1/chat/completions")[-1]["body"]
    assert {k: sent[k] for k in sampling} == sampling and "metadata" not in sent and "store" not in sent
    kv = {**chat, "kv_transfer_params": {"x": 1}, "metadata": {"a": "b"}}
    assert httpx.post(s.url + "/v1/chat/completions", json=kv, headers=_auth("sk-root")).status_code == 200
    sent = _sent(s, "/v1/chat/completions")[-1]["body"]
    assert sent["kv_transfer_params"] == {"x": 1} and sent["metadata"] == {"a": "b"}


def test_stop_lists_vllm_checks_on_every_token_are_bounded_on_every_route(prod):
    """vLLM checks each entry of ``stop``, ``stop_token_ids`` and ``bad_words`` on every token, in loops
    every request shares (its API server's stop strings: ~0.45 s a token for a million,
    ``ollama_types.MAX_STOPS``); vLLM 0.32 bounds them itself, older ones may not. A list of 65 went to
    vLLM as sent, from any key, on any route."""
    s = prod
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    many, words = list(range(65)), [f"w{i}" for i in range(65)]
    msgs = [{"role": "user", "content": "x"}]
    for key in ("sk-bob", "sk-root"):
        for path, body, field in (
                ("/api/chat", {"model": "prod", "messages": msgs, "options": {"stop": words}}, "options.stop"),
                ("/api/generate", {"model": "prod", "prompt": "x", "options": {"stop": words}}, "options.stop"),
                ("/v1/chat/completions", {"model": "prod", "messages": msgs, "stop": words}, "stop"),
                ("/v1/chat/completions", {"model": "prod", "messages": msgs, "stop_token_ids": many}, "stop_token_ids"),
                ("/v1/chat/completions", {"model": "prod", "messages": msgs, "bad_words": words}, "bad_words"),
                ("/v1/completions", {"model": "prod", "prompt": "x", "stop": words * 1000}, "stop")):
            r = httpx.post(s.url + path, json=body, headers=_auth(key))
            assert r.status_code == 400, (key, path, field, r.text)
            err = r.json()["error"]  # Ollama's shape on /api, OpenAI's on /v1
            assert (err["message"] if path.startswith("/v1/") else err).startswith(f"invalid {field}: at most 64 "), r.text
        r = httpx.post(s.url + "/v1/messages", headers={"x-api-key": key},
                       json={"model": "prod", "max_tokens": 5, "messages": msgs, "stop_sequences": words})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid stop_sequences: at most 64"), r.text
    assert not [r for r in httpx.get(_fake_url(s.launched()[0]) + "/_fake/requests").json() if r["path"].startswith("/v1/")]
    # 64 are taken
    ok = {"model": "prod", "messages": msgs, "max_tokens": 1, "stop": words[:64], "stop_token_ids": many[:64], "bad_words": words[:64]}
    assert httpx.post(s.url + "/v1/chat/completions", json=ok, headers=_auth("sk-bob")).status_code == 200
    assert ollama.Client(host=s.url, headers=_auth("sk-bob")).chat(model="prod", messages=msgs, options={"stop": words[:64]}).done


def test_a_keep_alive_no_clock_holds_is_a_400_and_leaves_api_ps_working_for_everyone(prod):
    """A user's ``keep_alive: 1e308`` was taken (the model's expiry ~1e308 s away), and every later
    ``/api/ps``, any key's, was a 500 (``OverflowError``) until the model unloaded: never."""
    s = prod
    for body in ({"model": "prod", "prompt": "x"}, {"model": "prod", "messages": [{"role": "user", "content": "x"}]}):
        path = "/api/generate" if "prompt" in body else "/api/chat"
        for keep_alive in (1e308, "inf", "nan", "Infinity", "99999999999h", 9_300_000_000):
            r = httpx.post(s.url + path, json={**body, "stream": False, "keep_alive": keep_alive}, headers=_auth("sk-bob"))
            assert r.status_code == 400 and r.json()["error"].startswith("invalid keep_alive: "), (path, keep_alive, r.text)
    r = httpx.post(s.url + "/api/generate", json={"model": "prod", "prompt": "x", "stream": False, "keep_alive": "24h",
                                                 "options": {"num_predict": 1}}, headers=_auth("sk-bob"))
    assert r.status_code == 200, r.text
    for key in ("sk-bob", "sk-root"):
        r = httpx.get(s.url + "/api/ps", headers=_auth(key))
        assert r.status_code == 200 and [m["name"] for m in r.json()["models"]] == ["prod:latest"], (key, r.text)


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_body_nested_past_72_levels_never_reaches_vllms_grammar_compiler(prod):
    """xgrammar's time and memory grow about as the cube of a schema's inline nesting (400 levels, 24 KB:
    23 s and 590 MB in vLLM's engine process, measured), and every route took any depth orjson parses
    (vLLM 0.32 refuses past 64 schema levels itself, once the model is loaded; an older one may not)."""
    s = prod
    httpx.delete(_fake_url(s.launched()[0]) + "/_fake/requests")
    deep, fine = _nested_schema(40), _nested_schema(31)
    msgs = [{"role": "user", "content": "x"}]

    def tool(schema: dict) -> dict:
        return {"type": "function", "function": {"name": "f", "parameters": schema}}
    for path, body in (("/api/chat", {"model": "prod", "messages": msgs, "format": deep, "stream": False}),
                       ("/api/generate", {"model": "prod", "prompt": "x", "format": deep, "stream": False}),
                       ("/v1/chat/completions", {"model": "prod", "messages": msgs, "response_format":
                                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}}),
                       ("/v1/chat/completions", {"model": "prod", "messages": msgs, "tools": [tool(deep)], "tool_choice": "required"}),
                       ("/v1/responses", {"model": "prod", "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}})):
        r = httpx.post(s.url + path, json=body, headers=_auth("sk-bob"))
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert "nested too deeply (at most 72 levels)" in (error if isinstance(error, str) else error["message"]), r.text
    r = httpx.post(s.url + "/v1/messages", headers={"x-api-key": "sk-bob"}, json={
        "model": "prod", "max_tokens": 5, "messages": msgs, "tools": [{"name": "f", "input_schema": deep}]})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    assert not [r for r in httpx.get(_fake_url(s.launched()[0]) + "/_fake/requests").json() if r["path"].startswith("/v1/")]
    # 31 levels (63 of JSON: the deepest vLLM 0.32 takes) go on, a tool's too
    r = httpx.post(s.url + "/v1/chat/completions", headers=_auth("sk-bob"), json={
        "model": "prod", "max_tokens": 1, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": fine}}})
    assert r.status_code == 200, r.text
    assert ollama.Client(host=s.url, headers=_auth("sk-bob")).chat(model="prod", messages=msgs, format=fine).done
    r = httpx.post(s.url + "/v1/chat/completions", headers=_auth("sk-bob"), json={
        "model": "prod", "max_tokens": 1, "messages": msgs, "tools": [tool(fine)], "tool_choice": "required"})
    assert r.status_code == 200, r.text


def test_a_global_connection_cap_holds_across_client_addresses(serve, hub):
    place(hub, "acme/tiny-prod")
    s = serve("--model", "acme/tiny-prod", "--max-connections", "5", "--max-connections-per-address", "100")
    s.wait_ready()
    caps = [x for x in _log(s) if x.get("event") == "connection_caps"]
    assert caps and caps[0]["total"] == 5 and caps[0]["total_from"] == "--max-connections"

    def closed_at_once(c: socket.socket) -> bool:
        c.settimeout(1.0)
        try:
            return c.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    held = []
    for source in ("127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"):  # Linux's whole 127/8 is loopback
        held.append(socket.create_connection(("127.0.0.1", s.port), source_address=(source, 0)))
    extra = socket.create_connection(("127.0.0.1", s.port), source_address=("127.0.0.4", 0))
    assert closed_at_once(extra)  # a sixth, from a fourth address
    assert not any(closed_at_once(c) for c in held[:1])
    for c in held:
        c.close()


def test_the_per_client_unit_is_an_ipv4_address_or_an_ipv6_64():
    from vllama_proxy.front.site import client_of
    assert client_of("192.0.2.7") == "192.0.2.7" and client_of("192.0.2.8") == "192.0.2.8"
    assert client_of("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_of("2001:db8:1:2::1") == client_of("2001:db8:1:2:ffff:ffff:ffff:ffff") == "2001:db8:1:2::/64"
    assert client_of("2001:db8:1:3::1") != client_of("2001:db8:1:2::1")
    assert client_of("fe80::1%eth0") == "fe80::/64"
