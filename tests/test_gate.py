"""One gate, one finisher, one settler: a hostile tenant's ways to be served uncharged, pass a cap or reach
vLLM's machinery, each tried against ``vllama serve --upstream`` over the stand-in vLLM with a keys file.

Each test here failed on the code before the gate (``api/request/``), the finisher (``api/request/finisher.py``) and the
settler (``api/request/settler.py``): a body with no ``model`` was served and charged nothing; ``"stream": 1`` streamed
with no usage asked; ``n: "8"`` and ``max_tokens: "200"`` passed the caps that read only integers; the agents'
routes relayed vLLM's operator fields and unbounded stop lists; budgets and ``tpm`` were checked against
finished requests only, so 16 requests at once all passed; refused requests left no trace of their key; a
created model's system prompt was not applied on ``/v1``; ``/v1/messages/count_tokens`` was free.
The same findings against the real vLLM on CPU: ``tests/real_engine/test_real_gate.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from conftest import SERVED, metric, start_proxy, stop

ADMIN, BOB, CAPPED, THRIFTY, MINUTE = "sk-gate-admin", "sk-gate-bob", "sk-gate-capped", "sk-gate-thrifty", "sk-gate-minute"
KEYS = f"""
[[keys]]
name = "ops"
key = "{ADMIN}"
role = "admin"

[[keys]]
name = "bob"
key = "{BOB}"

[[keys]]
name = "capped"
key = "{CAPPED}"
max_tokens = 4

[[keys]]
name = "thrifty"
key = "{THRIFTY}"
budget_tokens = 100
budget_period = "day"

[[keys]]
name = "minute"
key = "{MINUTE}"
tpm = 100
"""


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def proxy(fake, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    s = start_proxy(fake.url, "--api-key-file", str(keys), "--workers", "1", "--max-choices", "2",
                    env={"VLLAMA_STATE_DIR": str(tmp_path / "state")}, log=tmp_path / "vllama.log")
    yield s
    stop(s.proc)


def _sent(fake, path: str) -> list[dict]:
    return [r for r in httpx.get(fake.url + "/_fake/requests").json() if r["path"] == path]


def _forget(fake) -> None:
    httpx.delete(fake.url + "/_fake/requests")


def _usage(url: str, key: str) -> list[dict]:
    r = httpx.get(url + "/api/usage", params={"key": key}, headers=_auth(ADMIN), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _tokens(url: str, key: str) -> int:
    return sum(u["prompt_tokens"] + u["output_tokens"] for u in _usage(url, key))


def test_a_body_without_a_model_is_served_by_the_default_and_charged_to_it(proxy, fake):
    """Before: the default model answered and the ledger, the key's metrics and its budget saw nothing."""
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   headers=_auth(BOB), timeout=30)
    assert r.status_code == 200, r.text
    [row] = _usage(proxy.url, "bob")
    assert row["model"] == SERVED and row["requests"] == 1 and row["output_tokens"] == r.json()["usage"]["completion_tokens"] > 0
    text = httpx.get(proxy.url + "/metrics", headers=_auth(ADMIN)).text
    assert metric(text, "vllama_key_output_tokens_total", key="bob", model=SERVED) == row["output_tokens"]


#: (route, field, a spelling vLLM's lax pydantic reads as another type) -> 400 naming the field, nothing sent.
SPELLINGS = [
    ("/v1/chat/completions", "stream", 1),
    ("/v1/chat/completions", "stream", "true"),
    ("/v1/chat/completions", "n", "8"),
    ("/v1/chat/completions", "n", 8.0),
    ("/v1/chat/completions", "n", "1e2"),
    ("/v1/chat/completions", "max_tokens", "200"),
    ("/v1/chat/completions", "max_tokens", 200.0),
    ("/v1/chat/completions", "max_completion_tokens", "200"),
    ("/v1/chat/completions", "stream_options", {"include_usage": "no"}),
    ("/v1/chat/completions", "priority", "-5"),
    ("/v1/chat/completions", "model", 7),
    ("/v1/completions", "n", True),
    ("/v1/completions", "prompt", ["x", 1]),
    ("/v1/completions", "max_tokens", "200"),
    ("/v1/messages", "max_tokens", "200"),
    ("/v1/messages", "stream", "yes"),
    ("/v1/responses", "max_output_tokens", 200.0),
    ("/v1/responses", "stream", 1),
]
_BASE = {
    "/v1/chat/completions": {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": SERVED, "prompt": "hi"},
    "/v1/messages": {"model": SERVED, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": SERVED, "input": "hi"},
}


@pytest.mark.parametrize(("path", "field", "value"), SPELLINGS, ids=[f"{p[4:]}-{f}-{v!r}" for p, f, v in SPELLINGS])
def test_a_policy_field_has_one_json_type_and_another_spelling_is_refused_naming_it(proxy, fake, path, field, value):
    _forget(fake)
    r = httpx.post(proxy.url + path, json={**_BASE[path], field: value}, headers=_auth(CAPPED), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert message.startswith(f"invalid {field}"), message
    assert _sent(fake, path) == []


def test_the_caps_hold_for_the_checked_values_and_what_vllm_gets_is_what_was_checked(proxy, fake):
    """The key's ``max_tokens`` (4) and ``--max-choices`` (2) on the integers the gate lets through."""
    _forget(fake)
    r = httpx.post(proxy.url + "/v1/chat/completions", json={**_BASE["/v1/chat/completions"], "max_tokens": 200},
                   headers=_auth(CAPPED), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
    r = httpx.post(proxy.url + "/v1/messages", json={**_BASE["/v1/messages"], "max_tokens": 200}, headers=_auth(CAPPED), timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(proxy.url + "/v1/responses", json={**_BASE["/v1/responses"], "max_output_tokens": 200}, headers=_auth(CAPPED), timeout=30)
    assert r.status_code == 200, r.text
    assert [c["body"]["max_tokens"] for c in _sent(fake, "/v1/chat/completions")] == [4]
    assert [c["body"]["max_tokens"] for c in _sent(fake, "/v1/messages")] == [4]
    assert [c["body"]["max_output_tokens"] for c in _sent(fake, "/v1/responses")] == [4]
    r = httpx.post(proxy.url + "/v1/completions", json={"model": SERVED, "prompt": ["a", "b"], "n": 2}, headers=_auth(BOB), timeout=30)
    assert r.status_code == 400 and "4 sequences" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("field", ["kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "media_io_kwargs", "request_id"])
def test_the_agents_routes_refuse_vllms_machinery_from_a_user_key(proxy, fake, path, field):
    _forget(fake)
    r = httpx.post(proxy.url + path, json={**_BASE[path], field: {"x": 1} if field != "request_id" else "r1"},
                   headers=_auth(BOB), timeout=30)
    assert r.status_code == 400 and f"invalid field '{field}'" in r.text, r.text
    assert _sent(fake, path) == []


def test_the_agents_routes_bound_their_stops_and_drop_what_vllm_does_not_know(proxy, fake):
    _forget(fake)
    for body in ({"stop_token_ids": list(range(100_000))}, {"stop": [str(i) for i in range(1000)]}):
        r = httpx.post(proxy.url + "/v1/responses", json={**_BASE["/v1/responses"], **body}, headers=_auth(BOB), timeout=30)
        assert r.status_code == 400 and "at most 64 entries" in r.json()["error"]["message"], r.text
    r = httpx.post(proxy.url + "/v1/messages", json={**_BASE["/v1/messages"], "stop_sequences": ["x"] * 65}, headers=_auth(BOB), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "invalid stop_sequences: at most 64 entries, not 65", r.text
    r = httpx.post(proxy.url + "/v1/responses", json={**_BASE["/v1/responses"], "background": True}, headers=_auth(BOB), timeout=30)
    assert r.status_code == 400 and "background" in r.json()["error"]["message"], r.text
    assert _sent(fake, "/v1/responses") == [] and _sent(fake, "/v1/messages") == []
    r = httpx.post(proxy.url + "/v1/responses", json={**_BASE["/v1/responses"], "not_a_field": 1}, headers=_auth(BOB), timeout=30)
    assert r.status_code == 200, r.text
    [sent] = _sent(fake, "/v1/responses")
    assert "not_a_field" not in sent["body"] and sent["body"]["store"] is False  # stateless, as Ollama serves it


def test_count_tokens_charges_its_prompt(proxy, fake):
    r = httpx.post(proxy.url + "/v1/messages/count_tokens", json={"model": SERVED, "messages": [{"role": "user", "content": "hi " * 50}]},
                   headers=_auth(BOB), timeout=30)
    assert r.status_code == 200, r.text
    [row] = _usage(proxy.url, "bob")
    assert row["prompt_tokens"] == r.json()["input_tokens"] > 0 and row["output_tokens"] == 0


async def _at_once(url: str, key: str, n: int) -> list[int]:
    body = {"model": SERVED, "max_tokens": 30, "messages": [{"role": "user", "content": "hi [[tokens:30]] [[fault:slow]]"}]}
    async with httpx.AsyncClient(timeout=60) as c:
        rs = await asyncio.gather(*(c.post(url + "/v1/chat/completions", json=body, headers=_auth(key)) for _ in range(n)))
    return [r.status_code for r in rs]


@pytest.mark.parametrize("key,name,limit", [(THRIFTY, "thrifty", 100), (MINUTE, "minute", 100)])
def test_requests_sent_at_once_cannot_overspend_a_budget_or_a_tpm(proxy, fake, key, name, limit):
    """16 requests at once of a key with 100 tokens (a day's budget, or a minute's tpm): before, all 16 were
    answered (16 x ~33 tokens); now each reserves its worst case (prompt estimate + 30) at admission, so the
    key is overspent by at most one reservation."""
    statuses = asyncio.run(_at_once(proxy.url, key, 16))
    assert statuses.count(429) >= 12 and set(statuses) <= {200, 429}, statuses
    used = _tokens(proxy.url, name)
    assert 0 < used <= limit + 60, (used, statuses)


def test_a_refused_request_is_recorded_for_its_key(proxy, fake):
    r = httpx.post(proxy.url + "/v1/chat/completions", json={**_BASE["/v1/chat/completions"], "n": "8"}, headers=_auth(BOB))
    assert r.status_code == 400
    r = httpx.post(proxy.url + "/v1/chat/completions", json=_BASE["/v1/chat/completions"], headers=_auth("sk-nobody"))
    assert r.status_code == 401
    rows = _usage(proxy.url, "bob")
    assert [(row["requests"], row["errors"]) for row in rows] == [(1, 1)], rows
    text = httpx.get(proxy.url + "/metrics", headers=_auth(ADMIN)).text
    assert metric(text, "vllama_key_requests_total", key="bob", status="4xx") == 1
    assert metric(text, "vllama_key_requests_total", key="(none)", status="4xx") == 1


def test_a_created_models_system_prompt_and_name_hold_on_v1(proxy, fake):
    r = httpx.post(proxy.url + "/api/create", json={"model": "mario", "from": SERVED, "system": "You are Mario.",
                                                    "parameters": {"temperature": 0.25}, "stream": False},
                   headers=_auth(ADMIN), timeout=30)
    assert r.status_code == 200, r.text
    _forget(fake)
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "mario", "messages": [{"role": "user", "content": "hi"}]},
                   headers=_auth(BOB), timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "mario", r.text
    [sent] = _sent(fake, "/v1/chat/completions")
    assert sent["body"]["messages"][0] == {"role": "system", "content": "You are Mario."}
    assert sent["body"]["temperature"] == 0.25 and sent["body"]["model"] == SERVED
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", headers=_auth(BOB), timeout=30,
                      json={"model": "mario", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as s:
        text = "".join(s.iter_text())
    assert '"model":"mario"' in text and f'"model":"{SERVED}"' not in text


def test_embeddings_of_a_chat_model_are_refused_in_openais_shape(proxy, fake):
    r = httpx.post(proxy.url + "/v1/embeddings", json={"model": SERVED, "input": "hi"}, headers=_auth(BOB), timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f'"{SERVED}" does not support embeddings'
