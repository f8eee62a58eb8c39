#!/usr/bin/env python3
"""The prefix cache as a side channel between keys, and ``--cache-isolation`` closing it, on a real vLLM.

A "victim" key sends a long prompt (a document, a system prompt); a "probe" key then sends the same
prompt, and a prompt of the same length it never saw. Without isolation the probe's time to first
token (TTFT) tells the two apart: the victim's prompt is a prefix-cache hit (short prefill), the other
a miss. With ``--cache-isolation key`` both are misses for the probe, while the victim's own repeat is
still a hit. Each round uses fresh prompts; TTFT is read from the first SSE chunk of a streamed
``/v1/completions`` (``max_tokens`` 1), and vLLM's ``vllm:prefix_cache_hits`` (through vllama's
``/vllm/metrics``, an admin key) says what it counted.

Run vllama with a keys file holding an admin ``root`` (sk-root) and two users (sk-victim, sk-probe), twice:
``--cache-isolation off`` and the default, and compare the ``probe_seen_over_unseen`` ratios (~1: nothing
learned). Usage:

    python benchmarks/cache_isolation.py --url http://127.0.0.1:11434 --model M [--words 6000] [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import statistics
import time

import httpx


def ttft(client: httpx.Client, url: str, model: str, key: str, prompt: str) -> float:
    """Seconds from sending ``prompt`` to the first SSE event of its answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - t0
    assert first is not None, "no SSE event"
    return first


def hits(client: httpx.Client, url: str) -> float:
    text = client.get(url + "/vllm/metrics", headers={"Authorization": "Bearer sk-root"}).text
    return sum(float(n) for n in re.findall(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:11434")
    ap.add_argument("--model", required=True)
    ap.add_argument("--words", type=int, default=6000, help="words per prompt (a long prefill makes a hit plain)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = []
    with httpx.Client(timeout=600) as c:
        ttft(c, args.url, args.model, "sk-victim", "warm up")
        for _ in range(args.rounds):
            secret, other = ([f"w{secrets.token_hex(3)}" for _ in range(args.words)] for _ in range(2))
            seen, unseen = " ".join(secret), " ".join(other)
            row = {"victim_cold": ttft(c, args.url, args.model, "sk-victim", seen)}
            h = hits(c, args.url)
            row["probe_seen"] = ttft(c, args.url, args.model, "sk-probe", seen)
            row["probe_seen_hits"] = hits(c, args.url) - h
            row["probe_unseen"] = ttft(c, args.url, args.model, "sk-probe", unseen)
            h = hits(c, args.url)
            row["victim_again"] = ttft(c, args.url, args.model, "sk-victim", seen)
            row["victim_again_hits"] = hits(c, args.url) - h
            rows.append(row)
            print(json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary["probe_seen_over_unseen"] = statistics.median(r["probe_seen"] / r["probe_unseen"] for r in rows)
    summary["victim_again_over_cold"] = statistics.median(r["victim_again"] / r["victim_cold"] for r in rows)
    print("median:", json.dumps({k: round(v, 4) for k, v in summary.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
