#!/usr/bin/env python3
"""Random LoRA adapters (PEFT layout) for a model directory, made with torch + safetensors (no peft).

Usage: python3 benchmarks/make_random_lora.py MODEL_DIR OUT_DIR [--count 4] [--rank 16]

Writes OUT_DIR/lora<i>/{adapter_config.json, adapter_model.safetensors}: rank ``--rank`` on the
attention projections (q, k, v, o) of every layer, alpha 2*rank, A ~ N(0, 0.02), B ~ N(0, 0.02)
(non-zero, so vLLM really computes the LoRA path), bf16, seed i. For benchmarks/adapters.sh
(issue 30): the weights mean nothing, the cost of serving them is what is measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def make(model_dir: Path, out: Path, seed: int, rank: int) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    outs = {"q_proj": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim, "o_proj": hidden}
    ins = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": heads * head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj in outs:
            p = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{p}.lora_A.weight"] = (torch.randn(rank, ins[proj], generator=g) * 0.02).to(torch.bfloat16)
            tensors[f"{p}.lora_B.weight"] = (torch.randn(outs[proj], rank, generator=g) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(outs), "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args()
    for i in range(a.count):
        d = make(a.model, a.out / f"lora{i}", i, a.rank)
        print(d, (d / "adapter_model.safetensors").stat().st_size, "bytes")


if __name__ == "__main__":
    main()
