"""Tokens/s of a model with and without a Modelfile ``DRAFT ngram`` (speculative decoding by prompt lookup).

Against a running ``vllama serve`` that launches the model's vLLM: ``ROUNDS`` greedy chats of a
repetitive prompt (n-gram lookup drafts from it) through ``/api/chat``, each ``--tokens`` long, with the
base; then ``POST /api/create`` of ``<base>-ngram`` (``DRAFT ngram``, ``PARAMETER draft_num_predict K``),
which restarts the base's vLLM with ``--speculative-config``; then the same chats through it (``ignore_eos``:
each answer is ``--tokens`` long). Tokens/s is Ollama's ``eval_count / total_duration`` per request (the
whole request: with drafting, vLLM streams several tokens a step, so first-to-last-token time, Ollama's
``eval_duration``, can be near zero for a short answer); the answers are compared
(greedy: speculative decoding must not change them). With ``--vllm-url`` (the model's vLLM, its port in
vllama's ``launched`` log line) vLLM's ``vllm:spec_decode_num_draft_tokens`` and
``..._num_accepted_tokens`` counters give the share of drafted tokens accepted.

    python benchmarks/draft_ngram.py --url http://127.0.0.1:11434 --model toolmodel [--tokens 128] [--rounds 5] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import httpx

PROMPT = ("Copy this list exactly, one item per line, then copy it again: "
          + ", ".join(f"item {i} is the {w} one" for i, w in enumerate(["red", "green", "blue", "yellow"] * 4)))


def run(url: str, model: str, tokens: int, rounds: int) -> tuple[list[float], list[str]]:
    """``rounds`` chats: each one's tokens/s and answer (its ``eval_count`` in :data:`COUNTS`)."""
    rates, answers = [], []
    for _ in range(rounds):
        r = httpx.post(f"{url}/api/chat", timeout=600, json={
            "model": model, "stream": False, "think": False, "messages": [{"role": "user", "content": PROMPT}],
            "options": {"temperature": 0, "num_predict": tokens, "ignore_eos": True}})
        r.raise_for_status()
        body = r.json()
        rates.append(body["eval_count"] / (body["total_duration"] / 1e9))
        COUNTS.append(body["eval_count"])
        answers.append(body["message"]["content"])
    return rates, answers


#: every measured chat's eval_count, in order
COUNTS: list[int] = []


def spec_counters(vllm_url: str | None) -> dict[str, float]:
    if not vllm_url:
        return {}
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name in ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:11434")
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--k", type=int, default=4, help="draft_num_predict: tokens drafted at a time")
    p.add_argument("--vllm-url", help="the model's vLLM, for its speculative-decoding counters")
    a = p.parse_args(argv)
    run(a.url, a.model, 8, 1)  # warm
    base_rates, base_answers = run(a.url, a.model, a.tokens, a.rounds)
    made = f"{a.model}-ngram"
    r = httpx.post(f"{a.url}/api/create", timeout=900, json={
        "model": made, "stream": False, "modelfile": f"FROM {a.model}\nDRAFT ngram\nPARAMETER draft_num_predict {a.k}\n"})
    r.raise_for_status()
    run(a.url, made, 8, 1)  # warm
    before = spec_counters(a.vllm_url)
    spec_rates, spec_answers = run(a.url, made, a.tokens, a.rounds)
    after = spec_counters(a.vllm_url)
    result = {
        "tokens": a.tokens, "rounds": a.rounds, "k": a.k,
        "base_tok_s": [round(x, 1) for x in base_rates], "ngram_tok_s": [round(x, 1) for x in spec_rates],
        "base_median": round(statistics.median(base_rates), 1), "ngram_median": round(statistics.median(spec_rates), 1),
        "speedup": round(statistics.median(spec_rates) / statistics.median(base_rates), 3),
        "same_answers": base_answers == spec_answers, "eval_counts": sorted(set(COUNTS[1:])),
    }
    if before and after:
        drafted = after.get("vllm:spec_decode_num_draft_tokens_total", 0) - before.get("vllm:spec_decode_num_draft_tokens_total", 0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens_total", 0) - before.get("vllm:spec_decode_num_accepted_tokens_total", 0)
        result.update(drafted=drafted, accepted=accepted, acceptance=round(accepted / drafted, 3) if drafted else None)
    httpx.request("DELETE", f"{a.url}/api/delete", json={"model": made}, timeout=60)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
