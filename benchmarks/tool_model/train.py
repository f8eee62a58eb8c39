#!/usr/bin/env python3
"""Train a tiny Qwen2 model that really writes hermes tool calls, <think> blocks and JSON (issue 13).

Usage: python3 benchmarks/tool_model/train.py OUT [--minutes 3.5] [--steps N] [--device cuda|cpu]

No network: the byte-level BPE tokenizer is trained on the synthetic corpus itself
(``corpus.py``: ChatML transcripts rendered by the chat template saved with the model), the
model is a transformers ``Qwen2ForCausalLM`` (hidden 384, 6 layers, head_dim 64, tied
embeddings) trained from scratch with plain torch (bf16 autocast on CUDA). The loss covers
the assistant's completion only. Every ``--eval-every`` steps and at the end, greedy
decoding on held-out requests (a different seed) is checked exactly against the expected
completion; training stops early once every category passes. The exit status is 0 only
when the final check reaches ``--min-accuracy`` on the tool calls.

OUT gets what vLLM serves: config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json (with ``chat_template``), plus train_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

EVAL_KINDS = ["call", "result", "plain", "json", "no_tool", "echo"]


def build_tokenizer(out: Path, texts: list[str], vocab: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Qwen2's split: digits one by one (copying numbers is then copying single tokens), then byte-level.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab - 64, special_tokens=corpus.SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in corpus.MARKUP])
    pad = (-tok.get_vocab_size()) % 64
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(pad)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in corpus.SPECIAL + corpus.MARKUP}
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": t in corpus.SPECIAL} for t, i in ids.items()}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "unk_token": None, "model_max_length": 32768, "clean_up_tokenization_spaces": False,
           "errors": "replace", "split_special_tokens": False, "added_tokens_decoder": added,
           "chat_template": corpus.CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return tok, ids


def encode_sample(tok, s: corpus.Sample, im_end: int) -> tuple[list[int], int]:
    """Token ids of prompt + completion + <|im_end|>, and where the completion starts.

    Prompt and completion are encoded apart, as vLLM sees them (the prompt tokenized whole,
    then generated tokens)."""
    prompt = tok.encode(corpus.render(s.messages, s.tools, **s.template_kwargs())).ids
    target = tok.encode(s.target).ids + [im_end]
    return prompt + target, len(prompt)


def make_batch(examples, device):
    import torch

    n = max(len(ids) for ids, _ in examples)
    x = torch.zeros(len(examples), n, dtype=torch.long)
    y = torch.full((len(examples), n), -100, dtype=torch.long)
    att = torch.zeros(len(examples), n, dtype=torch.long)
    for i, (ids, start) in enumerate(examples):
        t = torch.tensor(ids)
        x[i, :len(ids)] = t
        att[i, :len(ids)] = 1
        y[i, start:len(ids)] = t[start:]
    return x.to(device), y.to(device), att.to(device)


def evaluate(model, tok, samples: list[corpus.Sample], ids: dict[str, int], device, batch: int = 64,
             max_new: int = 96) -> dict:
    """Greedy completions of ``samples`` (left-padded batches), exact match per category."""
    import torch

    model.eval()
    pad, eos = ids["<|endoftext|>"], ids["<|im_end|>"]
    per: dict[str, list[int]] = {}
    wrong: list[dict] = []
    for i in range(0, len(samples), batch):
        chunk = samples[i:i + batch]
        prompts = [tok.encode(corpus.render(s.messages, s.tools, **s.template_kwargs())).ids for s in chunk]
        n = max(map(len, prompts))
        x = torch.full((len(chunk), n), pad, dtype=torch.long)
        att = torch.zeros(len(chunk), n, dtype=torch.long)
        for j, p in enumerate(prompts):
            x[j, n - len(p):] = torch.tensor(p)
            att[j, n - len(p):] = 1
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model.generate(input_ids=x.to(device), attention_mask=att.to(device), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for s, row in zip(chunk, out[:, n:].tolist()):
            if eos in row:
                row = row[:row.index(eos)]
            text = tok.decode(row, skip_special_tokens=False)
            ok = text == s.target
            per.setdefault(s.kind, []).append(int(ok))
            if not ok and len(wrong) < 12:
                wrong.append({"kind": s.kind, "want": s.target, "got": text})
    model.train()
    acc = {k: round(sum(v) / len(v), 3) for k, v in per.items()}
    return {"accuracy": acc, "n": {k: len(v) for k, v in per.items()}, "wrong": wrong}


def save(model, tok, ids: dict[str, int], out: Path, tokenizer_dir: Path) -> None:
    """The model as vLLM loads it: bf16 safetensors, config, generation config, tokenizer files."""
    import copy

    import torch

    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.config.dtype = "bfloat16"
    m.save_pretrained(out, safe_serialization=True)
    # Our own generation config: eos <|im_end|> and <|endoftext|>, no sampling defaults.
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
         "pad_token_id": ids["<|endoftext|>"]}, indent=1))
    if (out / "chat_template.jinja").exists():  # transformers 5 may write the template apart; keep one source
        os.remove(out / "chat_template.jinja")
    if out != tokenizer_dir:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (out / f).write_bytes((tokenizer_dir / f).read_bytes())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--minutes", type=float, default=3.5, help="training wall-time budget (excludes the final check)")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--samples", type=int, default=60000, help="training examples generated (cycled)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--eval-n", type=int, default=50, help="held-out requests per category")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    ap.add_argument("--only", choices=EVAL_KINDS + ["plain_tools"], help="train on one kind of example (experiments)")
    ap.add_argument("--init-dir", type=Path, help="also save the untrained model here at once (a pooling server can start on it)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t0 = time.time()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    samples = [corpus.sample(rng, a.only) for _ in range(a.samples)]
    tok_texts = [corpus.render(s.messages, s.tools, **s.template_kwargs()) + s.target for s in samples[:4000]]
    tok, ids = build_tokenizer(a.out, tok_texts, a.vocab)
    vocab = tok.get_vocab_size()
    data = [encode_sample(tok, s, ids["<|im_end|>"]) for s in samples]
    lens = sorted(len(d[0]) for d in data)
    print(f"[{time.time() - t0:5.1f}s] tokenizer {vocab} tokens; {len(data)} examples, tokens/example "
          f"median {lens[len(lens) // 2]} max {lens[-1]}", flush=True)

    erng = random.Random(10_000 + a.seed)  # held out: another stream of the same generators
    held = [corpus.sample(erng, k) for k in ([a.only] if a.only else EVAL_KINDS) for _ in range(a.eval_n)]

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                      use_sliding_window=False, hidden_act="silu", bos_token_id=ids["<|endoftext|>"],
                      eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    cfg.architectures = ["Qwen2ForCausalLM"]
    model = Qwen2ForCausalLM(cfg).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    if a.init_dir:
        save(model, tok, ids, a.init_dir, a.out)
        print(f"[{time.time() - t0:5.1f}s] untrained copy saved to {a.init_dir}", flush=True)
    print(f"[{time.time() - t0:5.1f}s] model {nparams / 1e6:.1f} M params on {device}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")

    def lr_at(step: int) -> float:
        """Warm-up, then cosine to a tenth over the run, whichever of --steps and --minutes ends it."""
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        progress = min(1.0, max(step / a.steps, (time.time() - t_train) / budget))
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    order = list(range(len(data)))
    rng.shuffle(order)
    pos, step, t_train = 0, 0, time.time()
    budget = a.minutes * 60
    report: dict = {"evals": []}
    model.train()
    while step < a.steps:
        if pos + a.batch > len(order):
            rng.shuffle(order)
            pos = 0
        batch = [data[i] for i in order[pos:pos + a.batch]]
        pos += a.batch
        x, y, att = make_batch(batch, device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=x, attention_mask=att, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        elapsed = time.time() - t_train
        if step % 50 == 0 or step == 1:
            print(f"[{time.time() - t0:5.1f}s] step {step} loss {loss.item():.4f} lr {lr_at(step):.2e}", flush=True)
        if step % a.eval_every == 0:
            quick = [s for k in EVAL_KINDS for s in [h for h in held if h.kind == k][:16]]
            ev = evaluate(model, tok, quick, ids, device)
            report["evals"].append({"step": step, "elapsed_s": round(elapsed, 1), **ev["accuracy"]})
            print(f"[{time.time() - t0:5.1f}s] step {step} held-out accuracy {ev['accuracy']}", flush=True)
            if all(v >= 0.99 for v in ev["accuracy"].values()) and step >= 4 * a.eval_every and elapsed > budget / 3:
                print("held-out tool calls and answers all right: stopping early", flush=True)
                break
        if elapsed > budget:
            print(f"time budget {budget:.0f} s reached at step {step}", flush=True)
            break

    final = evaluate(model, tok, held, ids, device)
    print(f"[{time.time() - t0:5.1f}s] final held-out accuracy ({a.eval_n} per category): {final['accuracy']}", flush=True)
    for w in final["wrong"][:6]:
        print(f"  wrong {w['kind']}: want {w['want']!r} got {w['got']!r}", flush=True)

    save(model, tok, ids, a.out, a.out)
    acc_calls = final["accuracy"].get("call", 0.0)
    report.update({"steps": step, "train_s": round(time.time() - t_train, 1), "total_s": round(time.time() - t0, 1),
                   "params": nparams, "vocab": vocab, "device": str(device), "final": final, "args": {
                       k: str(v) for k, v in vars(a).items()}})
    (a.out / "train_report.json").write_text(json.dumps(report, indent=1))
    ok = acc_calls >= a.min_accuracy
    print(f"[{time.time() - t0:5.1f}s] saved {a.out}; exact tool-call JSON {acc_calls:.0%} "
          f"({'PASS' if ok else 'FAIL'} at {a.min_accuracy:.0%})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
