#!/usr/bin/env python3
"""Issue 30's adapter measurements, through vllama with the real ollama client and loadgen's workload.

    python3 benchmarks/adapters_load.py create URL BASE LORA_DIR...   # create-to-first-answer per adapter
    python3 benchmarks/adapters_load.py load URL BASE NAME... [--levels 64,256] [--json PATH]

``create``: for each PEFT directory, ``create_blob`` its files and ``create(model=loraI, from_=BASE,
adapters=...)`` (the first turns LoRA on: vllama restarts vLLM; the others load at run time), then
one generate of one token: the seconds from the first upload to that answer, per adapter.

``load``: at each level c, 4*c raw streamed /api/generate requests (128 random words in, 128 tokens
out with ignore_eos, loadgen's workload), c in flight, first with BASE alone, then with the
requests spread round-robin over BASE and the NAMEs (the adapters) in one mixed stream, so vLLM
batches them together; output tok/s, TTFT and TPOT of each, and the mixed/base ratios.
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


def create(url: str, base: str, dirs: list[str]) -> list[dict]:
    import ollama

    client = ollama.Client(host=url, timeout=1800)
    out = []
    for i, d in enumerate(dirs):
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


async def load(url: str, base: str, names: list[str], levels: list[int], tokens: int) -> list[dict]:
    target = Target.parse(f"vllama=ollama:{url}")
    prompts = PromptFactory(128, seed=0)
    rows = []
    async with make_session() as session:
        for c in levels:
            for label, models in (("base", [base]), ("base+adapters", [base, *names])):
                n = 4 * c
                reqs = []
                for i in range(n):  # round-robin: every batch mixes the base and the adapters
                    wl = Workload(model=models[i % len(models)], output_tokens=tokens, prompt_words=128)
                    reqs.append(request_for(target, wl, prompts()))
                wl = Workload(model=base, output_tokens=tokens, prompt_words=128)
                results, t0, t1, cpu = await run_requests(session, target, wl, reqs, c)
                s = summarize([Run(target, c, results, t1 - t0, cpu)])
                row = {"level": c, "mix": label, "models": models, "ok": s["ok"], "errors": s["errors"],
                       "error_samples": s["error_samples"], "output_tok_s": s["output_tok_s"],
                       "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
            b, m = rows[-2], rows[-1]
            if b["output_tok_s"] and m["output_tok_s"]:
                print(json.dumps({"level": c, "tok_s_ratio_mixed_over_base": round(m["output_tok_s"] / b["output_tok_s"], 3),
                                  "ttft_p50_ms": [b["ttft_ms"].get("p50"), m["ttft_ms"].get("p50")]}), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["create", "load"])
    ap.add_argument("url")
    ap.add_argument("base")
    ap.add_argument("names", nargs="*")
    ap.add_argument("--levels", default="64,256")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    raise_nofile()
    if a.what == "create":
        out = create(a.url, a.base, a.names)
    else:
        out = asyncio.run(load(a.url, a.base, a.names, [int(x) for x in a.levels.split(",")], a.output_tokens))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
