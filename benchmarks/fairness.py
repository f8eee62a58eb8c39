"""Two keys on one vllama (issue 27): a heavy key floods streams while a light key asks one at a time.

    python benchmarks/fairness.py --url http://127.0.0.1:11434 --model M --heavy-key K1 --light-key K2 \
        --heavy-streams 1000 --duration 60 --json out.json [--label on]

The heavy key keeps ``--heavy-streams`` ``/api/generate`` streams open (each re-issued the moment
it ends, ``--heavy-tokens`` output tokens, ``ignore_eos``); the light key sends one request at a time
(``--light-tokens``), back to back. After ``--warmup`` seconds of ramp-up, for ``--duration``
seconds: the light key's TTFT (request sent -> first token line) per request, and the heavy key's
output tokens (token lines received) per second. ``--heavy-streams 0`` measures the light key alone.
Every prompt is new random words (no prefix-cache hits). Prints one JSON summary line; ``--json``
writes it with every light TTFT.

The light key is another client: it runs in a process of its own, and the heavy streams are spread
over ``--heavy-procs`` (4) more. In one event loop (session 10's runs) the light key's first token
waited behind the flood's 25,000 token lines a second being parsed in the same loop, which one core
barely keeps up with, so part of what was measured was the load generator's own lag.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import resource
import statistics
import time

import aiohttp
import orjson

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(session: aiohttp.ClientSession, url: str, key: str, model: str, text: str, tokens: int,
              on_token=None) -> tuple[float | None, int, int | None]:
    """One streamed generate: (TTFT s or None, token lines, HTTP status when it was not 200)."""
    body = {"model": model, "prompt": text, "stream": True,
            "options": {"num_predict": tokens, "ignore_eos": True, "temperature": 0}}
    t0 = time.perf_counter()
    ttft = None
    n = 0
    async with session.post(url + "/api/generate", data=orjson.dumps(body),
                            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            await resp.read()
            return None, 0, resp.status
        async for line in resp.content:
            if not line.strip():
                continue
            item = orjson.loads(line)
            if item.get("error"):
                return ttft, n, 599
            if item.get("response"):
                n += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if on_token is not None:
                    on_token()
    return ttft, n, None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _heavy_proc(a: argparse.Namespace, first: int, count: int, start: float, out) -> None:
    """Streams ``first .. first + count - 1`` of the heavy key, in this process (its own loop)."""
    out.put(asyncio.run(_heavy(a, first, count, start)))


async def _heavy(a: argparse.Namespace, first: int, count: int, start: float) -> tuple[int, dict[str, int]]:
    rng = random.Random(first + 1)
    window = (start + a.warmup, start + a.warmup + a.duration)
    heavy_tokens = 0
    heavy_errors: dict[str, int] = {}
    session = _session()

    def counted() -> None:
        nonlocal heavy_tokens
        if window[0] <= time.perf_counter() < window[1]:
            heavy_tokens += 1

    async def heavy_stream(i: int) -> None:
        await asyncio.sleep(max(start + i * a.warmup / 2 / max(a.heavy_streams, 1) - time.perf_counter(), 0))  # ramp up
        while time.perf_counter() < window[1]:
            try:
                _, _, status = await one(session, a.url, a.heavy_key, a.model, prompt(rng, a.prompt_words), a.heavy_tokens, counted)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status = type(e).__name__
            if status is not None:
                heavy_errors[str(status)] = heavy_errors.get(str(status), 0) + 1
                await asyncio.sleep(0.5)

    tasks = [asyncio.create_task(heavy_stream(i)) for i in range(first, first + count)]
    await asyncio.sleep(max(window[1] - time.perf_counter(), 0))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()
    return heavy_tokens, heavy_errors


def _light_proc(a: argparse.Namespace, start: float, out) -> None:
    out.put(asyncio.run(_light(a, start)))


async def _light(a: argparse.Namespace, start: float) -> tuple[list[float], dict[str, int]]:
    """The light key's requests, one at a time, until the window ends (a request still waiting for
    its first token then is cut and counted in the errors: with fair share off it waits ~10 s)."""
    rng = random.Random(0)
    window = (start + a.warmup, start + a.warmup + a.duration)
    light: list[float] = []
    light_errors: dict[str, int] = {}
    session = _session()
    waiting = [False]  # the request in flight has no first token yet

    async def requests() -> None:
        while True:
            sent = time.perf_counter()
            first: list[float] = []
            waiting[0] = True

            def on_token() -> None:
                waiting[0] = False
                if not first:
                    first.append(time.perf_counter() - sent)
                    if sent >= window[0]:
                        light.append(first[0])

            try:
                _, _, status = await one(session, a.url, a.light_key, a.model, prompt(rng, a.prompt_words), a.light_tokens,
                                         on_token)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status = type(e).__name__
            if status is not None or not first:
                light_errors[str(status)] = light_errors.get(str(status), 0) + 1
                await asyncio.sleep(0.5)

    await asyncio.sleep(max(start - time.perf_counter(), 0))
    try:
        await asyncio.wait_for(requests(), max(window[1] - time.perf_counter(), 0))
    except asyncio.TimeoutError:
        if waiting[0]:
            light_errors["no first token by the window's end"] = 1
    await session.close()
    return light, light_errors


def _session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--heavy-key", required=True)
    p.add_argument("--light-key", required=True)
    p.add_argument("--heavy-streams", type=int, default=1000)
    p.add_argument("--heavy-procs", type=int, default=4,
                   help="client processes the heavy streams are spread over (the light key has its own)")
    p.add_argument("--heavy-tokens", type=int, default=256)
    p.add_argument("--light-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=128)
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of ramp-up not measured")
    p.add_argument("--duration", type=float, default=60.0, help="seconds measured")
    p.add_argument("--label", default="")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start = time.perf_counter() + 0.5  # CLOCK_MONOTONIC: the same clock in every process
    procs = max(min(a.heavy_procs, a.heavy_streams), 1) if a.heavy_streams else 0
    per = [a.heavy_streams // procs + (i < a.heavy_streams % procs) for i in range(procs)]
    heavy = [ctx.Process(target=_heavy_proc, args=(a, sum(per[:i]), n, start, out)) for i, n in enumerate(per)]
    light = ctx.Process(target=_light_proc, args=(a, start, out))
    for proc in (*heavy, light):
        proc.start()
    results = [out.get() for _ in range(len(heavy) + 1)]
    for proc in (*heavy, light):
        proc.join()
    heavy_tokens, heavy_errors = 0, {}
    ttfts: list[float] = []
    light_errors: dict[str, int] = {}
    for got in results:
        if isinstance(got[0], int):
            heavy_tokens += got[0]
            for k, v in got[1].items():
                heavy_errors[k] = heavy_errors.get(k, 0) + v
        else:
            ttfts, light_errors = got
    summary = {
        "label": a.label, "heavy_streams": a.heavy_streams, "heavy_procs": procs, "duration_s": a.duration,
        "light_requests": len(ttfts),
        "light_ttft_ms": {"p50": _ms(pct(ttfts, 50)), "p90": _ms(pct(ttfts, 90)), "p99": _ms(pct(ttfts, 99)),
                          "mean": _ms(statistics.fmean(ttfts) if ttfts else None)},
        "light_errors": light_errors,
        "heavy_tok_s": round(heavy_tokens / a.duration, 1),
        "heavy_errors": heavy_errors,
    }
    print(orjson.dumps(summary).decode(), flush=True)
    if a.json:
        with open(a.json, "wb") as f:
            f.write(orjson.dumps({**summary, "light_ttft_s": ttfts}, option=orjson.OPT_INDENT_2))


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


if __name__ == "__main__":
    main()
