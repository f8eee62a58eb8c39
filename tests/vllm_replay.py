"""Real vLLM bytes for the stand-in: load the recordings, replay them, compare shapes.

The recordings (``tests/fixtures/vllm-0.26/*.json``) are written by
``benchmarks/tool_model/record.py`` against a real vLLM 0.26 serving the trained tool model on
a GPU (``benchmarks/tool_model/gpu_tools.sh``): each holds the request sent and the status,
headers and body vLLM answered, verbatim (SSE streams byte for byte). Nothing here is
hand-written.

- ``load()`` reads them; ``request_key()`` names what a request asks for (path, stream,
  messages, tool names, thinking switch, response format, prompt or input, an unknown model),
  ignoring what does not change vLLM's answer shape (sampling options, the served name).
- ``replay_middleware(dir, served)`` makes ``tests/fake_vllm.py`` answer a request that has a
  recording with the recorded status, content type and body (``FAKE_VLLM_REPLAY=dir``).
- ``outline()`` reduces a body to its structure: for SSE the sequence of chunk kinds (role,
  reasoning, content, tool_start, tool_args, +finish, usage, error, [DONE]; runs collapsed)
  and the key paths each kind carries; for JSON the key paths with value types; for errors
  also ``error.type`` and ``error.code``. ``differences()`` lists where two outlines differ.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

FIXTURES = Path(os.environ.get("VLLM_REPLAY_FIXTURES") or Path(__file__).resolve().parent / "fixtures" / "vllm-0.26")
UNKNOWN = "<unknown model>"


def load(directory: Path | str = FIXTURES) -> dict[str, dict[str, Any]]:
    """name -> recording, for every ``*.json`` in ``directory`` (none: empty)."""
    d = Path(directory)
    if not d.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))}


def served_names(recordings: dict[str, dict[str, Any]]) -> set[str]:
    """The model names the recordings were made with (unknown-model cases excluded)."""
    return {r["request"]["body"].get("model") for n, r in recordings.items() if "unknown_model" not in n} - {None}


# --------------------------------------------------------------------------- matching


def _message_key(m: Any) -> Any:
    if not isinstance(m, dict):
        return repr(m)
    content = m.get("content")
    if not isinstance(content, str):
        content = json.dumps(content, sort_keys=True) if content is not None else ""
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append([fn.get("name"), args])
    return [m.get("role"), content, calls]


def request_key(path: str, body: dict[str, Any], served: set[str]) -> str:
    """What a request asks vLLM for, as one string (equal keys get the same recording)."""
    model = body.get("model")
    msgs = body.get("messages")
    rf = body.get("response_format")
    kwargs = body.get("chat_template_kwargs")
    key = {
        "path": path,
        "stream": bool(body.get("stream")),
        "unknown_model": model not in served and model is not None,
        "messages": [_message_key(m) for m in msgs] if isinstance(msgs, list) else msgs,
        "tools": sorted((t.get("function") or {}).get("name", "") for t in body.get("tools") or [] if isinstance(t, dict)),
        "tool_choice": body.get("tool_choice"),
        "thinking": kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None,
        "response_format": rf.get("type") if isinstance(rf, dict) else None,
        "schema": (rf.get("json_schema") or {}).get("schema") if isinstance(rf, dict) else None,
        "prompt": body.get("prompt"),
        "input": body.get("input"),
        "encoding_format": body.get("encoding_format") or "float",
        "max_tokens": body.get("max_tokens") if path == "/v1/completions" else None,
    }
    return json.dumps(key, sort_keys=True)


def index(recordings: dict[str, dict[str, Any]], served: set[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    # two recordings of one request: the one made for vllama (``ollama_request``) answers it
    for rec in sorted(recordings.values(), key=lambda r: "ollama_request" not in r):
        req = rec["request"]
        out.setdefault(request_key(req["path"], req["body"], served), rec)
    return out


def replay_middleware(directory: Path | str, served: list[str]):
    """An aiohttp middleware answering recorded requests with the recorded bytes."""
    from aiohttp import web

    recordings = load(directory)
    names = served_names(recordings) | set(served)
    table = index(recordings, names)

    @web.middleware
    async def replay(request: web.Request, handler):
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await handler(request)
        try:
            body = json.loads(await request.read())
        except ValueError:
            return await handler(request)
        rec = table.get(request_key(request.path, body, names)) if isinstance(body, dict) else None
        if rec is None:
            return await handler(request)
        ctype = rec["headers"].get("content-type", "application/json")
        if not ctype.startswith("text/event-stream"):
            return web.Response(status=rec["status"], body=rec["body"].encode(), headers={"Content-Type": ctype})
        resp = web.StreamResponse(status=rec["status"], headers={"Content-Type": ctype})
        await resp.prepare(request)
        for event in rec["body"].split("\n\n"):  # event by event, as vLLM flushed them
            if event:
                await resp.write(event.encode() + b"\n\n")
                await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    return replay


# --------------------------------------------------------------------------- outlines


def sse_events(body: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body: parsed JSON objects, ``"[DONE]"``, or the raw text."""
    out: list[Any] = []
    for event in body.split("\n\n"):
        data = "\n".join(line[5:].lstrip(" ") for line in event.split("\n") if line.startswith("data:"))
        if not data:
            continue
        if data == "[DONE]":
            out.append("[DONE]")
            continue
        try:
            out.append(json.loads(data))
        except ValueError:
            out.append(data)
    return out


def _type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "list"
    return "object"


def paths(obj: Any, prefix: str = "") -> dict[str, set[str]]:
    """key path -> the value types seen there (list items under ``[]``)."""
    out: dict[str, set[str]] = {}

    def walk(v: Any, p: str) -> None:
        out.setdefault(p or ".", set()).add(_type(v))
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{p}.{k}")
        elif isinstance(v, list):
            for x in v:
                walk(x, f"{p}[]")

    walk(obj, prefix)
    return out


def _merge(into: dict[str, set[str]], more: dict[str, set[str]]) -> None:
    for k, v in more.items():
        into.setdefault(k, set()).update(v)


def chunk_kind(ev: Any) -> str:
    if ev == "[DONE]":
        return "[DONE]"
    if not isinstance(ev, dict):
        return "unparsable"
    if "error" in ev:
        return "error"
    choices = ev.get("choices")
    if not choices:
        return "usage" if ev.get("usage") else "empty"
    parts: list[str] = []
    for ch in choices:
        delta = ch.get("delta")
        if delta is None:  # completions
            if ch.get("text"):
                parts.append("text")
        else:
            if delta.get("role"):
                parts.append("role")
            if delta.get("reasoning") or delta.get("reasoning_content"):
                parts.append("reasoning")
            if delta.get("content"):
                parts.append("content")
            for tc in delta.get("tool_calls") or []:
                parts.append("tool_start" if tc.get("id") or (tc.get("function") or {}).get("name") else "tool_args")
        if ch.get("finish_reason") is not None:
            parts.append("+finish")
    if ev.get("usage"):
        parts.append("+usage")
    return ",".join(dict.fromkeys(parts)) or "blank"


def outline(rec: dict[str, Any]) -> dict[str, Any]:
    """The structure of a recorded (or live) answer: see the module docstring."""
    ctype = rec["headers"].get("content-type", "")
    out: dict[str, Any] = {"status": rec["status"], "content_type": ctype}
    if ctype.startswith("text/event-stream"):
        seq: list[str] = []
        keys: dict[str, dict[str, set[str]]] = {}
        for ev in sse_events(rec["body"]):
            kind = chunk_kind(ev)
            if not seq or seq[-1] != kind:
                seq.append(kind)
            _merge(keys.setdefault(kind, {}), paths(ev) if isinstance(ev, dict) else {})
            if kind == "error":
                out["error"] = _error_facts(ev)
        out["sequence"] = seq
        out["keys"] = keys
        return out
    try:
        obj = json.loads(rec["body"])
    except ValueError:
        out["text"] = rec["body"][:200]
        return out
    out["keys"] = {"body": paths(obj)}
    if isinstance(obj, dict) and ("error" in obj or "detail" in obj):
        out["error"] = _error_facts(obj)
    return out


def _error_facts(obj: dict[str, Any]) -> dict[str, Any]:
    err = obj.get("error")
    if isinstance(err, dict):
        return {"type": err.get("type"), "code": err.get("code")}
    return {"detail": _type(obj.get("detail")), "error": _type(err)}


def differences(real: dict[str, Any], fake: dict[str, Any]) -> list[str]:
    """Where ``fake``'s outline departs from ``real``'s (empty: the same shape)."""
    diffs: list[str] = []
    for k in ("status", "content_type", "sequence", "error"):
        if real.get(k) != fake.get(k):
            diffs.append(f"{k}: vLLM {real.get(k)!r}, stand-in {fake.get(k)!r}")
    rk, fk = real.get("keys", {}), fake.get("keys", {})
    for kind in sorted(set(rk) & set(fk)):
        a, b = rk[kind], fk[kind]
        for p in sorted(set(a) - set(b)):
            diffs.append(f"{kind}: {p} only in vLLM's ({'/'.join(sorted(a[p]))})")
        for p in sorted(set(b) - set(a)):
            diffs.append(f"{kind}: {p} only in the stand-in's ({'/'.join(sorted(b[p]))})")
        for p in sorted(set(a) & set(b)):
            ta, tb = a[p] - {"null"}, b[p] - {"null"}
            if ta and tb and not (ta & tb):
                diffs.append(f"{kind}: {p} is {'/'.join(sorted(a[p]))} in vLLM's, {'/'.join(sorted(b[p]))} in the stand-in's")
    return diffs


def accumulate(rec: dict[str, Any]) -> dict[str, Any]:
    """What a recorded chat answer says: reasoning, content, tool calls (arguments parsed), finish."""
    reasoning, content, calls, finish = [], [], {}, None
    if rec["headers"].get("content-type", "").startswith("text/event-stream"):
        for ev in sse_events(rec["body"]):
            if not isinstance(ev, dict):
                continue
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                reasoning.append(d.get("reasoning") or d.get("reasoning_content") or "")
                content.append(d.get("content") or "")
                for tc in d.get("tool_calls") or []:
                    c = calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                    fn = tc.get("function") or {}
                    c["name"] += fn.get("name") or ""
                    c["arguments"] += fn.get("arguments") or ""
                finish = ch.get("finish_reason") or finish
    else:
        ch = json.loads(rec["body"])["choices"][0]
        m = ch["message"]
        reasoning.append(m.get("reasoning") or m.get("reasoning_content") or "")
        content.append(m.get("content") or "")
        for i, tc in enumerate(m.get("tool_calls") or []):
            calls[i] = {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
        finish = ch.get("finish_reason")
    return {"reasoning": "".join(reasoning), "content": "".join(content), "finish_reason": finish,
            "tool_calls": [{"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")} for _, c in sorted(calls.items())]}
