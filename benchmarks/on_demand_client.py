#!/usr/bin/env python3
"""The real ``ollama`` client against a vllama serving local models on demand (issue 22; ``hop_cost.sh ondemand``).

Usage: on_demand_client.py URL list | ask NAME... | tools NAME | refuse NAME | show NAME
  list     /api/tags and /api/ps, one line per model (name, family, parameter size, quantization, size)
  ask      one 16-token generate per NAME, in order: wall seconds (a swap's stop + cold start included),
           then which models /api/ps lists
  tools    a chat with one tool: status, and whether vLLM answered with tool calls or text
  refuse   a generate that must be refused (507 from the fit check): status and message
  show     capabilities and the parameters vllama reports
Prints one JSON object per line (also read by the RESULTS.md table).
"""

from __future__ import annotations

import json
import sys
import time

import ollama


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def main() -> int:
    url, cmd, *names = sys.argv[1:]
    c = ollama.Client(host=url, timeout=900)
    if cmd == "list":
        for m in c.list().models:
            d = m.details
            out(listed=m.model, family=d.family, parameter_size=d.parameter_size, quantization=d.quantization_level, size=m.size)
        out(ps=[m.model for m in c.ps().models])
    elif cmd == "ask":
        for name in names:
            t = time.monotonic()
            r = c.generate(model=name, prompt="Once upon a time", options={"num_predict": 16, "temperature": 0})
            out(model=name, wall_s=round(time.monotonic() - t, 2), eval_count=r.eval_count, load_duration_s=round(r.load_duration / 1e9, 2) if r.load_duration else None,
                ps=[m.model for m in c.ps().models])
    elif cmd == "tools":
        tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        r = c.chat(model=names[0], messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool], options={"num_predict": 32})
        out(model=names[0], tools_request="ok", tool_calls=len(r.message.tool_calls or []), content_chars=len(r.message.content or ""))
    elif cmd == "refuse":
        t = time.monotonic()
        try:
            c.generate(model=names[0], prompt="hi")
            out(model=names[0], refused=False)
        except ollama.ResponseError as e:
            out(model=names[0], refused=True, status=e.status_code, seconds=round(time.monotonic() - t, 2), error=e.error)
    elif cmd == "show":
        s = c.show(names[0])
        out(model=names[0], capabilities=s.capabilities, parameters=s.parameters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
