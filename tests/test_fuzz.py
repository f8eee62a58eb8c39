"""Property-based fuzzing of every endpoint's request body (and GET query strings) with hypothesis.

One real ``vllama serve`` process (the session ``proxy`` fixture) in front of the fake vLLM
takes valid bodies mutated every way a client can get them wrong: wrong types per field,
nulls, huge numbers (1e308, 2**70, -2**70, ``NaN``/``Infinity``/``1e400`` as raw JSON tokens),
huge strings, deep nesting (up to 10,000 levels, as raw bytes), invalid UTF-8, unknown
fields, duplicate keys, empty and non-object bodies, odd Content-Type / Content-Encoding.

The property, for every request: the answer is

- a 4xx whose body is Ollama's ``{"error": "<string>"}`` (``/v1/*``: OpenAI's ``{"error": {"message",
  "type", ...}}``, vllama's own or vLLM's passed through, or the ``{"detail": ...}`` of vLLM's web
  framework), or
- a 2xx that is valid: JSON parses; an NDJSON stream's lines all parse and either exactly one
  line has ``done: true`` (the last) or the last line is ``{"error": ...}``; an SSE stream
  ends with ``[DONE]`` or an error event;
- never a 5xx (exceptions by design: 501 from push/create/copy/delete/blobs, README "What it
  does"; a 5xx that vLLM itself answered on ``/v1/*``, recognisable by vLLM's error shape, is
  passed through and counted separately: the fuzz never asks for one on purpose, generated
  text never contains the fake's ``[[...]]`` markers), and never a dropped connection.

After the run the proxy process is alive and ``GET /`` answers 200.

Bounded for CI (about 3,600 cases, about 20 s on 2 cores), derandomized.
``VLLAMA_FUZZ_SCALE=10`` runs 10x the examples; ``VLLAMA_FUZZ_SEED=N`` random ones from seed N.
The summary line ``fuzz: N cases, ...`` is printed at the end of the module (``-s`` shows it)
and recorded as junit properties.

The regression tests at the top are the bugs the fuzz found, each as the exact request.
"""

from __future__ import annotations

import collections
import gzip
import http.client
import json
import math
import os
import time
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from conftest import ALIAS, SERVED, start_proxy, stop

# --------------------------------------------------------------------------- sending, checking

STATS: collections.Counter[str] = collections.Counter()
UPSTREAM_5XX: list[str] = []  # samples, printed with the summary
PER_TEST: dict[str, int] = {}  # cases per fuzz test

#: Endpoints that answer 501 by design (README: "push, create, copy, delete, blobs answer 501").
UNSUPPORTED = frozenset({"/api/push", "/api/create", "/api/copy", "/api/delete", "/api/blobs"})
NDJSON_DONE = frozenset({"/api/generate", "/api/chat"})


class Answer:
    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.ctype = (headers.get("Content-Type") or "").split(";")[0].strip().lower()

    def __repr__(self) -> str:
        return f"<{self.status} {self.ctype} {self.body[:400]!r}>"


def send(url: str, method: str, target: str, body: bytes | None, headers: dict[str, str] | None = None) -> Answer:
    """One request on a fresh connection (so a dropped connection can only be this request's)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()  # IncompleteRead here = the stream was cut
        return Answer(resp.status, resp.headers, data)
    finally:
        conn.close()


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise AssertionError(f"{what} is not JSON: {e}: {data[:300]!r}") from None


def _is_ollama_error(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("error"), str)


def check_ndjson(path: str, a: Answer) -> None:
    lines = [ln for ln in a.body.split(b"\n") if ln.strip()]
    assert lines, f"{path}: empty NDJSON stream {a!r}"
    objs = [_json(ln, f"{path} NDJSON line") for ln in lines]
    assert all(isinstance(o, dict) for o in objs), f"{path}: NDJSON line not an object: {a!r}"
    if _is_ollama_error(objs[-1]):
        assert not any(o.get("done") is True for o in objs), f"{path}: done:true before an error line: {a!r}"
        STATS["stream_error_line"] += 1
        return
    if path == "/api/pull":
        assert objs[-1].get("status") == "success", f"{path}: last line {objs[-1]!r}"
        return
    done = [i for i, o in enumerate(objs) if o.get("done") is True]
    assert done == [len(objs) - 1], f"{path}: done:true lines at {done} of {len(objs)} (want exactly the last): {a!r}"


def check_sse(path: str, a: Answer) -> None:
    events = [e for e in a.body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    assert events, f"{path}: empty SSE stream {a!r}"
    datas = []
    for ev in events:
        for ln in ev.split(b"\n"):
            if ln.startswith(b"data:"):
                datas.append(ln[5:].strip())
    assert datas, f"{path}: SSE without data lines {a!r}"
    for d in datas[:-1]:
        assert d != b"[DONE]", f"{path}: [DONE] before the end {a!r}"
        _json(d, f"{path} SSE event")
    if datas[-1] != b"[DONE]":
        last = _json(datas[-1], f"{path} last SSE event")
        assert isinstance(last, dict) and "error" in last, f"{path}: SSE ends without [DONE] or an error: {a!r}"
        STATS["stream_error_line"] += 1


def check(path: str, a: Answer) -> None:
    """The fuzz property for one answer; counts it in ``STATS``."""
    STATS["cases"] += 1
    v1 = path.startswith("/v1/")
    if 200 <= a.status < 300:
        STATS["2xx"] += 1
        if a.status == 204 and not a.body:  # a CORS preflight
            return
        if path in ("/api/copy", "/api/delete") and a.status == 200 and not a.body:  # Ollama answers these empty
            return
        if a.ctype == "application/x-ndjson":
            check_ndjson(path, a)
        elif a.ctype == "text/event-stream":
            check_sse(path, a)
        elif a.ctype == "application/json":
            obj = _json(a.body, f"{path} {a.status} body")
            if path in NDJSON_DONE:
                assert isinstance(obj, dict) and obj.get("done") is True, f"{path}: answer without done:true {a!r}"
        else:
            assert path in ("/", "/junk", "/v1/junk") or path.endswith("metrics"), f"{path}: unexpected 2xx content type {a!r}"
        return
    if 400 <= a.status < 500:
        STATS["4xx"] += 1
        obj = _json(a.body, f"{path} {a.status} body")
        if v1:  # vLLM's own error, passed through byte for byte, or vllama's for its own checks: OpenAI's shape both
            err = obj.get("error") if isinstance(obj, dict) else None
            assert (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
                    or isinstance(obj, dict) and "detail" in obj), f"{path}: {a!r}"
        else:
            assert _is_ollama_error(obj), f"{path}: 4xx without {{'error': str}}: {a!r}"
        return
    if a.status == 501 and path in UNSUPPORTED:
        STATS["501"] += 1
        assert _is_ollama_error(_json(a.body, f"{path} 501 body")), f"{path}: {a!r}"
        return
    if path == "/api/pull" and a.status == 501 and _is_ollama_error(_json(a.body, f"{path} 501 body")):
        # with --upstream a model that vLLM does not serve is refused before any download (issue 26.6)
        assert "cannot start models" in json.loads(a.body)["error"], a
        return
    if path == "/api/pull" and a.status == 503 and _is_ollama_error(_json(a.body, f"{path} 503 body")):
        # a well-formed hub id (org/name) is a real pull; tests run offline (HF_HUB_OFFLINE=1)
        assert "HF_HUB_OFFLINE" in json.loads(a.body)["error"] or "Hugging Face Hub" in json.loads(a.body)["error"], a
        return
    if v1 and a.status >= 500:
        try:
            obj = json.loads(a.body)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):  # vLLM's {"error": {...}}: the fake answered it
            STATS["upstream_5xx"] += 1
            UPSTREAM_5XX.append(f"{path}: {a!r}")
            return
    raise AssertionError(f"{path}: status {a.status} for client input: {a!r}")


def post(proxy, path: str, body: bytes | None, headers: dict[str, str] | None = None, method: str = "POST") -> Answer:
    h = {"Content-Type": "application/json"} if headers is None else headers
    a = send(proxy.url, method, path, body, h)
    check(path, a)
    return a


# --------------------------------------------------------------------------- regressions


def _deep_obj(n: int) -> str:
    return '{"a":' * n + "1" + "}" * n


#: Nesting between orjson's encoder limit (254) and its decoder limit (1024): parsed fine, then
#: re-encoding the upstream body raised ``TypeError: Recursion limit reached`` -> 500.
DEEP_FORWARDED = {
    "generate-format": ("/api/generate", '{"model":"%s","prompt":"hi","stream":false,"format":%s}' % (SERVED, _deep_obj(300))),
    "chat-tools": ("/api/chat", '{"model":"%s","stream":false,"messages":[{"role":"user","content":"hi"}],"tools":[%s]}' % (SERVED, _deep_obj(300))),
    "chat-tool-call-arguments": ("/api/chat", '{"model":"%s","stream":false,"messages":[{"role":"assistant","content":"",'
                                 '"tool_calls":[{"function":{"name":"f","arguments":%s}}]},{"role":"user","content":"hi"}]}' % (SERVED, _deep_obj(300))),
    "v1-alias-remap": ("/v1/chat/completions", '{"model":"%s","messages":[{"role":"user","content":"hi"}],"x":%s}' % (ALIAS, _deep_obj(300))),
}


@pytest.mark.parametrize("case", list(DEEP_FORWARDED))
def test_regression_deep_nesting_in_forwarded_fields_is_not_500(proxy, case):
    path, body = DEEP_FORWARDED[case]
    a = send(proxy.url, "POST", path, body.encode(), {"Content-Type": "application/json"})
    assert a.status < 500, a
    check(path, a)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("path", ["/api/generate", "/v1/completions"])
def test_regression_undecodable_content_encoding_is_400_not_500(proxy, encoding, path):
    # aiohttp decompresses request bodies itself; a body that is not valid gzip/deflate makes
    # request.read() raise aiohttp's RequestPayloadError, which reached the catch-all -> 500.
    a = send(proxy.url, "POST", path, b'{"model": "fake-model", "prompt": "hi"}',
             {"Content-Type": "application/json", "Content-Encoding": encoding})
    body = _json(a.body, "body")  # Ollama's shape on /api, OpenAI's on /v1
    ok = _is_ollama_error(body) if path.startswith("/api/") else body["error"]["type"] == "invalid_request_error"
    assert 400 <= a.status < 500 and ok, a


@pytest.mark.xfail(strict=True, reason="aiohttp's HTTP parser answers these itself, before any middleware: "
                   "400 text/plain, not Ollama's JSON error (a 4xx, never a 5xx)")
@pytest.mark.parametrize("target,headers", [
    ("/api/generate", {"Content-Encoding": "br"}),
    ("/api/generate", {"Content-Encoding": "zstd"}),
    ("/api/generate", {"Content-Type": "\x7f"}),  # a control character in a header value
    ("/api/tags?" + "a=1&" * 2100, {}),  # request line over aiohttp's 8190-byte limit
], ids=["br", "zstd", "ctl-in-header", "long-request-line"])
def test_protocol_level_4xx_are_not_json(proxy, target, headers):
    body = b'{"model": "fake-model"}' if target.startswith("/api/generate") else None
    a = send(proxy.url, "POST" if body else "GET", target, body, headers)
    assert 400 <= a.status < 500, a
    assert _is_ollama_error(_json(a.body, "body")), a


def test_unknown_expect_is_json_417(proxy):
    a = send(proxy.url, "GET", "/api/tags", None, {"Expect": "0"})
    assert a.status == 417 and _is_ollama_error(_json(a.body, "body")), a


@pytest.mark.parametrize("path", ["/api/tags", "/v1/models", "/api/generate"])
def test_regression_non_utf8_expect_header_is_not_500(proxy, path):
    # aiohttp's default expect handler (run by Application._handle before the middlewares)
    # raises HTTPExpectationFailed(text="Unknown Expect: " + value); a value with a byte that
    # is not UTF-8 (decoded with surrogateescape) cannot be encoded -> UnicodeEncodeError ->
    # aiohttp's own "500 Internal Server Error / Server got itself in trouble" (text/plain).
    a = send(proxy.url, "GET", path, None, {"Expect": "\x80"})
    assert a.status < 500, a


@pytest.mark.parametrize("request_id", ["\x80", "caf\xe9", "\xff\xfe"])
@pytest.mark.parametrize("path", ["/", "/api/tags", "/api/version"])
def test_regression_non_utf8_request_id_header_is_not_500(proxy, path, request_id):
    # The X-Request-ID value (aiohttp: UTF-8 with surrogateescape) is bound as the log's
    # request_id; the JSON log renderer (orjson) refuses surrogates, so the access-log line
    # raises TypeError, log.exception("unhandled_error") raises again, and the exception
    # leaves the middleware: aiohttp's own 500 text/plain, on every route.
    a = send(proxy.url, "GET", path, None, {"X-Request-ID": request_id})
    assert a.status == 200, a


@pytest.mark.parametrize("target", ["/v1/../_fake/stats", "/v1/%2e%2e/_fake/stats", "/v1/%2E%2E/version", "/v1/models/../../health"])
def test_regression_v1_passthrough_stays_under_v1(proxy, target):
    # /v1/{tail} forwarded "/v1/" + tail; a tail with ".." (raw or %2e%2e, decoded by the
    # router) is normalised away by the client URL, so any upstream path was reachable
    # (vLLM's /health, /metrics, /tokenize, dev-mode /sleep, /reset_prefix_cache ...).
    a = send(proxy.url, "GET", target, None)
    assert a.status in (400, 404), a


@pytest.fixture(scope="module")
def proxy(fake):
    # The fuzz's own proxy (and alias store): fuzzed /api/copy calls make aliases that other tests must not see.
    s = start_proxy(fake.url)
    yield s
    stop(s.proc)


@pytest.fixture(scope="module")
def keyed_proxy(fake):
    s = start_proxy(fake.url, "--api-key", "secret")
    yield s
    stop(s.proc)


@pytest.mark.parametrize("auth", ["Bearer \xff\xfe", "Bearer s\xe9cret", "bearer \x80"])
def test_regression_non_utf8_bearer_token_is_401_not_500(keyed_proxy, auth):
    # aiohttp decodes header bytes as UTF-8 with surrogateescape; the API-key check did
    # token.encode() on it -> UnicodeEncodeError -> 500 (access.py, api_keys middleware).
    a = send(keyed_proxy.url, "GET", "/api/tags", None, {"Authorization": auth})
    assert a.status == 401 and _is_ollama_error(_json(a.body, "body")), a
    assert send(keyed_proxy.url, "GET", "/api/tags", None, {"Authorization": "Bearer secret"}).status == 200


def test_good_gzip_body_is_decoded(proxy):
    body = gzip.compress(b'{"model": "fake-model", "prompt": "hi", "stream": false}')
    a = post(proxy, "/api/generate", body, {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert a.status == 200, a


# --------------------------------------------------------------------------- encoding bodies


class Raw(str):
    """JSON text emitted as is (``NaN``, ``1e400``, 10,000 nested lists...)."""


#: Placeholders in generated text, replaced by invalid UTF-8 bytes after encoding.
INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"]
_BAD = "\ue000{}\ue001"


def encode(value: Any, ascii_only: bool = False) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, Dup):
        return "{" + ",".join(json.dumps(k) + ":" + encode(v, ascii_only) for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k), ensure_ascii=ascii_only) + ":" + encode(v, ascii_only) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(encode(v, ascii_only) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return json.dumps(value, ensure_ascii=ascii_only)


def to_bytes(value: Any, ascii_only: bool = False) -> bytes:
    out = encode(value, ascii_only).encode("utf-8")
    for i, bad in enumerate(INVALID_UTF8):
        out = out.replace(_BAD.format(i).encode("utf-8"), bad)
    return out


class Dup:
    """An object with duplicate keys, in order."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs

    def __repr__(self) -> str:
        return f"Dup({self.pairs!r})"


# --------------------------------------------------------------------------- strategies

#: No "[": the fake's fault/tool/token markers are ``[[...]]``; generated text never asks for them.
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="["), max_size=30)
SHORT = st.text(st.characters(codec="utf-8", exclude_characters="["), max_size=8)
MODELS = st.sampled_from([SERVED, SERVED, ALIAS, SERVED + ":latest", SERVED.upper(), "llama3:8b", "", " ", "fake-model\x00"])


@st.composite
def huge_strings(draw) -> str:
    unit = draw(st.sampled_from(["x", "word ", "é", "\u2028", "\x00", "\U0001f600", "\\", '"']))
    n = draw(st.sampled_from([5_000, 50_000, 600_000]))
    return unit * max(1, n // len(unit))


def deep_raw(kind: str, depth: int) -> Raw:
    return Raw(("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "0" + "}" * depth))


DEEP = st.builds(deep_raw, st.sampled_from(["list", "dict"]), st.sampled_from([20, 200, 253, 300, 1000, 1023, 1025, 10_000]))
RAW_TOKENS = st.sampled_from([
    "NaN", "-NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e308", "-1e308", "5e-324", "1e-400",
    str(2**70), str(-(2**70)), str(2**64), str(2**64 - 1), str(-(2**63) - 1), "-0", "0.0", "1E+2", "01", "+1", ".5", "1.",
    "0x10", "true", "null", '"\\ud800"', '"\\udc00"', '"\\u0000"', "tru", "[1,]", "{,}", "'x'",
]).map(Raw)
INVALID = st.integers(0, len(INVALID_UTF8) - 1).map(lambda i: "a" + _BAD.format(i) + "b")
NUMBERS = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, 2, 20, 21, 4096, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63), -(2**70)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324, 0.5, -0.0, 1.5, 2.0, float("nan"), float("inf"), float("-inf")]),
)
WORDS = st.sampled_from(["", "json", "low", "medium", "high", "5m", "-1", "0", "-1m", "1h30m", "10ms", "nan", "inf",
                         "1e999", "\x00", "user", "assistant", "tool", "system", "fake-model", "true", "null", "{}"])
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT, WORDS, RAW_TOKENS, INVALID)
KEYS = st.one_of(SHORT, st.sampled_from(["model", "prompt", "messages", "options", "stream", "__proto__", "", "\x00", "é"]))
NASTY = st.one_of(
    SCALARS,
    st.recursive(SCALARS, lambda ch: st.one_of(st.lists(ch, max_size=3), st.dictionaries(KEYS, ch, max_size=3)), max_leaves=8),
    huge_strings(),
    DEEP,
)

B64_IMAGES = st.sampled_from(["iVBORw0KGgo=", "/9j/4AAQSkZJRg==", "R0lGODlhAQABAAAAACw=", "UklGRhYAAABXRUJQ", "", "not base64!", "data:image/png;base64,iVBO"])
OPTIONS = st.fixed_dictionaries({}, optional={
    "num_predict": st.integers(-2, 32), "temperature": st.floats(0, 2), "top_k": st.integers(-1, 100),
    "top_p": st.floats(0, 1), "min_p": st.floats(0, 1), "seed": st.integers(-1, 2**32), "stop": st.one_of(SHORT, st.lists(SHORT, max_size=3)),
    "repeat_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "num_ctx": st.integers(1, 8192), "mirostat": st.integers(0, 2), "num_gpu": st.integers(-1, 99), "min_tokens": st.integers(0, 8),
    "typical_p": st.floats(0, 1), "repeat_last_n": st.integers(-1, 64), "use_mmap": st.booleans(),
})
OPTION_KEYS = ["num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty", "presence_penalty",
               "frequency_penalty", "num_ctx", "mirostat", "ignore_eos", "min_tokens", "typical_p", "use_mmap", "numa"]
FORMAT = st.sampled_from(["json", "", {"type": "object", "properties": {"a": {"type": "string"}}}])
THINK = st.sampled_from([True, False, "low", "medium", "high"])
KEEP_ALIVE = st.sampled_from(["5m", 0, -1, "1h30m", 300, "0", "-1s", 1.5])
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "w",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_CALL = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "system", "assistant", "tool"]), "content": TEXT},
    optional={"images": st.lists(B64_IMAGES, max_size=2), "tool_calls": st.just([TOOL_CALL]), "tool_name": st.just("get_weather"),
              "tool_call_id": st.sampled_from(["call_0", "x"]), "thinking": SHORT},
)

#: Per endpoint: (method, the valid-body strategy, the field paths mutations pick from).
ENDPOINTS: dict[str, tuple[str, st.SearchStrategy, list[str]]] = {
    "/api/generate": ("POST", st.fixed_dictionaries({"model": MODELS, "prompt": TEXT}, optional={
        "stream": st.booleans(), "raw": st.booleans(), "system": TEXT, "options": OPTIONS, "format": FORMAT, "think": THINK,
        "keep_alive": KEEP_ALIVE, "images": st.lists(B64_IMAGES, max_size=2), "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20), "truncate": st.booleans(), "context": st.lists(st.integers(0, 1000), max_size=3),
        "suffix": st.sampled_from(["", "x"]), "template": st.sampled_from(["", "{{ .Prompt }}"]),
    }), ["model", "prompt", "stream", "raw", "system", "options", "format", "think", "keep_alive", "images", "images.0",
         "logprobs", "top_logprobs", "truncate", "context", "suffix", "template", "shift", "_debug_render_only"]
        + [f"options.{k}" for k in OPTION_KEYS]),
    "/api/chat": ("POST", st.fixed_dictionaries({"model": MODELS, "messages": st.lists(MESSAGE, max_size=3)}, optional={
        "stream": st.booleans(), "tools": st.just([TOOL]), "format": FORMAT, "options": OPTIONS, "think": THINK,
        "keep_alive": KEEP_ALIVE, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
    }), ["model", "messages", "messages.0", "messages.0.role", "messages.0.content", "messages.0.images", "messages.0.images.0",
         "messages.0.tool_calls", "messages.0.tool_calls.0", "messages.0.tool_calls.0.function",
         "messages.0.tool_calls.0.function.name", "messages.0.tool_calls.0.function.arguments", "messages.0.tool_name",
         "messages.0.tool_call_id", "messages.1.content", "tools", "tools.0", "tools.0.function", "format", "options",
         "stream", "think", "keep_alive", "logprobs", "top_logprobs"] + [f"options.{k}" for k in OPTION_KEYS]),
    "/api/embed": ("POST", st.fixed_dictionaries({"model": MODELS, "input": st.one_of(TEXT, st.lists(TEXT, max_size=3))}, optional={
        "truncate": st.booleans(), "dimensions": st.integers(1, 16), "keep_alive": KEEP_ALIVE, "options": OPTIONS,
    }), ["model", "input", "input.0", "truncate", "dimensions", "keep_alive", "options", "options.num_ctx"]),
    "/api/embeddings": ("POST", st.fixed_dictionaries({"model": MODELS, "prompt": TEXT}, optional={"keep_alive": KEEP_ALIVE, "options": OPTIONS}),
                        ["model", "prompt", "keep_alive", "options", "options.temperature"]),
    "/api/show": ("POST", st.one_of(st.fixed_dictionaries({"model": MODELS}, optional={"verbose": st.booleans()}),
                                    st.fixed_dictionaries({"name": MODELS})), ["model", "name", "verbose"]),
    "/api/pull": ("POST", st.fixed_dictionaries({"model": MODELS}, optional={"stream": st.booleans(), "insecure": st.booleans()}),
                  ["model", "name", "stream", "insecure"]),
    "/api/copy": ("POST", st.fixed_dictionaries({"source": MODELS, "destination": SHORT}), ["source", "destination"]),
    "/api/push": ("POST", st.fixed_dictionaries({"model": MODELS}, optional={"stream": st.booleans()}), ["model", "name", "stream"]),
    "/api/create": ("POST", st.fixed_dictionaries({"model": SHORT}, optional={"from": MODELS, "system": TEXT, "files": st.just({"a.gguf": "sha256:00"})}),
                    ["model", "from", "files", "modelfile", "quantize"]),
    "/api/delete": ("DELETE", st.fixed_dictionaries({"model": MODELS}), ["model", "name"]),
    "/v1/chat/completions": ("POST", st.fixed_dictionaries(
        {"model": MODELS, "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}), min_size=1, max_size=2)},
        optional={"stream": st.booleans(), "max_tokens": st.integers(1, 16), "temperature": st.floats(0, 2),
                  "stream_options": st.just({"include_usage": True}), "tools": st.just([TOOL])}),
        ["model", "messages", "messages.0", "messages.0.content", "messages.0.role", "stream", "max_tokens", "temperature",
         "stream_options", "tools", "n", "logprobs", "response_format", "chat_template_kwargs", "stop"]),
    "/v1/completions": ("POST", st.fixed_dictionaries({"model": MODELS, "prompt": TEXT}, optional={
        "stream": st.booleans(), "max_tokens": st.integers(1, 16), "temperature": st.floats(0, 2),
        "stream_options": st.just({"include_usage": True})}),
        ["model", "prompt", "stream", "max_tokens", "temperature", "stream_options", "echo", "logprobs", "stop", "suffix"]),
}


def _set(body: Any, path: str, value: Any, delete: bool = False) -> None:
    """Set (or delete) ``a.b.0.c`` in ``body``, creating dicts on the way when missing."""
    *parents, last = path.split(".")
    node = body
    for p in parents:
        if isinstance(node, list):
            if not p.isdigit() or int(p) >= len(node):
                return
            node = node[int(p)]
        elif isinstance(node, dict):
            if not isinstance(node.get(p), (dict, list)):
                node[p] = {}
            node = node[p]
        else:
            return
    if isinstance(node, dict):
        if delete:
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        if delete:
            del node[int(last)]
        else:
            node[int(last)] = value


@st.composite
def mutated_bodies(draw, endpoints: list[str]) -> tuple[str, str, bytes, dict[str, str]]:
    """``(path, method, body bytes, headers)``: a valid body with 0-3 mutations."""
    path = draw(st.sampled_from(endpoints))
    method, base, fields = ENDPOINTS[path]
    body = draw(base)
    dups: list[tuple[bool, str, Any]] = []
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["set", "set", "set", "delete", "unknown", "dup"]))
        if op == "set":
            _set(body, draw(st.sampled_from(fields)), draw(NASTY))
        elif op == "delete":
            _set(body, draw(st.sampled_from(fields)), None, delete=True)
        elif op == "unknown":
            body[draw(KEYS)] = draw(NASTY)
        else:  # a duplicate top-level key, before or after the real one
            dups.append((draw(st.booleans()), draw(st.sampled_from(fields)).split(".")[0], draw(NASTY)))
    if dups:
        pairs = list(body.items())
        body = Dup([(k, v) for first, k, v in dups if first] + pairs + [(k, v) for first, k, v in dups if not first])
    ctype = draw(st.sampled_from(["application/json"] * 6 + [None, "text/plain", "application/json; charset=latin-1",
                                                              "application/x-www-form-urlencoded", "multipart/form-data"]))
    headers = {} if ctype is None else {"Content-Type": ctype}
    return path, method, to_bytes(body, ascii_only=draw(st.booleans())), headers


def _good_body(path: str) -> bytes:
    if path in ("/api/chat", "/v1/chat/completions"):
        return json.dumps({"model": SERVED, "stream": False, "messages": [{"role": "user", "content": "hi"}]}).encode()
    if path == "/api/copy":
        return json.dumps({"source": SERVED, "destination": "x"}).encode()
    return json.dumps({"model": SERVED, "prompt": "hi", "input": "hi", "stream": False}).encode()


@st.composite
def raw_bodies(draw) -> tuple[str, str, bytes, dict[str, str]]:
    """Whole bodies that are not a well-formed object, or are but with odd encodings."""
    path = draw(st.sampled_from(list(ENDPOINTS)))
    method = ENDPOINTS[path][0]
    good = _good_body(path)
    kind = draw(st.sampled_from(["fixed", "fixed", "binary", "deep", "token", "truncated", "wrapped", "encoding"]))
    headers = {"Content-Type": "application/json"}
    if kind == "fixed":
        body = draw(st.sampled_from([
            b"", b" ", b"\n\t ", b"null", b"[]", b"{}", b"1", b"-1e400", b'"x"', b"true", b"NaN", b"Infinity", b"{", b"}",
            b'{"model":', b'{"model":"fake-model"', b'{"model":"fake-model"}}', b'{"model":"fake-model"} trailing',
            b'{"model":"fake-model"}\n{"model":"fake-model"}', b"\x00" * 10, b"\xff\xfe", b"\xef\xbb\xbf" + good,
            good.decode().encode("utf-16"), good.decode().encode("utf-32"), good.replace(b'"hi"', b'"\xff\xfe"'),
            good.replace(b'"hi"', b'"\xed\xa0\x80"'), good.replace(b"hi", b"\\ud800"), good.replace(b'"model"', b'"mod\xc0\x80el"'),
            b'{"model":"fake-model","model":null}', b'{"model":null,"model":"fake-model","prompt":"hi","stream":false}',
            b'{"model":"fake-model","prompt":"hi","stream":false,"stream":"yes"}', b"{'model': 'fake-model'}",
            b'{"model":"fake-model",}', b"[" + good + b"]", good.replace(b":", b" : ").replace(b",", b" ,\n"),
        ]))
    elif kind == "binary":
        body = draw(st.binary(max_size=64))
    elif kind == "deep":
        body = to_bytes(draw(DEEP))
        if draw(st.booleans()):  # as a field's value instead of the whole body
            body = good[:-1] + b',"' + draw(st.sampled_from([b"x", b"options", b"messages", b"format", b"model"])) + b'":' + body + b"}"
    elif kind == "token":
        tok = draw(RAW_TOKENS)
        key = draw(st.sampled_from([b"model", b"prompt", b"stream", b"x", b"options", b"keep_alive", b"max_tokens"]))
        body = good[:-1] + b',"' + key + b'":' + tok.encode() + b"}"
    elif kind == "truncated":
        body = good[: draw(st.integers(0, len(good) - 1))]
    elif kind == "wrapped":
        tmpl = draw(st.sampled_from([b"[%s]", b'{"body":%s}', b'"%s"', b"%s%s", b" \n%s\n "]))
        body = tmpl.replace(b"%s", good)
    else:  # Content-Encoding: decodable (gzip/deflate of the good body) or a lie about it
        enc = draw(st.sampled_from(["gzip", "deflate", "identity", "gzip, identity", "x-unknown"]))
        headers["Content-Encoding"] = enc
        honest = draw(st.booleans())
        if honest and enc == "gzip":
            body = gzip.compress(good)
        elif honest and enc == "deflate":
            body = zlib.compress(good)
        else:
            body = draw(st.sampled_from([good, b"not compressed", b"", b"\x1f\x8b\x08\x00garbage"]))
    if draw(st.booleans()) and kind != "encoding":
        headers = draw(st.sampled_from([{}, {"Content-Type": "text/plain"}, {"Content-Type": "application/json; charset=utf-16"}]))
    return path, method, body, headers


QUERY_PARTS = st.one_of(
    st.text(st.characters(codec="ascii", min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#"), max_size=20),
    st.sampled_from(["%zz", "%", "%f", "%ff", "%00", "%C0%80", "%ED%A0%80", "%FF%FE", "&&", "==", "a=1&a=2", ";", "+", "%20", "%0D%0A",
                     "name=fake-model", "model=%00", "stream=true", "x=" + "y" * 2000]),
)
GET_PATHS = ["/", "/api/version", "/api/tags", "/api/ps", "/livez", "/readyz", "/v1/models", "/metrics"]
#: Odd path segments (percent-escapes, dot segments: "..": see the /v1 regression test above).
SEGMENTS = st.sampled_from(["%ff", "%00", "%2e", ".", "", "%2F", "%5C", "tags", "models", "x" * 300, "%C0%AE", "%C3%A9", "%ED%A0%80",
                            ";x", "a%20b", "~", "%25", "sha256:" + "0" * 64, "%3F"])


# --------------------------------------------------------------------------- running

SCALE = float(os.environ.get("VLLAMA_FUZZ_SCALE", "1") or 1)
SEED = os.environ.get("VLLAMA_FUZZ_SEED")


def run(strategy: st.SearchStrategy, examples: int, do) -> None:
    """Run ``do(case)`` for ``examples`` (x VLLAMA_FUZZ_SCALE) hypothesis cases; count them per test."""
    before = STATS["cases"]
    cfg = settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=SEED is None,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )

    @cfg
    @given(strategy)
    def inner(case):
        do(case)

    if SEED is not None:
        inner = seed(int(SEED))(inner)
    try:
        inner()
    finally:
        PER_TEST[os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]] = STATS["cases"] - before


@pytest.fixture(scope="module", autouse=True)
def fuzz_summary(record_testsuite_property):
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    line = (f"fuzz: {STATS['cases']} cases, {STATS['2xx']} 2xx, {STATS['4xx']} 4xx, {STATS['501']} 501 (by design), "
            f"{STATS['upstream_5xx']} upstream 5xx passed through, {STATS['stream_error_line']} streams ending in an error line; "
            f"{took:.1f} s")
    print("\n" + line)
    for sample in UPSTREAM_5XX[:5]:
        print("  upstream 5xx:", sample)
    for k in ("cases", "2xx", "4xx", "501", "upstream_5xx"):
        record_testsuite_property(f"fuzz_{k}", STATS[k])
    for name, n in PER_TEST.items():
        record_testsuite_property(f"fuzz_cases.{name}", n)


def _send_case(proxy, case) -> None:
    path, method, body, headers = case
    check(path, send(proxy.url, method, path, body, headers))


def test_fuzz_generate(proxy):
    run(mutated_bodies(["/api/generate"]), 600, lambda c: _send_case(proxy, c))


def test_fuzz_chat(proxy):
    run(mutated_bodies(["/api/chat"]), 600, lambda c: _send_case(proxy, c))


def test_fuzz_embed(proxy):
    run(mutated_bodies(["/api/embed", "/api/embeddings"]), 250, lambda c: _send_case(proxy, c))


def test_fuzz_model_routes(proxy):
    routes = ["/api/show", "/api/pull", "/api/copy", "/api/push", "/api/create", "/api/delete"]
    run(mutated_bodies(routes), 300, lambda c: _send_case(proxy, c))


def test_fuzz_openai_passthrough(proxy):
    run(mutated_bodies(["/v1/chat/completions", "/v1/completions"]), 500, lambda c: _send_case(proxy, c))


def test_fuzz_raw_bodies(proxy):
    run(raw_bodies(), 500, lambda c: _send_case(proxy, c))


def test_fuzz_get_query_strings(proxy):
    def do(case):
        path, parts = case
        a = send(proxy.url, "GET", path + "?" + "&".join(parts), None)
        check(path, a)
        assert a.status == 200 or path == "/metrics", (path, parts, a)

    run(st.tuples(st.sampled_from(GET_PATHS), st.lists(QUERY_PARTS, max_size=5)), 250, do)


def test_fuzz_odd_paths(proxy):
    def do(case):
        method, prefix, segments = case
        target = prefix + "/".join(segments)
        a = send(proxy.url, method, target, b"{}" if method == "POST" else None, {"Content-Type": "application/json"})
        label = "/v1/junk" if prefix.startswith("/v1/") else ("/api/blobs" if prefix == "/api/blobs/" else "/junk")
        check(label, a)

    run(st.tuples(st.sampled_from(["GET", "POST", "DELETE"]), st.sampled_from(["/api/", "/v1/", "/", "/api/blobs/", "/v1/models/"]),
                  st.lists(SEGMENTS, min_size=1, max_size=3)), 200, do)


#: Header values a client library can send: latin-1 without control characters (those are
#: refused by aiohttp's parser before the app, see test_protocol_level_4xx_are_not_json).
HEADER_VALUE = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40),
    st.sampled_from(["", " ", "127.0.0.1", "localhost", "[::1]", "[::1", "[", "evil.example", "0.0.0.0:0", "10.0.0.1:x",
                     "http://localhost:3000", "null", "file://", "Bearer ", "Bearer x", "gzip, br", "*/*", "\xff\xfe"]),
)
#: Not ``Expect``: aiohttp answers any value but 100-continue itself (regression tests above).
HEADER_NAMES = ["Host", "Origin", "X-Request-ID", "Authorization", "Accept", "User-Agent", "Accept-Encoding",
                "Access-Control-Request-Method", "Content-Type", "Connection", "Cookie", "X-Forwarded-For"]


def test_fuzz_headers(proxy):
    def do(case):
        method, path, headers = case
        body = json.dumps({"model": SERVED, "prompt": "hi", "stream": False}).encode() if method == "POST" else None
        a = send(proxy.url, method, path, body, headers)
        check(path, a)
        if a.status == 403:
            assert "Host" in headers or "Origin" in headers, (headers, a)

    run(st.tuples(st.sampled_from(["GET", "POST", "OPTIONS"]), st.sampled_from(["/api/generate", "/api/tags", "/v1/models", "/"]),
                  st.dictionaries(st.sampled_from(HEADER_NAMES), HEADER_VALUE, max_size=3)),
        400, do)


def test_proxy_survived_the_fuzz(proxy, fake):
    assert proxy.proc.poll() is None, f"the proxy exited with {proxy.proc.returncode}"
    a = send(proxy.url, "GET", "/", None)
    assert a.status == 200 and a.body == b"Ollama is running", a
    a = send(proxy.url, "POST", "/api/generate", json.dumps({"model": SERVED, "prompt": "still there?", "stream": False}).encode())
    assert a.status == 200 and json.loads(a.body)["done"] is True, a
    assert fake.proc.poll() is None
