#!/usr/bin/env python3
"""Models for the on-demand GPU run (issue 22; ``benchmarks/hop_cost.sh ondemand``), placed in a Hugging Face
cache as ``vllama pull`` leaves them.

Usage:
  on_demand_models.py llama OUT --tokenizer-from DIR   random Llama-3.2-1B-shaped weights (hidden 2048,
                                                       16 layers, 32 heads, 8 KV heads, tied embeddings),
                                                       the tokenizer of DIR (make_random_model.py's) with Llama 3's
                                                       <|python_tag|> and <|eom_id|> added (vLLM's llama3_json tool
                                                       parser needs the former)
  on_demand_models.py place SRC HUB REPO               move SRC's files into HUB as REPO's snapshot:
                                                       blobs/<sha256>, snapshots/<commit>/<file> -> blob, refs/main
  on_demand_models.py huge HUB REPO                    a Llama-3.3-70B config and one safetensors file whose
                                                       header claims 70.6 B bf16 parameters (the file holds none):
                                                       what the fit check reads, too big for one GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path


def llama(final: Path, tokenizer_from: Path) -> None:
    """Writes into ``final``.part and renames it when every file is there: a run that fails half-way
    leaves no directory that a later ``[ -d ]`` check or ``place`` takes for a model."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out = final.with_name(final.name + ".part")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    from tokenizers import Tokenizer

    for f in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_from / f, out / f)
    # Llama 3's specials that vLLM's llama3_json tool parser looks up (the real tokenizer has them),
    # then padding to a multiple of 64; the model's vocabulary is the tokenizer's
    tok = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json"))
    tok.add_special_tokens(["<|python_tag|>", "<|eom_id|>"])
    tok.add_special_tokens([f"<|llama_pad_{i}|>" for i in range((-tok.get_vocab_size()) % 64)])
    tok.save(str(out / "tokenizer.json"))
    src = json.loads((tokenizer_from / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
                      bos_token_id=src.get("bos_token_id"), eos_token_id=src.get("eos_token_id"), torch_dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items() if k != "lm_head.weight"}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(1)
    sd = {k: (torch.ones(s, dtype=torch.bfloat16) if k.endswith("norm.weight")
              else (torch.randn(s, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()).contiguous()
          for k, s in shapes.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)
    print(f"llama: {sum(t.numel() for t in sd.values()) / 1e9:.3f} B params -> {final}")


def place(src: Path, hub: Path, repo: str) -> Path:
    """Raises SystemExit when ``src`` lacks ``config.json`` or a ``*.safetensors``:
    vllama's catalog (``vllama_proxy/models/local.py``) skips such a snapshot, so placing it would make
    the name a 404 ("not pulled here") long after the step that failed."""
    names = {f.name for f in src.iterdir()} if src.is_dir() else set()
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise SystemExit(f"place: {src} holds {sorted(names) or 'nothing'}: no config.json and safetensors "
                         f"to place as {repo} (did the step that makes it fail?)")
    d = hub / ("models--" + repo.replace("/", "--"))
    shutil.rmtree(d, ignore_errors=True)  # placed again: the new files only
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snap = d / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (d / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        h = hashlib.sha256()
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        blob = d / "blobs" / h.hexdigest()
        os.replace(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (d / "refs").mkdir(exist_ok=True)
    (d / "refs" / "main").write_text(commit)
    print(f"placed {repo} at {snap}")
    return snap


def huge(hub: Path, repo: str) -> None:
    tmp = hub.parent / "huge-src"
    tmp.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072,
              "vocab_size": 128256, "torch_dtype": "bfloat16", "rope_theta": 500000.0}
    (tmp / "config.json").write_text(json.dumps(config))
    header = json.dumps({"model.weights": {"dtype": "BF16", "shape": [70_553_706_496], "data_offsets": [0, 141_107_412_992]}}).encode()
    (tmp / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    place(tmp, hub, repo)
    tmp.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("llama")
    a.add_argument("out", type=Path)
    a.add_argument("--tokenizer-from", type=Path, required=True)
    p = sub.add_parser("place")
    p.add_argument("src", type=Path)
    p.add_argument("hub", type=Path)
    p.add_argument("repo")
    h = sub.add_parser("huge")
    h.add_argument("hub", type=Path)
    h.add_argument("repo")
    args = ap.parse_args()
    if args.cmd == "llama":
        llama(args.out, args.tokenizer_from)
    elif args.cmd == "place":
        place(args.src, args.hub, args.repo)
        args.src.rmdir()
    else:
        huge(args.hub, args.repo)


if __name__ == "__main__":
    main()
