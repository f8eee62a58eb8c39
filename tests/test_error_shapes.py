"""One error shape per route family: OpenAI's on ``/v1``, Anthropic's on ``/v1/messages``, Ollama's on ``/api``.

Whichever layer refuses a request (the API key, admission's rate limits, the route's own checks of the
body), a ``/v1`` client reads OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (as Ollama's own
OpenAI-compatible routes answer, ``openai/openai.go`` ``NewError``, and vLLM does), so the real ``openai``
client raises the class of the status with the message and the type in it; an Ollama client on ``/api``
still reads ``{"error": "..."}``. Before, the key check, the rate limits, the stop and choice bounds and
the 403s answered ``/v1`` in Ollama's shape while the body's parse answered in vLLM's.

``vllama serve`` supervising two stand-in vLLMs (``alpha``, ``beta``: with several models vllama answers a
request naming none, or an unknown one, itself), behind a keys file.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import ollama
import openai
import pytest

from conftest import Vllama, shown_on_failure, stop, write_keys

KEYS = [
    {"name": "root", "key": "sk-root", "role": "admin"},
    {"name": "bob", "key": "sk-bob", "role": "user", "models": ["alpha"]},
    {"name": "rl", "key": "sk-rl", "role": "user", "models": ["alpha"], "rpm": 1},
]
HI = [{"role": "user", "content": "hi"}]


def _nested(depth: int) -> dict:
    inner: dict = {"type": "string"}
    for _ in range(depth):
        inner = {"type": "object", "properties": {"a": inner}}
    return inner


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Vllama]:
    tmp = tmp_path_factory.mktemp("shapes")
    write_keys(tmp / "keys.toml", *KEYS)
    blocks = []
    for name in ("alpha", "beta"):
        (tmp / name).mkdir()
        blocks.append(f'[[models]]\nmodel = "{tmp / name}"\nname = "{name}"\ngpu_memory_utilization = 0.45\n')
    v = Vllama(tmp, config="\n".join(blocks), flags=["--api-key-file", str(tmp / "keys.toml"), "--max-choices", "4"])
    try:
        deadline, states = time.monotonic() + 60, {}
        while states != {"alpha": "ready", "beta": "ready"}:  # each stand-in is ready in about a second
            assert v.proc.poll() is None and time.monotonic() < deadline, states
            body = httpx.get(v.url + "/readyz", headers={"Authorization": "Bearer sk-root"}).json()
            states = {m["model"]: m["state"] for m in body["models"]}
            time.sleep(0.05)
        yield v
    finally:
        stop(v.proc, timeout=20)


@pytest.fixture(autouse=True)
def _log_shown(server, request) -> None:
    shown_on_failure(request, server.log)  # the server's log in a failing test's report


def _oai(server: Vllama, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _raw(oai: openai.OpenAI, body: bytes):
    return oai.post("/chat/completions", cast_to=object, content=body, options={"headers": {"Content-Type": "application/json"}})


def _limited(oai: openai.OpenAI):
    for _ in range(3):  # rpm 1: the first of a minute passes, the next is refused (a new minute may come between)
        oai.chat.completions.create(model="alpha", messages=HI, max_tokens=1)


#: (what, key, the request through the real openai client, its exception class, status, type, message, param, code)
REFUSALS = [
    ("invalid JSON", "sk-root", lambda o: _raw(o, b'{"model": "alpha", "messages": [], "x": NaN}'),
     openai.BadRequestError, 400, "invalid_request_error", "invalid JSON: unexpected character", None, "400"),
    ("a field only an admin sends", "sk-bob",
     lambda o: o.chat.completions.create(model="alpha", messages=HI, extra_body={"kv_transfer_params": {}}),
     openai.BadRequestError, 400, "invalid_request_error", "invalid field 'kv_transfer_params'", None, "400"),
    ("a body nested too deep", "sk-bob",
     lambda o: o.chat.completions.create(model="alpha", messages=HI, extra_body={"guided_json": _nested(80)}),
     openai.BadRequestError, 400, "invalid_request_error", "request body is nested too deeply (at most 72 levels)", None, "400"),
    ("too many stop strings", "sk-bob",
     lambda o: o.chat.completions.create(model="alpha", messages=HI, stop=[str(i) for i in range(65)]),
     openai.BadRequestError, 400, "invalid_request_error", "invalid stop: at most 64 entries, not 65", "stop", "400"),
    ("n over --max-choices", "sk-bob", lambda o: o.chat.completions.create(model="alpha", messages=HI, n=5),
     openai.BadRequestError, 400, "invalid_request_error", "this request asks for 5 sequences at once", None, "400"),
    ("no model, several served", "sk-root",
     lambda o: o.chat.completions.create(model="alpha", messages=HI, extra_body={"model": None}),
     openai.BadRequestError, 400, "invalid_request_error", "you must provide a model parameter", "model", "400"),
    ("an unknown model, several served", "sk-root", lambda o: o.chat.completions.create(model="nope", messages=HI),
     openai.NotFoundError, 404, "not_found_error", "The model `nope` does not exist.", "model", "model_not_found"),
    ("an unknown model's card", "sk-root", lambda o: o.models.retrieve("nope"),
     openai.NotFoundError, 404, "not_found_error", "The model `nope` does not exist.", "model", "model_not_found"),
    ("an unknown key", "sk-nope", lambda o: o.chat.completions.create(model="alpha", messages=HI),
     openai.AuthenticationError, 401, "authentication_error", "unauthorized: send Authorization: Bearer <api key>", None,
     "invalid_api_key"),
    ("a model outside the key's patterns", "sk-bob", lambda o: o.chat.completions.create(model="beta", messages=HI),
     openai.PermissionDeniedError, 403, "permission_error", "key 'bob' may not use model 'beta' (its models: alpha)", None, "403"),
    ("a route the key's role may not call", "sk-bob",
     lambda o: o.post("/load_lora_adapter", cast_to=object, body={"lora_name": "x", "lora_path": "/etc"}),
     openai.PermissionDeniedError, 403, "permission_error", "key 'bob' (role user) may not call POST /v1/load_lora_adapter", None, "403"),
    ("the Responses API, outside the key's patterns", "sk-bob", lambda o: o.responses.create(model="beta", input="hi"),
     openai.PermissionDeniedError, 403, "permission_error", "key 'bob' may not use model 'beta' (its models: alpha)", None, "403"),
    ("a key over its rpm", "sk-rl", _limited,
     openai.RateLimitError, 429, "rate_limit_error", "key 'rl' reached its rpm of 1 requests per minute", None, "rate_limit_exceeded"),
]


@pytest.mark.parametrize(("what", "key", "call", "cls", "status", "kind", "message", "param", "code"), REFUSALS,
                         ids=[r[0] for r in REFUSALS])
def test_every_refusal_on_v1_is_openais_shape_read_by_the_openai_client(server, what, key, call, cls, status, kind, message,
                                                                        param, code):
    with pytest.raises(cls) as e:
        call(_oai(server, key))
    err = e.value
    assert err.status_code == status, what
    assert err.message.startswith(f"Error code: {status} - {message}"), (what, err.message)  # the SDK found the message
    assert err.body == {"message": err.message.removeprefix(f"Error code: {status} - "), "type": kind, "param": param,
                        "code": int(code) if code.isdigit() else code}, what
    assert (err.type, err.param, err.code) == (kind, param, code), what


def test_the_headers_stay_and_ollama_routes_keep_ollamas_shape(server):
    """The same refusals' headers on ``/v1`` (``WWW-Authenticate``, ``Retry-After``, ``x-ratelimit-*``), vllama's own
    404 and 405 on ``/v1`` in OpenAI's shape, and the same refusals on ``/api`` in Ollama's, which the ``ollama``
    client reads."""
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "alpha", "messages": HI})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"
    for _ in range(3):  # rpm 1: the first of a minute passes (a new minute may come between)
        r = httpx.post(server.url + "/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 1},
                       headers={"Authorization": "Bearer sk-rl"})
        if r.status_code == 429:
            break
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and r.headers["x-ratelimit-limit-requests"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    r = httpx.post(server.url + "/v1/sleep", json={}, headers={"Authorization": "Bearer sk-root"})  # never relayed
    assert r.status_code == 404 and r.json() == {"error": {"message": "404 page not found", "type": "not_found_error",
                                                           "param": None, "code": 404}}
    r = httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-root"})
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert r.json() == {"error": {"message": "method not allowed", "type": "invalid_request_error", "param": None, "code": 405}}
    # /api: Ollama's {"error": "..."}, the ollama client's ResponseError with that text
    r = httpx.post(server.url + "/api/chat", json={"model": "alpha", "messages": HI})
    assert r.status_code == 401 and r.json() == {"error": "unauthorized: send Authorization: Bearer <api key>"}
    bob = ollama.Client(host=server.url, headers={"Authorization": "Bearer sk-bob"})
    with pytest.raises(ollama.ResponseError) as e:
        bob.chat(model="beta", messages=HI)
    assert e.value.status_code == 403 and e.value.error == "key 'bob' may not use model 'beta' (its models: alpha)"
    r = httpx.post(server.url + "/api/generate", content=b'{"model": "alpha", "prompt": "x", "x": NaN}',
                   headers={"Authorization": "Bearer sk-root"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    for _ in range(3):
        rl = httpx.post(server.url + "/api/generate", json={"model": "alpha", "prompt": "x", "stream": False},
                        headers={"Authorization": "Bearer sk-rl"})
        if rl.status_code == 429:
            break
    assert rl.status_code == 429 and rl.json() == {"error": "key 'rl' reached its rpm of 1 requests per minute; retry after the "
                                                            "minute ends"}

