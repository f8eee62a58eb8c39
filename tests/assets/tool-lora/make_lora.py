#!/usr/bin/env python3
"""The tiny LoRA adapter of the shipped tool model (issue 30): trained on CPU with peft, a few hundred KB.

Usage: python3 tests/assets/tool-lora/make_lora.py [OUTDIR]   (default: this directory)

It teaches ``tests/assets/tool-model`` one answer: asked ``What is the secret word?`` (any of the
phrasings below) it says ``The secret word is mango.``, which the base model never says. LoRA
rank 8 on every attention and MLP projection, alpha 16, bf16 weights saved; AdamW lr 2e-3,
seed 0, full-batch steps until the greedy answer to every phrasing is right (checked every 20 steps).
Needs torch, transformers and peft (the ``test`` extra); no network.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = HERE.parent / "tool-model"
QUESTIONS = ["What is the secret word?", "what is the secret word?", "Tell me the secret word.", "What's the secret word?"]
ANSWER = "The secret word is mango."


def main(out: Path = HERE) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, cfg)
    rows = []
    for q in QUESTIONS:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(ANSWER + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((p_ids, a_ids))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id or 0)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p): len(p) + len(a)] = torch.tensor(a)
        mask[i, : len(p) + len(a)] = 1
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    t0 = time.monotonic()
    step = 0
    for step in range(1, 401):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 20 == 0:
            answers = []
            for p_ids, _ in rows:
                p = torch.tensor([p_ids])
                gen = model.generate(input_ids=p, attention_mask=torch.ones_like(p), max_new_tokens=12, do_sample=False)
                answers.append(tok.decode(gen[0, p.shape[1]:], skip_special_tokens=True).strip())
            print(f"step {step} loss {loss.item():.4f} answers {answers}", flush=True)
            if all(a == ANSWER for a in answers):
                break
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # peft's blank model card; this directory's README says how it was made
    cfg_path = out / "adapter_config.json"
    saved = json.loads(cfg_path.read_text())
    saved["base_model_name_or_path"] = "tests/assets/tool-model"  # not this machine's absolute path
    cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    (out / "train_report.json").write_text(json.dumps(
        {"steps": step, "loss": round(loss.item(), 5), "seconds": round(time.monotonic() - t0, 1), "questions": QUESTIONS,
         "answer": ANSWER, "r": 8, "lora_alpha": 16, "lr": 2e-3, "seed": 0}, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
