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
"""

from __future__ import annotations

import argparse
import asyncio
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


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--heavy-key", required=True)
    p.add_argument("--light-key", required=True)
    p.add_argument("--heavy-streams", type=int, default=1000)
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
    rng = random.Random(0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
    start = time.perf_counter()
    window = (start + a.warmup, start + a.warmup + a.duration)
    heavy_tokens = 0
    heavy_errors: dict[str, int] = {}
    stop = asyncio.Event()

    def counted() -> None:
        nonlocal heavy_tokens
        now = time.perf_counter()
        if window[0] <= now < window[1]:
            heavy_tokens += 1

    async def heavy_stream(i: int) -> None:
        await asyncio.sleep(i * a.warmup / 2 / max(a.heavy_streams, 1))  # ramp up over half the warm-up
        while not stop.is_set():
            try:
                _, _, status = await one(session, a.url, a.heavy_key, a.model, prompt(rng, a.prompt_words), a.heavy_tokens, counted)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status = type(e).__name__
            if status is not None:
                heavy_errors[str(status)] = heavy_errors.get(str(status), 0) + 1
                await asyncio.sleep(0.5)

    light: list[float] = []
    light_errors: dict[str, int] = {}

    async def light_loop() -> None:
        while time.perf_counter() < window[1]:
            sent = time.perf_counter()
            try:
                ttft, _, status = await one(session, a.url, a.light_key, a.model, prompt(rng, a.prompt_words), a.light_tokens)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                ttft, status = None, type(e).__name__
            if status is not None or ttft is None:
                light_errors[str(status)] = light_errors.get(str(status), 0) + 1
                await asyncio.sleep(0.5)
            elif sent >= window[0]:
                light.append(ttft)

    heavy = [asyncio.create_task(heavy_stream(i)) for i in range(a.heavy_streams)]
    await light_loop()
    stop.set()
    for t in heavy:
        t.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)
    await session.close()
    summary = {
        "label": a.label, "heavy_streams": a.heavy_streams, "duration_s": a.duration,
        "light_requests": len(light),
        "light_ttft_ms": {"p50": _ms(pct(light, 50)), "p90": _ms(pct(light, 90)), "p99": _ms(pct(light, 99)),
                          "mean": _ms(statistics.fmean(light) if light else None)},
        "light_errors": light_errors,
        "heavy_tok_s": round(heavy_tokens / a.duration, 1),
        "heavy_errors": heavy_errors,
    }
    print(orjson.dumps(summary).decode(), flush=True)
    if a.json:
        with open(a.json, "wb") as f:
            f.write(orjson.dumps({**summary, "light_ttft_s": light}, option=orjson.OPT_INDENT_2))


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


if __name__ == "__main__":
    asyncio.run(main())
