"""Where a light request's time goes while a flood runs (issue 38): straight to vLLM, and vLLM's own clock.

    python benchmarks/fair_diag.py --vllm http://127.0.0.1:8100 --model M --warmup 10 --duration 30 \
        --json out.json [--label r3-on-diag]

Run it beside a flood through vllama (``benchmarks/fairness.sh diag`` starts ``fairness.py`` with
it). After ``--warmup`` s, for ``--duration`` s, one light request at a time goes straight to vLLM's
``/v1/completions``, bypassing vllama and its queue, in turn: streamed with ``priority`` -10⁹ (the
best there is; vLLM ``--scheduling-policy priority``) and with 0 (client TTFT: sent -> first token),
and not streamed with -10⁹ (with vLLM's ``--enable-per-request-metrics`` its body's ``metrics``
give vLLM's own ``time_to_first_token_ms`` and ``queue_time_ms`` for that one request). Meanwhile
vLLM's ``/metrics`` is read at the window's start and end, and every second for its gauges:

- ``vllm:time_to_first_token_seconds`` (from the request's arrival in the API server to its first
  token there), ``vllm:request_queue_time_seconds`` (waiting in the engine core's queue),
  ``vllm:request_prefill_time_seconds`` (scheduled -> first token, in the engine core) and
  ``vllm:inter_token_latency_seconds`` over the window (histogram deltas: mean and quantiles read
  from the buckets), for every request vLLM served in it, the flood's included;
- ``vllm:num_requests_running`` / ``_waiting`` (each second's sample: mean and max).

How to read it: if a light request's client TTFT straight to vLLM is far above vLLM's TTFT less
its queue and prefill times, the time is spent outside the engine core's schedule: in the API
server process (parsing, tokenizing, relaying the flood's tokens: ``--api-server-count``) or on the
way; if the queue time is large, vLLM's running batch was full; if the prefill time is, the step
that first scheduled the request was slow (a batch of long prefills). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time
from pathlib import Path

import aiohttp
import orjson
from fairness import WORDS, pct

HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LE = re.compile(r'le="([^"]+)"')


def scrape(text: str) -> dict[str, dict]:
    """vLLM's metrics text -> {histogram: {"buckets": {le: count}, "sum", "count"}, gauge: value},
    summed over label sets (several API servers or engines)."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        for h in HISTOGRAMS:
            if name == h + "_bucket":
                le = _LE.search(labels)
                if le:
                    b = out.setdefault(h, {"buckets": {}, "sum": 0.0, "count": 0.0})["buckets"]
                    b[le.group(1)] = b.get(le.group(1), 0.0) + value
            elif name in (h + "_sum", h + "_count"):
                out.setdefault(h, {"buckets": {}, "sum": 0.0, "count": 0.0})[name[len(h) + 1:]] += value
        if name in GAUGES:
            out[name] = {"value": out.get(name, {}).get("value", 0.0) + value}
    return out


def delta(before: dict, after: dict, name: str) -> dict | None:
    """The histogram ``name`` over the window: requests, mean and p50/p90/p99 (upper bucket bounds)."""
    a, b = after.get(name), before.get(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
    if not a:
        return None
    n = a["count"] - b["count"]
    if n <= 0:
        return {"requests": 0}
    cum = sorted(((float(le), a["buckets"][le] - b["buckets"].get(le, 0.0)) for le in a["buckets"]), key=lambda x: x[0])

    def q(p: float) -> float | None:
        for le, c in cum:
            if c >= p * n:
                return None if le == float("inf") else round(le * 1000, 1)
        return None

    return {"requests": int(n), "mean_ms": round((a["sum"] - b["sum"]) / n * 1000, 2),
            "p50_ms_at_most": q(0.5), "p90_ms_at_most": q(0.9), "p99_ms_at_most": q(0.99)}


async def light(session: aiohttp.ClientSession, url: str, model: str, text: str, priority: int,
                stream: bool) -> dict:
    body = {"model": model, "prompt": text, "max_tokens": 32, "ignore_eos": True, "temperature": 0,
            "priority": priority, "stream": stream}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", data=orjson.dumps(body),
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            return {"status": resp.status, "error": (await resp.text())[:200]}
        if not stream:
            got = orjson.loads(await resp.read())
            return {"total_s": time.perf_counter() - t0, "metrics": got.get("metrics")}
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"text":""' not in line:
                return {"ttft_s": time.perf_counter() - t0}
    return {"error": "no token"}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm", required=True, help="vLLM's own URL (not vllama's)")
    p.add_argument("--model", required=True)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--prompt-words", type=int, default=128)
    p.add_argument("--label", default="")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rng = random.Random(1)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    await asyncio.sleep(a.warmup)
    async with session.get(a.vllm + "/metrics") as r:
        before = scrape(await r.text())
    samples: dict[str, list[float]] = {g: [] for g in GAUGES}
    end = time.perf_counter() + a.duration

    async def sample() -> None:
        while time.perf_counter() < end:
            async with session.get(a.vllm + "/metrics") as r:
                now = scrape(await r.text())
            for g in GAUGES:
                if g in now:
                    samples[g].append(now[g]["value"])
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    runs: dict[str, list[dict]] = {"stream_priority_-1e9": [], "stream_priority_0": [], "unstreamed_priority_-1e9": []}
    kinds = [("stream_priority_-1e9", -10**9, True), ("stream_priority_0", 0, True), ("unstreamed_priority_-1e9", -10**9, False)]
    i = 0
    while time.perf_counter() < end:
        name, prio, stream = kinds[i % len(kinds)]
        i += 1
        text = " ".join(rng.choice(WORDS) for _ in range(a.prompt_words))
        try:
            runs[name].append(await light(session, a.vllm, a.model, text, prio, stream))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            runs[name].append({"error": type(e).__name__})
    await sampler
    async with session.get(a.vllm + "/metrics") as r:
        after = scrape(await r.text())
    await session.close()

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    direct: dict[str, dict] = {}
    for name, got in runs.items():
        ok = [g for g in got if "error" not in g and "status" not in g]
        key = "ttft_s" if name.startswith("stream") else "total_s"
        vals = [g[key] for g in ok]
        row = {"requests": len(got), "errors": len(got) - len(ok),
               f"client_{key[:-2]}_ms": {"p50": ms(pct(vals, 50)), "p90": ms(pct(vals, 90)), "max": ms(max(vals, default=None))}}
        if not name.startswith("stream"):
            for field in ("time_to_first_token_ms", "queue_time_ms"):
                got_m = [g["metrics"][field] for g in ok if g.get("metrics") and g["metrics"].get(field) is not None]
                row[f"vllm_{field}"] = {"p50": round(pct(got_m, 50), 1), "max": round(max(got_m), 1)} if got_m else None
        direct[name] = row
    summary = {"label": a.label, "direct_to_vllm": direct,
               "vllm_histograms_over_window": {h.split(":")[1]: delta(before, after, h) for h in HISTOGRAMS},
               "vllm_gauges": {g.split(":")[1]: {"mean": round(statistics.fmean(v), 1), "max": max(v)} if v else None
                               for g, v in samples.items()}}
    print(orjson.dumps(summary).decode(), flush=True)
    if a.json:
        data = orjson.dumps({**summary, "requests": runs, "gauge_samples": samples}, option=orjson.OPT_INDENT_2)
        await asyncio.to_thread(Path(a.json).write_bytes, data)


if __name__ == "__main__":
    asyncio.run(main())
