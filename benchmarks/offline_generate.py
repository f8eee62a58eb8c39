#!/usr/bin/env python3
"""vLLM's offline ``LLM.generate`` on the prompts of a ``vllama batch`` file: the yardstick of
``hop_cost.sh``'s batch phase (issue 28).

Usage: offline_generate.py MODEL BATCH.jsonl [--gpu-memory-utilization 0.85] [--max-model-len 4096]
                           [--max-num-batched-tokens N] [--max-num-seqs N] [--json OUT]

Reads each line's ``body.prompt`` and ``max_tokens`` (``/v1/completions`` lines, as
``hop_report.py prompts`` writes them), builds one ``LLM`` with the same GPU share and context
as the served model (vLLM's other defaults: those of its offline entry point, unless the scheduler's
two limits are given: a control with the server's own, issue 42), and times one
``generate`` call over all prompts (``ignore_eos``, temperature 0). Prints and writes: prompts,
completed, output tokens, load seconds, generate seconds, output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's offline default")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's offline default")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts, max_tokens = [], 128
    with open(args.batch) as f:
        for line in f:
            body = json.loads(line)["body"]
            prompts.append(body["prompt"])
            max_tokens = body.get("max_tokens", body.get("options", {}).get("num_predict", max_tokens))

    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    limits = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                ("max_num_seqs", args.max_num_seqs)) if v}
    llm = LLM(model=args.model, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
              **limits)
    load = time.monotonic() - t0
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    t1 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen = time.monotonic() - t1
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cfg = llm.llm_engine.vllm_config.scheduler_config
    result = {"prompts": len(prompts), "completed": sum(1 for o in outs if o.finished), "output_tokens": tokens,
              "load_s": round(load, 1), "generate_s": round(gen, 2), "output_tok_s": round(tokens / gen, 1),
              "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
