"""The gate against the real vLLM 0.32 on CPU: a differential test of what vllama lets through, what vLLM
then runs, and what the ledger charges, with bodies whose policy fields come in every JSON spelling vLLM's
lax pydantic models accept.

vllama parses each relayed body once into its route's typed request (``api/request/``: one JSON type per policy
field), finishes what vLLM gets in one place (``api/request/finisher.py``: the model, the output cap by the key's
``max_tokens``, a stream's usage asked) and charges every answer once (``api/request/settler.py``); budgets and
``tpm`` reserve a request's worst case at admission. ``tests/test_gate.py`` tries the same findings over
the stand-in vLLM; here the other side of each is the real engine: what it ran is read from vLLM's own
Prometheus counters (its ``/metrics``, beside vllama's), so a cap is checked where it matters, on the
sequences and tokens vLLM generated, and every 200's tokens in the ledger (``GET /api/usage``) are
compared with what vLLM counted.

On the code before the gate (b18870d) 17 of the 18 tests failed: the hypothesis test's first body of
chat and completions (one without ``model``) was answered and charged nothing, and a /v1/responses body
(``"stream": null`` with stops) was a 500; ``"stream": 1``, ``n: "8"``, ``"max_tokens": "200"`` ... were
answered 200 instead of refused (vLLM ran 8 choices, 200 tokens); 16 requests at once spent a 100-token
budget (and a 100-token ``tpm``) as 672 tokens. (Its /v1/messages examples passed there.)

The session's ``keys_server`` (``conftest.py``, shared with test_real_many_users.py; these tests run first on it):
the tiny model with user keys that have a ``max_tokens`` cap, a budget, a ``tpm``, ``--max-choices 2``, one worker
(``/api/usage`` writes its own process's rows first) and a short ``--usage-flush-interval``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings, strategies as st

from .conftest import ADMIN, BOB, BUDGET, CAP, CAPPED, CHOICES, MINUTE, THRIFTY, TPM, RealVllama

MODEL = "tiny"
#: How long a counter (vLLM's, the ledger's) may take to show a request that was answered: a failure's bound.
SETTLE_S = 60.0


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- what vLLM ran: its own counters -------------------------------------------------------------------------

#: vLLM 0.32's counters read (``vllm/v1/metrics/loggers.py``): every engine request (a sequence: ``n`` x
#: prompts of one API request) finishes once, with its ``max_tokens``; ``n`` is observed once per prompt.
_VLLM = {
    "prompt": "vllm:prompt_tokens_total",
    "generated": "vllm:generation_tokens_total",
    "sequences": "vllm:request_success_total",
    "max_tokens_sum": "vllm:request_params_max_tokens_sum",
    "max_tokens_count": "vllm:request_params_max_tokens_count",
    "n_sum": "vllm:request_params_n_sum",
    "n_count": "vllm:request_params_n_count",
}


def vllm_url(v: RealVllama) -> str:
    """The supervised vLLM's own address, from vllama's ``launched`` log line."""
    argv = [json.loads(x)["argv"] for x in v.log.read_text().splitlines() if '"launched"' in x][-1]
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def vllm_counts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {k: sum(float(x) for x in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            for k, name in _VLLM.items()}


def vllm_ran(url: str, before: dict[str, float], sequences: int) -> dict[str, float]:
    """What vLLM ran since ``before``, once at least ``sequences`` of its requests finished (vLLM counts a
    request in the loop iteration after its last output, which may come after the client's last byte)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        after = vllm_counts(url)
        ran = {k: after[k] - before[k] for k in after}
        if ran["sequences"] >= sequences or time.monotonic() > deadline:
            return ran
        time.sleep(0.05)


# --- what vllama charged: its ledger ---------------------------------------------------------------------------


def ledger(url: str, key: str) -> tuple[int, int]:
    """``(prompt tokens, output tokens)`` the ledger holds for key ``key`` (``/api/usage`` writes this worker's
    rows first)."""
    r = httpx.get(url + "/api/usage", params={"key": key, "since": "2000-01-01"}, headers=_auth(ADMIN), timeout=30)
    assert r.status_code == 200, r.text
    rows = r.json()["usage"]
    return sum(u["prompt_tokens"] for u in rows), sum(u["output_tokens"] for u in rows)


def ledger_rows(url: str, key: str) -> list[dict]:
    r = httpx.get(url + "/api/usage", params={"key": key, "since": "2000-01-01"}, headers=_auth(ADMIN), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def charged(url: str, key: str, before: tuple[int, int], want: tuple[int, int]) -> None:
    """The ledger of ``key`` holds ``want`` (prompt, output) tokens more than ``before``: what vLLM counted for
    the key's answers since (a streamed answer is charged after its last byte: waited for, within ``SETTLE_S``)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = ledger(url, key)
        got = (now[0] - before[0], now[1] - before[1])
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == want, f"charged to {key}: {got} (prompt, output) tokens; vLLM counted {want}"


@dataclass
class Server:
    v: RealVllama
    vllm: str

    @property
    def url(self) -> str:
        return self.v.url


@pytest.fixture
def server(keys_server) -> Server:
    return Server(keys_server, vllm_url(keys_server))


# --- one answer, as the client saw it ------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    body: Any  # the JSON body, or the list of SSE events' data
    streamed: bool
    choices: int = 0  # sequences the client got (choices' indexes; 1 on the agents' routes)
    usage: tuple[int, int] | None = None  # (prompt, output) as the client saw it, if it did
    errors: list = field(default_factory=list)  # error events in a 200 stream


def send(url: str, path: str, body: dict, key: str) -> Answer:
    with httpx.stream("POST", url + path, json=body, headers=_auth(key), timeout=300) as r:
        raw = r.read()
    streamed = r.headers.get("content-type", "").startswith("text/event-stream")
    if not streamed:
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return Answer(r.status_code, parsed, False, *(_of_json(path, parsed) if r.status_code == 200 else (0, None)))
    events = [json.loads(line[5:]) for line in raw.decode().splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    a = Answer(r.status_code, events, True)
    a.errors = [e for e in events if "error" in e or e.get("type") in ("error", "response.failed")]
    if path in ("/v1/chat/completions", "/v1/completions"):
        a.choices = len({c["index"] for e in events for c in e.get("choices") or []})
        a.usage = next(((u["prompt_tokens"], u["completion_tokens"]) for e in reversed(events) if (u := e.get("usage"))), None)
    elif path == "/v1/messages":
        a.choices = 1
        a.usage = next(((u.get("input_tokens", 0), u["output_tokens"]) for e in reversed(events)
                        if e.get("type") == "message_delta" and (u := e.get("usage"))), None)
    else:
        a.choices = 1
        a.usage = next(((u["input_tokens"], u["output_tokens"]) for e in reversed(events)
                        if e.get("type") == "response.completed" and (u := e["response"].get("usage"))), None)
    return a


def _of_json(path: str, body: dict) -> tuple[int, tuple[int, int] | None]:
    u = body.get("usage")
    if path in ("/v1/chat/completions", "/v1/completions"):
        return len(body["choices"]), (u["prompt_tokens"], u["completion_tokens"]) if u else None
    return 1, (u["input_tokens"], u["output_tokens"]) if u else None


def check_answer(s: Server, path: str, body: dict, key: str, cap: int | None) -> Answer:
    """Send ``body``; then the invariants: a 200 or a 4xx, never a 5xx; on a 200, what vLLM ran stays within
    ``--max-choices`` and the key's ``cap``, the client's usage (where it sees one) is vLLM's count, and the
    ledger holds every token vLLM counted for the key."""
    name = key.removeprefix("sk-gd-")
    before, billed = vllm_counts(s.vllm), ledger(s.url, name)
    a = send(s.url, path, body, key)
    assert a.status == 200 or 400 <= a.status < 500, (a.status, a.body)
    want = (0, 0)
    if a.status == 200:
        assert not a.errors, a.errors
        ran = vllm_ran(s.vllm, before, a.choices)
        sequences = int(ran["sequences"])
        assert 1 <= sequences == a.choices <= CHOICES, (ran, a.choices)
        if cap is not None:
            # every sequence vLLM ran had a max_tokens within the cap (vLLM sets one where none is sent: the
            # context left), and generated within it
            assert ran["max_tokens_count"] == sequences and ran["max_tokens_sum"] <= cap * sequences, ran
            assert ran["generated"] <= cap * sequences, ran
        n = ran["n_sum"] / ran["n_count"]  # vLLM prefills each of a prompt's n sequences: usage counts it once
        want = (int(ran["prompt"] / n), int(ran["generated"]))
        if a.usage is not None:
            assert a.usage == want, (a.usage, ran)
    charged(s.url, name, billed, want)  # a refusal: nothing
    return a


# --- 1. the differential test --------------------------------------------------------------------------------

def _int_spellings(plain: st.SearchStrategy) -> st.SearchStrategy:
    """An integer field in the other spellings vLLM's lax pydantic reads as an integer (numeric strings,
    whole floats, exponents, bools), null, and a few it refuses."""
    return st.one_of(plain.map(str), plain.map(float), plain.map(lambda i: f"{i}e0"),
                     st.sampled_from([None, True, False, "1e2", 1e2, "8", 8.0, " 2", 2.5, "", "x"]))


#: The other spellings of a boolean vLLM's pydantic reads as one, null, and a few it refuses.
BOOL_SPELLINGS = st.sampled_from([None, 1, 0, 1.0, 0.0, "true", "false", "True", "1", "0", "yes", "no", "on", "off",
                                  "t", "f", "y", 2, "maybe"])
HI = [{"role": "user", "content": "hi"}]


_N = st.integers(1, 3)
_OUT = st.integers(1, 300)
_PRIORITY = st.integers(-10, 10)
#: Each policy field: (its plain values, its other spellings).
FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "model": (st.just(MODEL), st.sampled_from([None, 7, "", [MODEL], {"name": MODEL}])),
    "n": (_N, _int_spellings(_N)),
    "max_tokens": (_OUT, _int_spellings(_OUT)),
    "max_completion_tokens": (_OUT, _int_spellings(_OUT)),
    "max_output_tokens": (_OUT, _int_spellings(_OUT)),
    "stream": (st.booleans(), BOOL_SPELLINGS),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.one_of(st.sampled_from([None, {}, {"continuous_usage_stats": True}]),
                                 st.fixed_dictionaries({"include_usage": BOOL_SPELLINGS}))),
    "priority": (_PRIORITY, _int_spellings(_PRIORITY)),
    "stop": (st.sampled_from(["e", ["e", " "], []]), st.sampled_from([None, [1], 1, [None], ["e", 1]])),
    "stop_sequences": (st.sampled_from([["e"], ["e", " "], []]), st.sampled_from([None, "e", [1], 1])),
    "stop_token_ids": (st.sampled_from([[], [3, 7]]), st.sampled_from([None, ["3"], [3.0], [True], "3", 3])),
    "ignore_eos": (st.booleans(), BOOL_SPELLINGS),
}
#: Each route's body: what it always carries, and the policy fields it may carry.
ROUTES: dict[str, tuple[st.SearchStrategy, tuple[str, ...]]] = {
    "/v1/chat/completions": (st.fixed_dictionaries({"messages": st.just(HI)}),
                             ("model", "n", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                              "priority", "stop", "stop_token_ids", "ignore_eos")),
    "/v1/completions": (st.fixed_dictionaries({"prompt": st.sampled_from(["hi", ["hi", "yo"], [[1, 2, 3]], [1, 2]])}),
                        ("model", "n", "max_tokens", "stream", "stream_options", "priority", "stop", "stop_token_ids",
                         "ignore_eos")),
    "/v1/responses": (st.fixed_dictionaries({"input": st.just("hi")}),
                      ("model", "max_output_tokens", "stream", "priority", "stop", "stop_token_ids", "ignore_eos")),
    "/v1/messages": (st.fixed_dictionaries({"messages": st.just(HI)}), ("model", "max_tokens", "stream", "stop_sequences")),
}


@st.composite
def bodies(draw, path: str) -> dict:
    """A body of ``path``: each of its policy fields present or missing, in a plain value; then up to two of
    them in another spelling (one at a time, so that one field's refusal does not hide another's)."""
    base, names = ROUTES[path]
    body = dict(draw(base))
    for name in names:
        if draw(st.booleans()):
            body[name] = draw(FIELDS[name][0])
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        body[name] = draw(FIELDS[name][1])
    return body


@pytest.mark.parametrize("path", list(ROUTES))
# the server fixture is function-scoped but the session's one server (conftest.keys_server): every example meets it
@settings(max_examples=8, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          print_blob=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_spelling_of_a_policy_field_stays_within_the_caps_and_every_answer_is_charged(server, path, data):
    """A user key with ``max_tokens = 4`` and ``--max-choices 2``: whatever the spelling of ``n``, the output
    fields, ``stream``, ``stream_options``, ``model``, ``priority`` and the stops, the answer is a 200 or a
    4xx, vLLM runs at most 2 sequences of at most 4 tokens each, and the ledger holds what vLLM counted."""
    body = data.draw(bodies(path), label="body")
    a = check_answer(server, path, body, CAPPED, CAP)
    event(f"{a.status}{' streamed' if a.streamed else ''}{f' x{a.choices}' if a.choices > 1 else ''}")  # --hypothesis-show-statistics


# --- 2. budgets and tpm against requests at once ------------------------------------------------------------


async def _at_once(url: str, key: str, n: int, body: dict) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as c:
        return await asyncio.gather(*(c.post(url + "/v1/chat/completions", json=body, headers=_auth(key)) for _ in range(n)))


@pytest.mark.parametrize(("key", "name", "limit"), [(THRIFTY, "thrifty", BUDGET), (MINUTE, "minute", TPM)])
def test_requests_at_once_overspend_a_budget_or_a_tpm_by_at_most_one_reservation(server, key, name, limit):
    """16 requests of 30 tokens at once from a key with 100 tokens (a day's ``budget_tokens``, or a minute's
    ``tpm``): each reserves its worst case at admission (its prompt estimate + its 30 tokens), so the key's
    tokens in the ledger are at most its limit plus one request's (the last one admitted). Before, every one
    was admitted against the finished requests only: all 16 answered, ~8x the limit."""
    body = {"model": MODEL, "max_tokens": 30, "ignore_eos": True, "messages": HI}
    if name == "minute" and time.time() % 60 > 45:  # tpm's window is the wall-clock minute: start in a fresh one
        time.sleep(60 - time.time() % 60 + 0.5)
    first = int(time.time() // 60)
    before, billed = vllm_counts(server.vllm), ledger(server.url, name)
    rs = asyncio.run(_at_once(server.url, key, 16, body))
    minutes = int(time.time() // 60) - first + 1  # tpm: each minute the burst spans has its own limit
    statuses = [r.status_code for r in rs]
    assert set(statuses) <= {200, 429} and 200 in statuses, statuses
    used = [(r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]) for r in rs if r.status_code == 200]
    ran = vllm_ran(server.vllm, before, len(used))
    assert ran["sequences"] == len(used) and ran["generated"] == sum(o for _, o in used), (ran, used)
    charged(server.url, name, billed, (sum(p for p, _ in used), sum(o for _, o in used)))  # every answer, exactly
    one = max(p + o for p, o in used)
    total = sum(p + o for p, o in used)
    assert total <= (limit + one) * (minutes if name == "minute" else 1), (total, statuses)


# --- 3. the findings, one by one, on the real vLLM ----------------------------------------------------------

#: A spelling vLLM's pydantic coerces (it ran 8 sequences, 200 tokens, a stream charged nothing) -> 400 naming it.
SPELLINGS = [
    ("/v1/chat/completions", "stream", 1),
    ("/v1/chat/completions", "stream", "true"),
    ("/v1/chat/completions", "n", "8"),
    ("/v1/chat/completions", "n", 8.0),
    ("/v1/completions", "n", "1e2"),
    ("/v1/chat/completions", "max_tokens", "200"),
    ("/v1/chat/completions", "max_completion_tokens", 200.0),
    ("/v1/messages", "max_tokens", "200"),
    ("/v1/responses", "max_output_tokens", 200.0),
    ("/v1/responses", "stream", 1),
]
_BASE = {
    "/v1/chat/completions": {"model": MODEL, "messages": HI, "ignore_eos": True},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "ignore_eos": True},
    "/v1/messages": {"model": MODEL, "max_tokens": 8, "messages": HI},
    "/v1/responses": {"model": MODEL, "input": "hi", "ignore_eos": True},
}


@pytest.mark.parametrize(("path", "name", "value"), SPELLINGS, ids=[f"{p[4:]}-{f}-{v!r}" for p, f, v in SPELLINGS])
def test_a_coerced_spelling_is_refused_naming_its_field_and_vllm_runs_nothing(server, path, name, value):
    before, billed = vllm_counts(server.vllm), ledger(server.url, "capped")
    with httpx.stream("POST", server.url + path, json={**_BASE[path], name: value}, headers=_auth(CAPPED), timeout=300) as r:
        raw = r.read()
    assert r.status_code == 400, raw[:2000]
    error = json.loads(raw)["error"]
    message = error if isinstance(error, str) else error["message"]
    assert message.startswith(f"invalid {name}"), message
    assert vllm_counts(server.vllm)["sequences"] == before["sequences"]  # nothing reached vLLM
    charged(server.url, "capped", billed, (0, 0))  # and nothing charged


@pytest.mark.parametrize("stream", [False, True])
def test_a_body_without_a_model_is_served_by_the_default_and_charged_to_it(server, stream):
    """Before: the default model answered and the ledger saw nothing of it."""
    body: dict = {"messages": HI, "max_tokens": 5, "ignore_eos": True, "stream": stream}
    a = check_answer(server, "/v1/chat/completions", body, BOB, None)
    assert a.status == 200 and a.choices == 1, a.body
    rows = ledger_rows(server.url, "bob")
    assert [r["model"] for r in rows] == [MODEL] and rows[0]["output_tokens"] > 0, rows
