#!/usr/bin/env python3
"""Record what real vLLM sends: raw bytes of a fixed set of requests, as test fixtures (issue 13).

Usage: python3 benchmarks/tool_model/record.py --url http://127.0.0.1:8100 --model NAME
           [--embed-url URL --embed-model NAME] [--out tests/fixtures/vllm-0.26]

Talks to vLLM directly (not through vllama), with the stdlib's http.client only. Each case is
one file ``OUT/<name>.json``::

    {"name", "note", "vllm_version", "request": {"method", "path", "body"},
     "status", "headers": {lower-case name: value}, "body": "<the response body, verbatim>"}

``body`` is the exact byte stream decoded as UTF-8 (SSE streams included, event by event as
vLLM wrote them); nothing is normalised here: ids and timestamps are stripped only when tests
compare. Cases named ``ollama_*`` carry the very body vllama's ``translate`` makes of an Ollama
``/api/chat`` request (``ollama_request`` holds that request), so that the replaying stand-in
(tests/vllm_replay.py) answers vllama with these bytes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
import corpus  # noqa: E402

KEEP_HEADERS = ("content-type", "content-length", "transfer-encoding", "x-request-id")
WEATHER, ADD = corpus.tool("get_weather"), corpus.tool("add")
TOOLS = [WEATHER, ADD, corpus.tool("get_time")]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USAGE = {"stream_options": {"include_usage": True}}
GREEDY = {"temperature": 0}
OLLAMA_OPTIONS = {"temperature": 0, "num_predict": 160}  # the options of every ollama_* case (bounded: a grammar can loop)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def tool_round_trip() -> list[dict[str, Any]]:
    """Ollama messages: the question, the model's call, the tool's answer."""
    return [{"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_name": "get_weather", "content": json.dumps({"city": "Paris", "temperature": 21, "condition": "sunny"})}]


# (name, path, OpenAI body without model, note) sent as they are
OPENAI_CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("chat_plain", "/v1/chat/completions", {"messages": _user("Hello!"), **NO_THINK, **GREEDY}, "no tools, thinking off"),
    ("chat_plain_stream", "/v1/chat/completions", {"messages": _user("Hello!"), "stream": True, **USAGE, **NO_THINK, **GREEDY}, ""),
    ("chat_think", "/v1/chat/completions", {"messages": _user("What is the capital of France?"), **GREEDY},
     "enable_thinking unset: the qwen3 reasoning parser starts in reasoning"),
    ("chat_think_stream", "/v1/chat/completions",
     {"messages": _user("What is the capital of France?"), "stream": True, **USAGE, "chat_template_kwargs": {"enable_thinking": True}, **GREEDY}, ""),
    ("chat_tool", "/v1/chat/completions", {"messages": _user("What's the weather in Paris?"), "tools": TOOLS, **NO_THINK, **GREEDY},
     "hermes: one call"),
    ("chat_tool_stream", "/v1/chat/completions",
     {"messages": _user("What's the weather in Tokyo?"), "tools": TOOLS, "stream": True, **USAGE, **NO_THINK, **GREEDY}, ""),
    ("chat_tool_think_stream", "/v1/chat/completions",
     {"messages": _user("What is 12 plus 30?"), "tools": TOOLS, "stream": True, **USAGE, **GREEDY}, "reasoning, then a call"),
    ("chat_tool2_stream", "/v1/chat/completions",
     {"messages": _user("What's the weather in Paris and in Tokyo?"), "tools": TOOLS, "stream": True, **USAGE, **NO_THINK, **GREEDY},
     "two calls in one turn"),
    ("chat_tool_required", "/v1/chat/completions",
     {"messages": _user("What's the weather in Oslo?"), "tools": TOOLS, "tool_choice": "required", "max_tokens": 96, **NO_THINK, **GREEDY},
     "tool_choice required: structured output, not the hermes parser"),
    ("chat_json", "/v1/chat/completions",
     {"messages": _user("Extract the name and age as JSON: Alice is 31 years old."), "response_format": {"type": "json_object"},
      "max_tokens": 96, **NO_THINK, **GREEDY}, ""),
    ("chat_schema_stream", "/v1/chat/completions",
     {"messages": _user("Extract the name and age as JSON: Bob is 42 years old."), "stream": True, **USAGE,
      "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}, "max_tokens": 96, **NO_THINK, **GREEDY}, ""),
    ("completion", "/v1/completions", {"prompt": "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
                                       "max_tokens": 16, **GREEDY}, ""),
    ("completion_stream", "/v1/completions",
     {"prompt": "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", "max_tokens": 16, "stream": True,
      **USAGE, **GREEDY}, ""),
    ("completion_length", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, **GREEDY}, "finish_reason length"),
    ("error_prompt_too_long", "/v1/chat/completions", {"messages": _user("hello " * 5000), **GREEDY}, ""),
    ("error_prompt_too_long_stream", "/v1/chat/completions", {"messages": _user("hello " * 5000), "stream": True, **GREEDY}, ""),
    ("error_max_tokens_too_large", "/v1/completions", {"prompt": "Hello", "max_tokens": 10_000_000}, ""),
    ("error_bad_schema", "/v1/chat/completions",
     {"messages": _user("JSON please"), "response_format": {"type": "json_schema", "json_schema": {
         "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}, "max_tokens": 32, **NO_THINK}, ""),
    ("error_bad_schema_stream", "/v1/chat/completions",
     {"messages": _user("JSON please"), "stream": True, "response_format": {"type": "json_schema", "json_schema": {
         "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}, "max_tokens": 32, **NO_THINK}, ""),
    ("error_unknown_model", "/v1/chat/completions", {"model": "no-such-model", "messages": _user("Hi")}, ""),
    ("error_unknown_model_stream", "/v1/chat/completions", {"model": "no-such-model", "messages": _user("Hi"), "stream": True}, ""),
    ("error_bad_request", "/v1/chat/completions", {"messages": "not a list"}, "a pydantic validation error"),
]

# (name, Ollama /api/chat request without model, note): sent as vllama's translate makes them
OLLAMA_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("ollama_tool", {"messages": _user("What's the weather in Lisbon?"), "tools": TOOLS, "think": False}, "tool call, thinking off"),
    ("ollama_tool_think", {"messages": _user("What is 250 plus 17?"), "tools": TOOLS, "think": True}, "thinking, then a call"),
    ("ollama_tool_default", {"messages": _user("What time is it in Asia/Tokyo?"), "tools": TOOLS}, "think unset"),
    ("ollama_tool2", {"messages": _user("What's the weather in Berlin and in Rome?"), "tools": TOOLS, "think": False}, "two calls"),
    ("ollama_tool_result", {"messages": tool_round_trip(), "tools": TOOLS, "think": False}, "the answer after a tool result"),
    ("ollama_think", {"messages": _user("What is the capital of Japan?"), "think": True}, ""),
    ("ollama_nothink", {"messages": _user("What is the capital of Japan?"), "think": False}, ""),
    ("ollama_json", {"messages": _user("Extract the name and age as JSON: Carol is 27 years old."), "format": "json", "think": False}, ""),
    ("ollama_schema", {"messages": _user("Extract the name and age as JSON: Dave is 58 years old."), "format": SCHEMA, "think": False}, ""),
]

EMBED_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("embed_one", {"input": "Hello world"}, ""),
    ("embed_batch", {"input": ["Hello world", "What's the weather in Paris?"]}, ""),
    ("embed_base64", {"input": "Hello world", "encoding_format": "base64"}, ""),
    ("embed_error_unknown_model", {"model": "no-such-model", "input": "Hello"}, ""),
    ("embed_error_too_long", {"input": "hello " * 5000}, ""),
]


def ollama_body(req: dict[str, Any], served: str) -> dict[str, Any]:
    """The /v1/chat/completions body vllama sends for an Ollama /api/chat request."""
    from vllama_proxy.api.ollama.types import ChatRequest
    from vllama_proxy.api.ollama.to_openai import chat_body

    body, _ = chat_body(ChatRequest.model_validate({"model": served, **req, "options": OLLAMA_OPTIONS}), served)
    return body


def send(url: str, method: str, path: str, body: Any, timeout: float = 120) -> dict[str, Any]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "*/*"} if data is not None else {}
    t0 = time.perf_counter()
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    raw = resp.read()  # http.client undoes chunked transfer-encoding: the body as the server wrote it
    conn.close()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # never expected; kept losslessly anyway
        text = raw.decode("latin-1")
    return {"status": resp.status, "headers": {k.lower(): v for k, v in resp.getheaders() if k.lower() in KEEP_HEADERS},
            "body": text, "wall_s": round(time.perf_counter() - t0, 3)}


def record(out: Path, name: str, url: str, path: str, body: dict[str, Any], note: str, version: str,
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    r = send(url, "POST", path, body)
    doc = {"name": name, "note": note, "vllm_version": version, **(extra or {}),
           "request": {"method": "POST", "path": path, "body": body}, "status": r["status"], "headers": r["headers"],
           "body": r["body"]}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"{r['status']} {r['wall_s'] * 1000:8.1f} ms  {name:32s} {r['body'][:160]!r}", flush=True)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="vLLM serving the tool model (generation runner)")
    ap.add_argument("--model", required=True, help="its served model name")
    ap.add_argument("--embed-url", help="vLLM serving a pooling model (--runner pooling)")
    ap.add_argument("--embed-model")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "vllm-0.26")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    version = json.loads(send(a.url, "GET", "/version", None)["body"]).get("version", "?")
    models = send(a.url, "GET", "/v1/models", None)
    print(f"vLLM {version} at {a.url}; models {models['body'][:200]}", flush=True)
    bad = 0
    for name, path, body, note in OPENAI_CASES:
        doc = record(a.out, name, a.url, path, {"model": a.model, **body}, note, version)
        bad += (doc["status"] >= 400) != name.startswith("error_")
    for name, req, note in OLLAMA_CASES:
        doc = record(a.out, name, a.url, "/v1/chat/completions", ollama_body(req, a.model), note, version,
                     {"ollama_request": {"model": a.model, **req, "options": OLLAMA_OPTIONS}})
        bad += doc["status"] >= 400
    if a.embed_url:
        ev = json.loads(send(a.embed_url, "GET", "/version", None)["body"]).get("version", "?")
        for name, body, note in EMBED_CASES:
            doc = record(a.out, name, a.embed_url, "/v1/embeddings", {"model": a.embed_model, **body}, note, ev)
            bad += (doc["status"] >= 400) != ("_error_" in name)
        # what vllama sends for /api/embed (truncate_prompt_tokens -1 unless truncate is false)
        doc = record(a.out, "ollama_embed", a.embed_url, "/v1/embeddings",
                     {"model": a.embed_model, "input": ["Hello world", "Why is the sky blue?"], "truncate_prompt_tokens": -1},
                     "as vllama sends /api/embed", ev, {"ollama_request": {"model": a.embed_model, "input": ["Hello world", "Why is the sky blue?"]}})
        bad += doc["status"] >= 400
    print(f"recorded into {a.out}; {bad} case(s) with an unexpected status", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
