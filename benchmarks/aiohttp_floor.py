#!/usr/bin/env python3
"""The least a Python aiohttp relay costs per streamed token: a reference for ``cpu_bench.py --floor``.

A bare ``/api/chat`` -> ``/v1/chat/completions`` relay on the same stack as vllama (aiohttp
server and client, uvloop, orjson): read what vLLM sent, decode each SSE event, write one
Ollama NDJSON line per token, one write per read. No validation, middleware, admission,
metrics, thinking or tool calls: not a product, only the floor under vllama's cost per token
on the machine it runs on (issue 11: the aiohttp read + write per token is most of it).

``POST /v1/completions`` is the least any relay costs: the request's bytes go to vLLM's
``/v1/completions`` untouched and every read of the answer is written back untouched (no
parsing either way), on one pooled connection like a direct client's. Set beside vLLM direct
and vllama's own ``/v1`` pass-through at c=1 (``hop_cost.sh c1split``), it separates the hop
itself (another process and loopback connection on the path) from what vllama does on it.

    python benchmarks/aiohttp_floor.py --upstream http://127.0.0.1:8000 --port 11435

The hop without vLLM (a Unix socket, a loop kept awake, a hand-written upstream client; RESULTS.md,
"the hop taken apart without vLLM") was measured with options this relay had then and
abcf5ef:benchmarks/hop_floor.py.
"""

from __future__ import annotations

import argparse

import aiohttp
import orjson
import uvloop
from aiohttp import web


async def chat(request: web.Request) -> web.StreamResponse:
    req = orjson.loads(await request.read())
    body = {"model": req["model"], "messages": req["messages"], "max_tokens": req["options"]["num_predict"],
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    session: aiohttp.ClientSession = request.app["session"]
    async with session.post(request.app["upstream"] + "/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Content-Type": "application/json"}) as r:
        out = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await out.prepare(request)
        n = 0
        async for data in r.content.iter_any():
            lines = []
            for line in data.split(b"\n"):
                if line.startswith(b"data: {"):
                    choices = orjson.loads(line[6:]).get("choices")
                    if choices and choices[0]["delta"].get("content"):
                        n += 1
                        msg = {"role": "assistant", "content": choices[0]["delta"]["content"]}
                        lines.append(orjson.dumps({"model": req["model"], "created_at": "", "message": msg, "done": False}))
            if lines:
                await out.write(b"\n".join(lines) + b"\n")
        done = {"model": req["model"], "message": {"role": "assistant", "content": ""}, "done": True, "eval_count": n}
        await out.write_eof(orjson.dumps(done) + b"\n")
        return out


async def completions(request: web.Request) -> web.StreamResponse:
    session: aiohttp.ClientSession = request.app["session"]
    async with session.post(request.app["upstream"] + "/v1/completions", data=await request.read(),
                            headers={"Content-Type": "application/json"}) as r:
        out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "application/json")})
        await out.prepare(request)
        async for data in r.content.iter_any():
            await out.write(data)
        await out.write_eof()
        return out


async def make_app(upstream: str) -> web.Application:
    app = web.Application()
    app["upstream"] = upstream

    async def session(app: web.Application):
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                               timeout=aiohttp.ClientTimeout(total=None, sock_read=600))
        yield
        await app["session"].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/", lambda _r: web.Response(text="ok"))
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvloop.install()
    web.run_app(make_app(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
