#!/usr/bin/env python3
"""Client disconnects abort vLLM's requests: watch ``vllm:num_requests_running`` drop.

Opens N long generations through the proxy (Ollama ``/api/generate``, ``num_predict``
2000 with ``ignore_eos``), waits until vLLM reports them running (read through the
proxy's ``/vllm/metrics``), closes every client connection at once, and measures how
long vLLM takes to show 0 running. Done for streaming and non-streaming requests.

Usage: python benchmarks/disconnect_check.py --url http://127.0.0.1:11434 --model M [-n 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time

import aiohttp


async def running(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/vllm/metrics") as r:
        text = await r.text()
    return sum(float(m) for m in re.findall(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.M))


async def one_case(url: str, model: str, n: int, stream: bool) -> dict:
    probe = aiohttp.ClientSession()
    clients = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))

    async def generate(i: int) -> None:
        body = {"model": model, "prompt": f"request {i}: tell a long story", "raw": True, "stream": stream,
                "options": {"num_predict": 2000, "ignore_eos": True}}
        async with clients.post(url + "/api/generate", json=body) as r:
            async for _ in r.content.iter_any():
                pass

    tasks = [asyncio.create_task(generate(i)) for i in range(n)]
    t0 = time.monotonic()
    peak = 0.0
    while time.monotonic() - t0 < 60:
        peak = await running(probe, url)
        if peak >= n:
            break
        await asyncio.sleep(0.05)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await clients.close()  # every client connection is gone now
    t_close = time.monotonic()
    now = peak
    while time.monotonic() - t_close < 30:
        now = await running(probe, url)
        if now == 0:
            break
        await asyncio.sleep(0.02)
    dropped_s = time.monotonic() - t_close
    await probe.close()
    out = {"stream": stream, "requests": n, "running_before": peak, "running_after": now, "seconds_to_zero": round(dropped_s, 3)}
    print(f"stream={stream}: {peak:g} running -> {now:g} running {dropped_s:.3f} s after the clients disconnected", flush=True)
    return out


async def main_async(args: argparse.Namespace) -> list[dict]:
    return [await one_case(args.url, args.model, args.n, stream) for stream in (True, False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:11434")
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "url": args.url, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
