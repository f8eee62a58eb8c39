"""Backlogged keys with weights on one vllama (issue 38): does each get its weighted share?

    python benchmarks/fair_weights.py --url http://127.0.0.1:11434 --model M \
        --key sk-w1:1:128:64 --key sk-w1b:1:32:256 --key sk-w2:2:512:32 --key sk-w4:4:64:128 \
        --late sk-late:2:128:64 --late-at 30 --streams 400 --duration 60 --json out.json

Each ``--key SECRET:WEIGHT:PROMPT_WORDS:OUTPUT_TOKENS`` keeps ``--streams`` ``/api/generate``
streams open (each re-issued the moment it ends; ``ignore_eos``, so exactly OUTPUT_TOKENS), enough
that every key stays backlogged in vllama's fair queue (more streams in all than vLLM runs). WEIGHT
must be the key's ``weight`` in the keys file; it is only used here to compute the expected share.
After ``--warmup`` seconds, for ``--duration`` seconds: each key's output tokens (token lines as
they arrive, and at the end what the ``done`` line's ``eval_count`` adds: a token whose text is
empty, e.g. half a UTF-8 character, has no line) and its service, ``--prompt-weight`` x prompt
tokens + output tokens (what vllama's fair queue charges, ``api/policy/fair_queue.py``; the prompt counted
when the request ends), and their shares against weight / sum of weights (issue 38's goal: the
output-token shares within 10 %). ``--late`` starts one more key ``--late-at`` seconds into the
measured window: its output-token share in each second from then on, and how many seconds until it
is within 10 % of its weighted share (as a 1-second-window average over 3 s).

Prints one JSON summary line; ``--json`` writes it with the per-second series.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import time

import aiohttp
import orjson
from fairness import WORDS

W_OUT = 1.0  # vllama_proxy/api/policy/fair_queue.py: the unit; a prompt token costs --prompt-weight


class KeyLoad:
    def __init__(self, spec: str) -> None:
        secret, weight, words, tokens = spec.rsplit(":", 3)
        self.secret, self.weight, self.words, self.tokens = secret, float(weight), int(words), int(tokens)
        self.out_per_s: dict[int, int] = {}
        self.service_per_s: dict[int, float] = {}
        self.errors: dict[str, int] = {}


async def stream(session: aiohttp.ClientSession, url: str, model: str, k: KeyLoad, rng: random.Random,
                 t0: float, stop: asyncio.Event, w_in: float) -> None:
    while not stop.is_set():
        text = " ".join(rng.choice(WORDS) for _ in range(k.words))
        body = {"model": model, "prompt": text, "stream": True,
                "options": {"num_predict": k.tokens, "ignore_eos": True, "temperature": 0}}
        prompt_tokens, lines = k.words, 0
        try:
            async with session.post(url + "/api/generate", data=orjson.dumps(body),
                                    headers={"Authorization": f"Bearer {k.secret}", "Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    await resp.read()
                    k.errors[str(resp.status)] = k.errors.get(str(resp.status), 0) + 1
                    await asyncio.sleep(0.5)
                    continue
                async for line in resp.content:
                    if not line.strip():
                        continue
                    item = orjson.loads(line)
                    sec = int(time.perf_counter() - t0)
                    got = 1 if item.get("response") else 0
                    lines += got
                    if item.get("done"):
                        prompt_tokens = item.get("prompt_eval_count") or prompt_tokens
                        got += max((item.get("eval_count") or 0) - lines, 0)
                        k.service_per_s[sec] = k.service_per_s.get(sec, 0.0) + w_in * prompt_tokens
                    if got:
                        k.out_per_s[sec] = k.out_per_s.get(sec, 0) + got
                        k.service_per_s[sec] = k.service_per_s.get(sec, 0.0) + W_OUT * got
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            k.errors[type(e).__name__] = k.errors.get(type(e).__name__, 0) + 1
            await asyncio.sleep(0.5)


def shares(loads: list[KeyLoad], seconds: range, what: str) -> dict[str, float]:
    total = {k.secret: sum(getattr(k, what).get(s, 0) for s in seconds) for k in loads}
    whole = sum(total.values()) or 1
    return {name: round(v / whole, 4) for name, v in total.items()}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--key", action="append", required=True, help="SECRET:WEIGHT:PROMPT_WORDS:OUTPUT_TOKENS")
    p.add_argument("--late", default=None, help="one more key, started --late-at s into the window")
    p.add_argument("--late-at", type=float, default=30.0)
    p.add_argument("--streams", type=int, default=400, help="streams per key")
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--prompt-weight", type=float, default=0.0, help="vllama's --fair-prompt-weight (for the service)")
    p.add_argument("--label", default="")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    loads = [KeyLoad(s) for s in a.key]
    late = KeyLoad(a.late) if a.late else None
    rng = random.Random(0)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600))
    stop = asyncio.Event()
    t0 = time.perf_counter()
    # the keys' streams interleaved: four keys backlogged together, none alone first (which one
    # took every running slot while the others' first requests were on their way is a matter of
    # milliseconds, and paying that back took the first seconds of the window on the stand-in)
    tasks = [asyncio.create_task(stream(session, a.url, a.model, k, rng, t0, stop, a.prompt_weight))
             for _ in range(a.streams) for k in loads]
    start, end = int(a.warmup), int(a.warmup + a.duration)
    if late is not None:
        await asyncio.sleep(a.warmup + a.late_at)
        tasks += [asyncio.create_task(stream(session, a.url, a.model, late, rng, t0, stop, a.prompt_weight)) for _ in range(a.streams)]
    await asyncio.sleep(max(t0 + a.warmup + a.duration - time.perf_counter(), 0))
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await session.close()

    before_late = range(start, int(a.warmup + a.late_at) if late else end)
    wsum = sum(k.weight for k in loads)
    summary: dict = {"label": a.label, "window_s": [start, before_late.stop], "keys": {}}
    out_share, svc_share = shares(loads, before_late, "out_per_s"), shares(loads, before_late, "service_per_s")
    for k in loads:
        want = k.weight / wsum
        summary["keys"][k.secret] = {
            "weight": k.weight, "prompt_words": k.words, "output_tokens": k.tokens, "want": round(want, 4),
            "output_tok_s": round(sum(k.out_per_s.get(s, 0) for s in before_late) / max(len(before_late), 1), 1),
            "output_share": out_share[k.secret], "output_vs_want": round(out_share[k.secret] / want, 3),
            "service_share": svc_share[k.secret], "service_vs_want": round(svc_share[k.secret] / want, 3),
            "errors": k.errors}
    if late is not None:
        everyone = [*loads, late]
        want = late.weight / (wsum + late.weight)
        first = int(a.warmup + a.late_at)
        per_s = [shares(everyone, range(s, s + 1), "out_per_s")[late.secret] for s in range(first, end)]
        within = next((i for i in range(len(per_s) - 2)
                       if abs(sum(per_s[i:i + 3]) / 3 - want) <= 0.1 * want), None)
        after = range(first, end)
        summary["late"] = {"key": late.secret, "weight": late.weight, "want": round(want, 4),
                           "output_share_per_s": per_s, "seconds_to_share": within,
                           "service_share_after": shares(everyone, after, "service_per_s")[late.secret],
                           "output_share_after": shares(everyone, after, "out_per_s")[late.secret], "errors": late.errors}
    print(orjson.dumps(summary).decode(), flush=True)
    if a.json:
        with open(a.json, "wb") as f:
            series = {k.secret: {"out": k.out_per_s, "service": k.service_per_s} for k in ([*loads, late] if late else loads)}
            f.write(orjson.dumps({**summary, "per_second": series}, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


if __name__ == "__main__":
    asyncio.run(main())
