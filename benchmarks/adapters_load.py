#!/usr/bin/env python3
"""Issues 30 and 42.3's adapter measurements, through vllama with the real ollama client and loadgen's workload.

    python3 benchmarks/adapters_load.py create URL BASE LORA_DIR... [--start I]   # create-to-first-answer per adapter
    python3 benchmarks/adapters_load.py load URL BASE NAME... [--levels 64,256] [--mixes base,mixed] [--tag K=V ...] [--json PATH]
    python3 benchmarks/adapters_load.py table FILE.json...   # rounds of `load` files: the table and the ratio

``create``: for each PEFT directory, ``create_blob`` its files and ``create(model=loraI, from_=BASE,
adapters=...)`` (I from ``--start``; with ``--adapters launch`` each restarts vLLM with the adapter
declared, with ``runtime`` the first turns LoRA on and the others load at run time), then one
generate of one token: the seconds from the first upload to that answer, per adapter, and what
vllama said it did.

``load``: at each level c, ``--requests-per-stream`` (4) * c raw streamed /api/generate requests (128
random words in, 128 tokens out with ignore_eos, loadgen's workload), c in flight: ``base`` with
BASE alone, ``mixed`` with the requests spread round-robin over BASE and the NAMEs (the adapters) in
one stream, so vLLM batches them together; output tok/s, TTFT and TPOT of each. ``--tag`` labels
every row (``round=1 config=launch``) for ``table``.

``table``: the rows of several ``load`` files: per round, output tok/s of each (config, mix), and
the ratio of ``--num`` (``launch/mixed``) over ``--den`` (``nolora/base``) per round, their mean,
and the smallest and largest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import PromptFactory, Run, Target, Workload, make_session, raise_nofile, request_for, run_requests, summarize  # noqa: E402


def create(url: str, base: str, dirs: list[str], start: int = 0) -> list[dict]:
    import ollama

    client = ollama.Client(host=url, timeout=1800)
    out = []
    for i, d in enumerate(dirs, start):
        name = f"lora{i}"
        t0 = time.perf_counter()
        files = {f.name: client.create_blob(f) for f in sorted(Path(d).iterdir()) if f.is_file()}
        t1 = time.perf_counter()
        status = [p.status for p in client.create(model=name, from_=base, adapters=files, stream=True)]
        t2 = time.perf_counter()
        client.generate(model=name, prompt="hello", raw=True, options={"num_predict": 1}, stream=False)
        t3 = time.perf_counter()
        row = {"adapter": name, "upload_s": round(t1 - t0, 3), "create_s": round(t2 - t1, 3), "first_answer_s": round(t3 - t2, 3),
               "create_to_first_answer_s": round(t3 - t0, 3), "status": status}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


async def load(url: str, base: str, names: list[str], levels: list[int], tokens: int, mixes: list[str],
               per_stream: int = 4, tags: dict[str, str] | None = None) -> list[dict]:
    target = Target.parse(f"vllama=ollama:{url}")
    prompts = PromptFactory(128, seed=0)
    rows = []
    chosen = [(label, models) for label, models in (("base", [base]), ("mixed", [base, *names])) if label in mixes]
    async with make_session() as session:
        for c in levels:
            for label, models in chosen:
                n = per_stream * c
                reqs = []
                for i in range(n):  # round-robin: every batch mixes the base and the adapters
                    wl = Workload(model=models[i % len(models)], output_tokens=tokens, prompt_words=128)
                    reqs.append(request_for(target, wl, prompts()))
                wl = Workload(model=base, output_tokens=tokens, prompt_words=128)
                results, t0, t1, cpu = await run_requests(session, target, wl, reqs, c)
                s = summarize([Run(target, c, results, t1 - t0, cpu)])
                row = {**(tags or {}), "level": c, "mix": label, "models": models, "ok": s["ok"], "errors": s["errors"],
                       "error_samples": s["error_samples"], "output_tok_s": s["output_tok_s"],
                       "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
            b, m = rows[-2:] if len(chosen) == 2 else (None, None)
            if b and m and b["output_tok_s"] and m["output_tok_s"]:
                print(json.dumps({"level": c, "tok_s_ratio_mixed_over_base": round(m["output_tok_s"] / b["output_tok_s"], 3),
                                  "ttft_p50_ms": [b["ttft_ms"].get("p50"), m["ttft_ms"].get("p50")]}), flush=True)
    return rows


def table(files: list[str], num: str, den: str) -> list[dict]:
    """Per round and level: tok/s of every (config, mix), and ``num`` over ``den`` (``config/mix``)."""
    rows = [r for f in files for r in json.loads(Path(f).read_text())]
    keys = sorted({f"{r.get('config', '?')}/{r['mix']}" for r in rows})
    out = []
    for level in sorted({r["level"] for r in rows}):
        print(f"\n{level} streams: output tok/s (errors), {num} over {den}")
        print("| round | " + " | ".join(keys) + f" | {num} / {den} |")
        print("|---" * (len(keys) + 2) + "|")
        ratios = []
        for rnd in sorted({str(r.get("round", "?")) for r in rows}):
            got = {f"{r.get('config', '?')}/{r['mix']}": r for r in rows if r["level"] == level and str(r.get("round", "?")) == rnd}
            n, d = got.get(num), got.get(den)
            ratio = n["output_tok_s"] / d["output_tok_s"] if n and d and d["output_tok_s"] else None
            if ratio is not None:
                ratios.append(ratio)
            cells = [f"{got[k]['output_tok_s']:,.0f} ({got[k]['errors']})" if k in got else "" for k in keys]
            print(f"| {rnd} | " + " | ".join(cells) + f" | {'' if ratio is None else f'{ratio:.3f}'} |")
            out.append({"level": level, "round": rnd, **{k: got[k]["output_tok_s"] for k in got}, "ratio": ratio})
        if ratios:
            mean = sum(ratios) / len(ratios)
            print(f"{level} streams: {num} / {den} = {mean:.3f} (mean of {len(ratios)} rounds; {min(ratios):.3f} to {max(ratios):.3f})")
            out.append({"level": level, "ratio_mean": round(mean, 4), "ratio_min": round(min(ratios), 4),
                        "ratio_max": round(max(ratios), 4), "rounds": len(ratios)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["create", "load", "table"])
    ap.add_argument("url", help="vllama's URL (table: a load file)")
    ap.add_argument("base", nargs="?", help="the base model's name (table: a load file)")
    ap.add_argument("names", nargs="*")
    ap.add_argument("--levels", default="64,256")
    ap.add_argument("--mixes", default="base,mixed", help="base: BASE alone; mixed: BASE and the NAMEs round-robin")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--tag", action="append", default=[], help="K=V added to every row (load)")
    ap.add_argument("--start", type=int, default=0, help="create: the first adapter's number (loraI)")
    ap.add_argument("--num", default="launch/mixed")
    ap.add_argument("--den", default="nolora/base")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    raise_nofile()
    if a.what == "create":
        out = create(a.url, a.base, a.names, a.start)
    elif a.what == "table":
        out = table([x for x in (a.url, a.base, *a.names) if x], a.num, a.den)
    else:
        tags = dict(t.split("=", 1) for t in a.tag)
        out = asyncio.run(load(a.url, a.base, a.names, [int(x) for x in a.levels.split(",")], a.output_tokens,
                               a.mixes.split(","), a.requests_per_stream, tags))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
