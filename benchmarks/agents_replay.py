#!/usr/bin/env python3
"""Replay Claude Code's and Codex's request shapes through a running vllama (issue 40).

The shapes are ``tests/fixtures/agents/claude-code.json`` (``/v1/messages?beta=true``, its headers,
system blocks with ``cache_control``, tools with draft-07 schemas, ``thinking`` with Claude Code's
32000/31999 token asks, and ``count_tokens``) and ``tests/fixtures/agents/codex.json``
(``/v1/responses`` as Codex's ``ResponsesApiRequest``: instructions, input items, function tools,
``reasoning``, ``store: false``, ``include``); each file cites its sources. Every request is sent
unstreamed and streamed; a request passes when the answer holds the block or item types its
``expect`` lists (``tool_use`` / ``thinking`` / ``text`` for Anthropic, ``function_call`` /
``reasoning`` / ``message`` for Responses), read from the JSON body or from the SSE events
(``content_block_start``, ``response.output_item.added``).

Used by ``tests/real_engine/test_real_agents.py`` (vLLM on CPU) and run by hand against a GPU::

    python benchmarks/agents_replay.py --url http://127.0.0.1:11434 --model toolmodel [--key KEY] [--out FILE]

Exit status 0 when every request passed. Needs only httpx.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "agents"
AGENTS = ("claude-code", "codex")


def load(agent: str, model: str) -> dict:
    """The fixture of ``agent`` with ``{model}`` filled in."""
    text = (FIXTURES / f"{agent}.json").read_text()
    return json.loads(text.replace("{model}", model))


def _sse_events(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line[6:].strip() not in ("", "[DONE]"):
            try:
                events.append(json.loads(line[6:]))
            except json.JSONDecodeError:
                events.append({"type": "unparsed", "raw": line[6:200]})
    return events


def kinds(agent: str, body: dict | None, events: list[dict] | None) -> list[str]:
    """The block (Anthropic) or output item (Responses) types of one answer, in order; for a
    ``count_tokens`` answer, ``input_tokens`` when it counted."""
    if body is not None:
        if "input_tokens" in body and "content" not in body:
            return ["input_tokens"] if isinstance(body["input_tokens"], int) and body["input_tokens"] > 0 else []
        if agent == "claude-code":
            return [b.get("type") for b in body.get("content") or []]
        return [o.get("type") for o in body.get("output") or []]
    out = []
    for e in events or []:
        if e.get("type") == "content_block_start":
            out.append(e["content_block"].get("type"))
        elif e.get("type") == "response.output_item.added":
            out.append(e["item"].get("type"))
    return out


def replay(url: str, model: str, key: str | None = None, agents: tuple[str, ...] = AGENTS, timeout: float = 600,
           overrides: dict | None = None) -> list[dict]:
    """Every request of ``agents``' fixtures, unstreamed then streamed: one result per send
    (``agent``, ``name``, ``stream``, ``status``, ``kinds``, ``expect``, ``ok``, ``seconds``, ``error``).
    ``overrides`` are set in every body (a test's ``temperature: 0``)."""
    results = []
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout) as client:
        for agent in agents:
            fx = load(agent, model)
            headers = dict(fx["headers"])
            if key:
                headers["Authorization"] = f"Bearer {key}"
            for req in fx["requests"]:
                for stream in ((False,) if req.get("stream") is False else (False, True)):
                    body = {**req["body"], **(overrides or {})}
                    if req.get("stream") is not False:
                        body["stream"] = stream
                    t0 = time.monotonic()
                    r = client.post(req.get("path", fx["path"]), json=body, headers=headers)
                    seconds = round(time.monotonic() - t0, 2)
                    error = None
                    try:
                        found = kinds(agent, None, _sse_events(r.text)) if stream else kinds(agent, r.json(), None)
                    except (json.JSONDecodeError, AttributeError, KeyError) as e:
                        found, error = [], f"unreadable answer: {e}"
                    if r.status_code != 200:
                        error = r.text[:500]
                    elif stream and any(e.get("type") in ("error", "response.failed") or "error" in e and "type" not in e
                                        for e in _sse_events(r.text)):
                        error = "error event in the stream: " + r.text[-500:]
                    ok = r.status_code == 200 and error is None and all(k in found for k in req["expect"])
                    results.append({"agent": agent, "name": req["name"], "stream": stream, "status": r.status_code, "kinds": found,
                                    "expect": req["expect"], "ok": ok, "seconds": seconds, "error": error})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:11434", help="vllama's URL")
    ap.add_argument("--model", required=True, help="the model to name (a tool model served with its parsers)")
    ap.add_argument("--key", help="an API key (Authorization: Bearer)")
    ap.add_argument("--agent", choices=AGENTS, action="append", help="only this agent's shapes (repeatable)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--temperature", type=float, help="set in every body (default: as the agents send it)")
    args = ap.parse_args(argv)
    overrides = {"temperature": args.temperature} if args.temperature is not None else None
    results = replay(args.url, args.model, args.key, tuple(args.agent or AGENTS), overrides=overrides)
    for r in results:
        mark = "ok  " if r["ok"] else "FAIL"
        print(f"{mark} {r['agent']:<11} {r['name']:<17} {'stream' if r['stream'] else 'whole ':<6} {r['status']} {r['seconds']:>6}s "
              f"{','.join(map(str, r['kinds']))}{'  ' + r['error'][:200] if r['error'] else ''}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
