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

With ``--compare NAME`` (a second served model with the same weights and its own vLLM, e.g. two ``--models``
entries of one directory) the runs alternate instead of following one another: first ``--rounds`` rounds of NAME and
``--model`` before the create (both plain: the A/A control, which shows the two vLLMs run alike), then, after the
create, ``--rounds`` rounds of NAME and ``<model>-ngram``, the order swapped every round, so drift on the machine falls
on both; the speedup is the created model's median over NAME's in the same rounds.

    python benchmarks/draft_ngram.py --url http://127.0.0.1:11434 --model toolmodel [--tokens 128] [--rounds 5] [--k 4]
    python benchmarks/draft_ngram.py --url URL --model qwen-copy --compare qwen-random --tokens 256 --rounds 12 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import httpx

PROMPT = ("Copy this list exactly, one item per line, then copy it again: "
          + ", ".join(f"item {i} is the {w} one" for i, w in enumerate(["red", "green", "blue", "yellow"] * 4)))


def run(url: str, model: str, tokens: int, rounds: int) -> tuple[list[float], list[str]]:
    """``rounds`` chats: each one's tokens/s and answer (its ``eval_count`` in :data:`COUNTS`)."""
    rates, answers = [], []
    for _ in range(rounds):
        rate, answer = chat(url, model, tokens)
        rates.append(rate)
        answers.append(answer)
    return rates, answers


def chat(url: str, model: str, tokens: int) -> tuple[float, str]:
    """One greedy chat of :data:`PROMPT`: ``eval_count / total_duration`` (tokens/s) and the answer."""
    r = httpx.post(f"{url}/api/chat", timeout=600, json={
        "model": model, "stream": False, "think": False, "messages": [{"role": "user", "content": PROMPT}],
        "options": {"temperature": 0, "num_predict": tokens, "ignore_eos": True}})
    r.raise_for_status()
    body = r.json()
    COUNTS.append(body["eval_count"])
    return body["eval_count"] / (body["total_duration"] / 1e9), body["message"]["content"]


def alternate(url: str, first: str, second: str, tokens: int, rounds: int) -> dict[str, tuple[list[float], list[str]]]:
    """``rounds`` rounds of one chat each on ``first`` and ``second``, the order swapped every round."""
    out: dict[str, tuple[list[float], list[str]]] = {first: ([], []), second: ([], [])}
    for i in range(rounds):
        for model in (first, second) if i % 2 == 0 else (second, first):
            rate, answer = chat(url, model, tokens)
            out[model][0].append(rate)
            out[model][1].append(answer)
    return out


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
    p.add_argument("--compare", help="a served model of the same weights on a vLLM of its own: alternate with it")
    p.add_argument("--json", help="write the result there too")
    a = p.parse_args(argv)
    made = f"{a.model}-ngram"
    result: dict[str, object] = {"tokens": a.tokens, "rounds": a.rounds, "k": a.k}
    if a.compare:
        for m in (a.compare, a.model):
            run(a.url, m, 8, 1)  # warm
        aa = alternate(a.url, a.compare, a.model, a.tokens, a.rounds)
        result["aa"] = {m: [round(x, 1) for x in rates] for m, (rates, _) in aa.items()}
        result["aa_ratio"] = round(statistics.median(aa[a.model][0]) / statistics.median(aa[a.compare][0]), 3)
        result["aa_same_answers"] = aa[a.model][1] == aa[a.compare][1]
    else:
        run(a.url, a.model, 8, 1)  # warm
        base_rates, base_answers = run(a.url, a.model, a.tokens, a.rounds)
    t0 = time.monotonic()
    r = httpx.post(f"{a.url}/api/create", timeout=900, json={
        "model": made, "stream": False, "modelfile": f"FROM {a.model}\nDRAFT ngram\nPARAMETER draft_num_predict {a.k}\n"})
    r.raise_for_status()
    result["create_s"] = round(time.monotonic() - t0, 1)
    run(a.url, made, 8, 1)  # warm
    before = spec_counters(a.vllm_url)
    if a.compare:
        ab = alternate(a.url, a.compare, made, a.tokens, a.rounds)
        (base_rates, base_answers), (spec_rates, spec_answers) = ab[a.compare], ab[made]
    else:
        spec_rates, spec_answers = run(a.url, made, a.tokens, a.rounds)
    after = spec_counters(a.vllm_url)
    result.update({
        "base": a.compare or a.model,
        "base_tok_s": [round(x, 1) for x in base_rates], "ngram_tok_s": [round(x, 1) for x in spec_rates],
        "base_median": round(statistics.median(base_rates), 1), "ngram_median": round(statistics.median(spec_rates), 1),
        "speedup": round(statistics.median(spec_rates) / statistics.median(base_rates), 3),
        "same_answers": base_answers == spec_answers, "eval_counts": sorted(set(COUNTS[1:])),
        "answer_head": spec_answers[0][:160],
    })
    if before and after:
        drafted = after.get("vllm:spec_decode_num_draft_tokens_total", 0) - before.get("vllm:spec_decode_num_draft_tokens_total", 0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens_total", 0) - before.get("vllm:spec_decode_num_accepted_tokens_total", 0)
        result.update(drafted=drafted, accepted=accepted, acceptance=round(accepted / drafted, 3) if drafted else None)
    httpx.request("DELETE", f"{a.url}/api/delete", json={"model": made}, timeout=60)
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
