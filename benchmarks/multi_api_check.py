#!/usr/bin/env python3
"""Does everything vllama reads from vLLM still hold with several vLLM API servers? (issue 11)

With ``--api-server-count N`` vLLM runs N ``VLLM::APIServer_i`` processes on one port; each new
connection lands on any of them. This checks, against a running ``vllama serve --model`` and
the vLLM it launched (``--direct``):

* the API-server processes in vLLM's process tree (psutil);
* ``/health``, ``/v1/models`` and ``/tokenize`` on fresh connections: every answer 200 and equal;
* ``/vllm/metrics`` (vllama relays vLLM's ``/metrics``) while ``--streams`` long generations run
  through vllama: on fresh connections, every scrape shows the same ``vllm:num_requests_running``
  (the hang watchdog reads it) and ``vllm:generation_tokens_total`` never goes back;
* the streams are then closed by the client: ``num_requests_running`` must reach 0 (aborts reach
  the engine through whichever API server carried each stream).

Prints one JSON object and exits 1 if a check failed. Loopback only, bounded in time.

    python benchmarks/multi_api_check.py --url http://127.0.0.1:11434 --direct http://127.0.0.1:8100 --model qwen-random
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time

import aiohttp
import psutil


def api_servers(port: int) -> list[dict]:
    """Processes named ``VLLM::APIServer*`` and the process listening on ``port`` (vLLM's parent)."""
    out = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        title = " ".join(p.info["cmdline"] or []) or p.info["name"] or ""
        if "APIServer" in title or "EngineCore" in title:
            out.append({"pid": p.info["pid"], "title": title[:60]})
    return out


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def fresh(method: str, url: str, **kw) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.request(method, url, **kw) as r:
            return r.status, await r.read()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="vllama")
    ap.add_argument("--direct", required=True, help="the vLLM vllama launched")
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--scrapes", type=int, default=12)
    args = ap.parse_args()
    report: dict = {"processes": api_servers(int(args.direct.rsplit(":", 1)[1]))}
    failures: list[str] = []

    for name, method, path, kw in [
        ("health", "GET", "/health", {}),
        ("models", "GET", "/v1/models", {}),
        ("tokenize", "POST", "/tokenize", {"json": {"model": args.model, "prompt": "Hello there, world"}}),
    ]:
        answers = [await fresh(method, args.direct + path, **kw) for _ in range(16)]
        statuses = sorted({s for s, _ in answers})
        bodies = {re.sub(rb'"created":\d+|"modelperm-[0-9a-f]+"', b"", b) for _, b in answers}  # per-answer ids and times
        report[name] = {"statuses": statuses, "distinct_bodies": len(bodies)}
        if statuses != [200] or len(bodies) != 1:
            failures.append(f"{name}: {statuses}, {len(bodies)} distinct bodies")

    body = {"model": args.model, "prompt": "Once upon a time", "raw": True, "stream": True,
            "options": {"num_predict": 3000, "ignore_eos": True}}
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    streams = []
    for _ in range(args.streams):
        r = await session.post(args.url + "/api/generate", json=body)
        streams.append(r)
    await asyncio.sleep(3)
    scrapes = []
    for _ in range(args.scrapes):
        status, text = await fresh("GET", args.url + "/vllm/metrics")
        t = text.decode()
        scrapes.append({"status": status, "running": metric(t, "vllm:num_requests_running"),
                        "waiting": metric(t, "vllm:num_requests_waiting"),
                        "generation_tokens": metric(t, "vllm:generation_tokens_total")})
        await asyncio.sleep(0.25)
    report["scrapes_under_load"] = scrapes
    running = {s["running"] for s in scrapes}
    tokens = [s["generation_tokens"] for s in scrapes]
    if any(s["status"] != 200 for s in scrapes) or running != {float(args.streams)}:
        failures.append(f"num_requests_running over scrapes: {sorted(running)}, expected {args.streams}")
    if tokens != sorted(tokens) or tokens[-1] <= tokens[0]:
        failures.append(f"generation_tokens_total not monotonic/moving: {tokens}")
    t0 = time.monotonic()
    for r in streams:
        r.close()
    await session.close()
    after = None
    while time.monotonic() - t0 < 10:
        _, text = await fresh("GET", args.direct + "/metrics")
        after = metric(text.decode(), "vllm:num_requests_running")
        if after == 0:
            break
        await asyncio.sleep(0.05)
    report["aborted"] = {"running_after_close": after, "seconds": round(time.monotonic() - t0, 3)}
    if after != 0:
        failures.append(f"requests still running after the clients left: {after}")
    report["failures"] = failures
    print(json.dumps(report, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
