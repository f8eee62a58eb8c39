#!/usr/bin/env python3
"""End-to-end transcript: the real ``ollama`` Python client against a running vllama.

Exercises version, tags, show, ps, generate and chat (streaming and not, raw and
templated, options, format), the /v1 pass-through with the ``openai`` client, and
embed (expected to fail with vLLM's own message on a generation model), then the
seed scenario: wall time of 1 request vs 10 concurrent requests (batching means
10 should take about as long as 1).

Usage: python benchmarks/e2e_ollama.py --url http://127.0.0.1:11434 --model NAME [--out e2e.json]
Prints one line per step with its wall time; writes the transcript as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import ollama


def run_steps(url: str, model: str) -> list[dict[str, Any]]:
    client = ollama.Client(host=url)
    steps: list[dict[str, Any]] = []

    def step(name: str, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
            ok = True
        except Exception as e:  # record and go on: this is a transcript
            out, ok = f"{type(e).__name__}: {e}", False
        wall = time.perf_counter() - t0
        text = out if isinstance(out, str) else json.dumps(out, default=str)[:600]
        steps.append({"step": name, "ok": ok, "wall_s": round(wall, 4), "result": text})
        print(f"{'ok ' if ok else 'ERR'} {wall * 1000:9.1f} ms  {name:40s} {text[:150]}", flush=True)

    def gen_stream(**kw):
        chunks = list(client.generate(model=model, stream=True, **kw))
        last = chunks[-1]
        return {"chunks": len(chunks), "text": "".join(c.response for c in chunks)[:200], "done_reason": last.done_reason,
                "eval_count": last.eval_count, "prompt_eval_count": last.prompt_eval_count,
                "ttft_ms": last.prompt_eval_duration / 1e6, "eval_ms": last.eval_duration / 1e6, "total_ms": last.total_duration / 1e6}

    def chat_stream(**kw):
        chunks = list(client.chat(model=model, stream=True, **kw))
        last = chunks[-1]
        return {"chunks": len(chunks), "text": "".join(c.message.content for c in chunks)[:200], "done_reason": last.done_reason,
                "eval_count": last.eval_count, "ttft_ms": last.prompt_eval_duration / 1e6}

    step("version", lambda: httpx_get(url + "/api/version"))
    step("list (tags)", lambda: [m.model for m in client.list().models])
    step("show", lambda: (lambda s: {"capabilities": s.capabilities, "details": s.details.model_dump(), "model_info": s.modelinfo, "parameters": s.parameters})(client.show(model)))
    step("ps", lambda: [m.model_dump() for m in client.ps().models])
    step("generate stream (templated)", lambda: gen_stream(prompt="Why is the sky blue?", options={"num_predict": 64}))
    step("generate non-stream (templated)", lambda: (lambda r: {"text": r.response[:200], "eval_count": r.eval_count, "done_reason": r.done_reason})(
        client.generate(model=model, prompt="Say hello.", options={"num_predict": 32}, stream=False)))
    step("generate stream raw + options", lambda: gen_stream(prompt="def fibonacci(n):", raw=True, options={"num_predict": 48, "temperature": 0.2, "top_k": 20, "top_p": 0.9, "seed": 7, "repeat_penalty": 1.1}))
    step("generate same seed twice equal", lambda: (lambda a, b: {"equal": a == b})(
        client.generate(model=model, prompt="Once upon", options={"num_predict": 24, "seed": 11, "temperature": 1.0}, stream=False).response,
        client.generate(model=model, prompt="Once upon", options={"num_predict": 24, "seed": 11, "temperature": 1.0}, stream=False).response))
    step("generate num_predict=5 -> length", lambda: (lambda r: {"eval_count": r.eval_count, "done_reason": r.done_reason})(
        client.generate(model=model, prompt="Count:", options={"num_predict": 5}, stream=False)))
    step("generate unlimited (num_predict -1, ignore_eos off)", lambda: (lambda r: {"eval_count": r.eval_count, "done_reason": r.done_reason})(
        client.generate(model=model, prompt="Tell a story.", raw=True, options={"num_predict": -1, "stop": ["\n\n\n"]}, stream=False)))
    step("chat stream", lambda: chat_stream(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}], options={"num_predict": 48}))
    step("chat non-stream", lambda: (lambda r: {"text": r.message.content[:200], "eval_count": r.eval_count})(
        client.chat(model=model, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 32}, stream=False)))
    step("chat format=json", lambda: client.chat(model=model, messages=[{"role": "user", "content": "JSON please"}], format="json", options={"num_predict": 32}, stream=False).message.content[:200])
    step("preload (empty prompt)", lambda: client.generate(model=model, prompt="").done_reason)
    step("unknown model -> 404", lambda: client.generate(model="nope", prompt="x"))
    step("embed (generation model: vLLM refuses)", lambda: client.embed(model=model, input="hello"))
    step("openai /v1 chat stream", lambda: openai_chat(url, model))
    return steps


def httpx_get(url: str) -> Any:
    import httpx

    return httpx.get(url, timeout=10).json()


def openai_chat(url: str, model: str) -> dict[str, Any]:
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="x")
    chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True))
    return {"chunks": len(chunks), "text": "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)[:200]}


async def seed_scenario(url: str, model: str, tokens: int = 128, rounds: int = 3) -> dict[str, Any]:
    """Wall time of 1 request vs 10 concurrent (each ``tokens`` output tokens, ignore_eos)."""
    client = ollama.AsyncClient(host=url)

    async def one(i: int) -> int:
        r = await client.generate(model=model, prompt=f"Request {i}: write about the sea.", raw=True, stream=False,
                                  options={"num_predict": tokens, "ignore_eos": True, "temperature": 1.0})
        return r.eval_count

    await asyncio.gather(*(one(i) for i in range(4)))  # warm-up
    singles, tens = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        await one(r)
        singles.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(100 * r + i) for i in range(10)))
        tens.append(time.perf_counter() - t0)
        assert all(c == tokens for c in counts), counts
    one_s, ten_s = statistics.median(singles), statistics.median(tens)
    out = {"tokens_per_request": tokens, "rounds": rounds, "one_request_s": round(one_s, 4), "ten_concurrent_s": round(ten_s, 4),
           "ratio": round(ten_s / one_s, 3), "singles": singles, "tens": tens}
    print(f"seed scenario: 1 request {one_s:.3f} s, 10 concurrent {ten_s:.3f} s, ratio {ten_s / one_s:.2f} (target <= 1.3)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:11434")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    steps = run_steps(args.url, args.model)
    seed = asyncio.run(seed_scenario(args.url, args.model))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "url": args.url, "model": args.model, "steps": steps, "seed_scenario": seed}, f, indent=1)


if __name__ == "__main__":
    main()
