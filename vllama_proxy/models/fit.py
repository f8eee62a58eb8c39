"""Fit before start: will a model's vLLM fit in the GPU memory it would get?

vLLM exits at start when less than ``--gpu-memory-utilization`` x the GPU is free, or when its KV cache
cannot hold one request of ``--max-model-len``: under a supervisor, a crash loop. This module computes the
same sums from the model's own files first (per GPU: weights / (tp x pp) + KV bytes per token / (tp x pp)
x context + overhead). Invariant: **the estimate is a floor**: a model refused here cannot start with its
arguments; where the files leave the sum open (MLA, sliding windows, hybrid layers, activations) the
smaller reading is taken and said in :attr:`Estimate.notes` (each reading: ``docs/decisions.md``). Pure
functions: the only I/O is ``config.json`` and safetensors headers (:func:`read_shape`); GPU numbers are
passed in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .launch_spec import vllm_arg
from .model_files import _load_json, read_safetensors_header

GiB = 1 << 30

#: vLLM's memory beyond weights and KV cache on one GPU: peak activations of its profiling run,
#: CUDA graphs, and "non-torch" memory (NCCL, cuBLAS workspaces), as measured on an H200
#: (``docs/decisions.md``, "The fit check is a floor"). The CUDA context itself is outside the
#: utilization (the pool's ``--gpu-context-share``).
OVERHEAD_BYTES = int(0.9 * GiB)

#: Bits per weight of a 4-bit AWQ/GPTQ checkpoint with group size 128: 4 bits, plus a 16-bit
#: scale and a 4-bit zero point per group of 128 (AutoAWQ's and GPTQ's defaults). Embeddings,
#: the output head and 1-D tensors (norms, biases) stay 16-bit, as in those checkpoints:
#: Qwen2.5-7B-Instruct is 15.2 GB in bf16 and 5.6 GB as Qwen2.5-7B-Instruct-AWQ.
QUANT_4BIT_BITS = 4 + (16 + 4) / 128

#: Contexts suggested in advice are multiples of this.
CONTEXT_STEP = 1024

_FLOAT = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_STORED = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
           "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "E4M3": 1, "E5M2": 1, "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75}
_TORCH_DTYPES = {"bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2, "float32": 4, "float": 4, "fp32": 4}
#: vLLM's keys for the longest sequence in a HF config (``_get_and_verify_max_len``).
_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
             "max_sequence_length", "max_seq_length", "seq_len")
_UNQUANTIZED = ("embed", "lm_head", "wte", "wpe", "output.weight")


@dataclass(frozen=True)
class ModelShape:
    """What the model's files say about its size (from :func:`read_shape`).

    Attributes:
        config: ``config.json``.
        float_elements: elements of floating-point tensors (loaded in the model's dtype).
        quantizable_elements: of those, the ones a 4-bit quantization shrinks (2-D or more,
            not embeddings or the output head).
        stored_bytes: bytes of the other tensors (packed integers, fp8), loaded as stored.
        files: the weight files counted.
    """

    config: dict[str, Any]
    float_elements: int = 0
    quantizable_elements: int = 0
    stored_bytes: int = 0
    files: tuple[str, ...] = ()

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config: ``text_config`` / ``llm_config`` of a multi-modal model, else the config."""
        for key in ("text_config", "llm_config", "language_config"):
            sub = self.config.get(key)
            if isinstance(sub, dict) and sub.get("num_hidden_layers"):
                return sub
        return self.config

    @property
    def quantized(self) -> bool:
        """A quantized checkpoint (``quantization_config``) or one with packed/8-bit tensors."""
        return bool(self.config.get("quantization_config") or self.text_config.get("quantization_config")) or self.stored_bytes > 0


def weight_files(model_dir: Path) -> list[Path]:
    """The files vLLM loads weights from: those named by ``model.safetensors.index.json``, else
    ``model*.safetensors``, else every ``*.safetensors`` (a Mistral repo's ``consolidated``
    copy is skipped when the HF-format files exist), else ``*.bin`` / ``*.pt``."""
    index = _load_json(model_dir / "model.safetensors.index.json").get("weight_map")
    if isinstance(index, dict) and index:
        named = [model_dir / f for f in sorted(set(index.values())) if (model_dir / f).is_file()]
        if named:
            return named
    st = sorted(f for f in model_dir.glob("*.safetensors") if f.is_file())
    hf = [f for f in st if f.name.startswith("model")]
    if hf or st:
        return hf or st
    return sorted(f for f in model_dir.iterdir() if f.suffix in (".bin", ".pt") and f.is_file() and "training_args" not in f.name)


def read_shape(model_dir: Path | None) -> ModelShape | None:
    """Read ``config.json`` and the weight files' headers of ``model_dir``; ``None`` when there are
    no weights to count (not downloaded yet: vLLM fetches them at start) or no config."""
    if model_dir is None or not model_dir.is_dir():
        return None
    config = _load_json(model_dir / "config.json")
    files = weight_files(model_dir)
    if not config or not files:
        return None
    floats = quantizable = stored = 0
    for f in files:
        if f.suffix != ".safetensors":
            stored += f.stat().st_size  # pickled tensors: no header to read; the file size is close
            continue
        for name, t in read_safetensors_header(f).items():
            shape = t.get("shape") or []
            n = math.prod(shape)
            dtype = str(t.get("dtype", "")).upper()
            if dtype in _FLOAT:
                floats += n
                if len(shape) >= 2 and not any(k in name for k in _UNQUANTIZED):
                    quantizable += n
            elif dtype in _STORED:
                stored += math.ceil(n * _STORED[dtype])
            else:  # an unknown dtype: the bytes it takes in the file
                offsets = t.get("data_offsets") or [0, 0]
                stored += int(offsets[1]) - int(offsets[0])
    if floats == 0 and stored == 0:
        return None
    return ModelShape(config=config, float_elements=floats, quantizable_elements=quantizable, stored_bytes=stored,
                      files=tuple(f.name for f in files))


@dataclass(frozen=True)
class Estimate:
    """What one GPU of the model holds once vLLM runs (bytes; per GPU after tensor/pipeline splits).

    Attributes:
        weights: the weights' share.
        kv_per_token: KV cache bytes per token of context.
        context: tokens vLLM must hold for one request (``--max-model-len`` or the config's).
        overhead: activations, CUDA graphs, non-torch memory (:data:`OVERHEAD_BYTES`).
        quantized_weights: the weights of a 4-bit quantized checkpoint of the same model
            (``None`` when it already is quantized).
        split: tensor × pipeline parallel GPUs the weights are divided over.
        notes: where the estimate is a floor (MLA, sliding windows, hybrid layers, no context).
    """

    weights: int
    kv_per_token: int
    context: int
    overhead: int = OVERHEAD_BYTES
    quantized_weights: int | None = None
    split: int = 1
    notes: tuple[str, ...] = ()

    @property
    def kv(self) -> int:
        """KV cache for one request of :attr:`context` tokens."""
        return self.kv_per_token * self.context

    @property
    def needed(self) -> int:
        """Weights + KV cache + overhead."""
        return self.weights + self.kv + self.overhead

    def describe(self) -> str:
        """``24.1 GiB (weights 15.2 GiB + KV cache for 32,768 tokens 8.0 GiB + overhead 0.9 GiB)``."""
        return (f"{gib(self.needed)} (weights {gib(self.weights)} + KV cache for {self.context:,} tokens "
                f"{gib(self.kv)} + overhead {gib(self.overhead)})")

    def max_context(self, budget: int) -> int:
        """The longest context (a multiple of :data:`CONTEXT_STEP`) whose KV cache fits in ``budget``
        beside the weights and overhead; 0 when not even one step does."""
        if self.kv_per_token <= 0:
            return 0
        tokens = (budget - self.weights - self.overhead) // self.kv_per_token
        return max(0, int(tokens) // CONTEXT_STEP * CONTEXT_STEP)


def gib(n: float) -> str:
    """Bytes as ``15.2 GiB``."""
    return f"{n / GiB:.1f} GiB"


def parse_tokens(text: str | None) -> int | None:
    """A ``--max-model-len`` value as vLLM reads it: ``32768``, ``32k`` (×1000), ``32K`` (×1024),
    ``1m``/``1M``; ``None`` for ``auto``, ``-1`` or anything else (vLLM then sizes it to fit)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        return None
    number, suffix = float(m.group(1)), m.group(2)
    scale = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}[suffix]
    value = int(number * scale)
    return value if value > 0 else None


def config_context(config: dict[str, Any]) -> int | None:
    """The context vLLM derives from a (text) config: the smallest of the length keys, scaled by
    ``rope_scaling``'s factor unless its type keeps the length (``llama3``, ``longrope``, ``su``,
    ``mrope``, ``default``); yarn scales ``original_max_position_embeddings``."""
    lengths = [int(config[k]) for k in _LEN_KEYS if isinstance(config.get(k), (int, float)) and config[k] > 0]
    if not lengths:
        return None
    length = min(lengths)
    rope = config.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("factor"), (int, float)):
        kind = rope.get("rope_type") or rope.get("type")
        if kind not in ("su", "longrope", "llama3", "mrope", "default", None):
            if kind == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
                length = rope["original_max_position_embeddings"]
            length = int(length * rope["factor"])
    return length


def _dtype_bytes(vllm_args: Sequence[str]) -> int:
    """Bytes per element of the dtype vLLM runs the model in: ``--dtype``, else 2 (vLLM's ``auto``
    keeps a 16-bit config's dtype and runs an fp32 config in 16 bits)."""
    arg = vllm_arg(list(vllm_args), "--dtype")
    if arg and arg != "auto":
        return _TORCH_DTYPES.get(arg.lower(), 2)
    return 2


def _kv_dtype_bytes(vllm_args: Sequence[str], model_bytes: int) -> int:
    arg = (vllm_arg(list(vllm_args), "--kv-cache-dtype") or "auto").lower()
    if arg.startswith("fp8") or arg.startswith("int8"):
        return 1
    return _TORCH_DTYPES.get(arg, model_bytes)


def _attention_layers(cfg: dict[str, Any], context: int, notes: list[str]) -> float:
    """Layers' worth of full-context KV cache: sliding-window layers count ``window / context``
    of a layer, Mamba / linear-attention layers none."""
    layers = int(cfg.get("num_hidden_layers") or 0)
    window = cfg.get("sliding_window")
    window_share = min(1.0, window / context) if isinstance(window, int) and window > 0 and context > 0 else 1.0
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        full = sum(1 for t in types if isinstance(t, str) and "attention" in t and "sliding" not in t and "linear" not in t)
        sliding = sum(1 for t in types if isinstance(t, str) and "sliding" in t)
        if full + sliding < len(types):
            notes.append("only its attention layers hold KV cache (hybrid model)")
        if sliding:
            notes.append(f"{sliding} sliding-window layers counted at {window} tokens")
        return full + sliding * window_share
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        notes.append("only its attention layers hold KV cache (hybrid model)")
        return pattern.count("*")
    period = cfg.get("attn_layer_period")
    if isinstance(period, int) and period > 0:
        notes.append("only its attention layers hold KV cache (hybrid model)")
        return math.ceil(layers / period)
    if window_share < 1.0 and cfg.get("use_sliding_window") is not False:
        notes.append(f"every layer counted at its sliding window of {window} tokens (a floor)")
        return layers * window_share
    return layers


def estimate(shape: ModelShape, vllm_args: Sequence[str] = (), *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
             context: int | None = None) -> Estimate:
    """Estimate one GPU's share of ``shape`` run by vLLM with ``vllm_args`` (see the module's doc).

    Args:
        shape: the model's files (:func:`read_shape`).
        vllm_args: its vLLM arguments (``--max-model-len``, ``--dtype``, ``--kv-cache-dtype``,
            ``--quantization``, ``--cpu-offload-gb``, ``--kv-cache-memory``).
        tensor_parallel: ``--tensor-parallel-size``.
        pipeline_parallel: ``--pipeline-parallel-size``.
        context: the context to size for, instead of the one the arguments or config give.
    """
    args = list(vllm_args)
    notes: list[str] = []
    tp, pp = max(1, tensor_parallel), max(1, pipeline_parallel)
    split = tp * pp
    cfg = shape.text_config
    dtype = _dtype_bytes(args)
    online = (vllm_arg(args, "--quantization", "-q") or "").lower()
    quant_bytes = {"fp8": 1.0, "ptpc_fp8": 1.0, "fbgemm_fp8": 1.0, "bitsandbytes": 0.5}.get(online)
    if online and quant_bytes is None and not shape.quantized:
        quant_bytes = QUANT_4BIT_BITS / 8  # an online quantization we do not know: the smallest plausible
    if quant_bytes is not None and not shape.quantized:
        total = (shape.float_elements - shape.quantizable_elements) * dtype + shape.quantizable_elements * quant_bytes
    else:
        total = shape.float_elements * dtype
    total += shape.stored_bytes
    offload = vllm_arg(args, "--cpu-offload-gb")
    try:
        total = max(0, total - int(float(offload or 0) * GiB))
    except ValueError:
        pass
    quantized = None
    if not shape.quantized and not online:
        quantized = math.ceil(((shape.float_elements - shape.quantizable_elements) * dtype
                               + shape.quantizable_elements * QUANT_4BIT_BITS / 8 + shape.stored_bytes) / split)

    if context is None:
        max_len = vllm_arg(args, "--max-model-len")
        if vllm_arg(args, "--kv-cache-memory") is not None:
            notes.append("KV cache set by --kv-cache-memory: not counted")
        elif max_len is not None:
            context = parse_tokens(max_len)
            if context is None:
                notes.append(f"--max-model-len {max_len}: vLLM sizes the context to the memory, not counted")
        else:
            context = config_context(cfg)
            if context is None:
                notes.append("context length unknown from config.json: not counted")
        context = context or 0

    kv_bytes = _kv_dtype_bytes(args, dtype)
    if isinstance(cfg.get("kv_lora_rank"), int):  # MLA: one compressed latent per layer, on every TP rank
        layers = int(cfg.get("num_hidden_layers") or 0)
        per_token = layers * (cfg["kv_lora_rank"] + int(cfg.get("qk_rope_head_dim") or 0)) * kv_bytes / pp
        notes.append("MLA: one latent per layer and token, replicated on each tensor-parallel GPU")
    else:
        heads = int(cfg.get("num_attention_heads") or 0)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0)
        per_gpu_heads = max(1, kv_heads // tp) if kv_heads else 0
        layers = _attention_layers(cfg, context, notes) if context else int(cfg.get("num_hidden_layers") or 0)
        per_token = 2 * layers * per_gpu_heads * int(head_dim) * kv_bytes / pp
        if not per_token:
            notes.append("KV cache size unknown from config.json: not counted")
    return Estimate(weights=math.ceil(total / split), kv_per_token=math.ceil(per_token), context=context,
                    quantized_weights=quantized, split=split, notes=tuple(notes))


@dataclass(frozen=True)
class GpuRoom:
    """One GPU as the model would find it (bytes).

    Attributes:
        index: its number (nvidia-smi order), or its UUID as ``CUDA_VISIBLE_DEVICES`` names it.
        total: its memory.
        free: free now (NVML).
        reclaimable: what unloading the models that may be evicted for this one would add.
        context: the model's own CUDA context, outside ``--gpu-memory-utilization`` (0 when it
            already holds one: a sleeping vLLM).
    """

    index: int | str
    total: int
    free: int
    reclaimable: int = 0
    context: int = 0

    @property
    def room(self) -> int:
        """Free memory vLLM would see at start once idle models are unloaded (after its own context)."""
        return max(0, min(self.total, self.free + self.reclaimable) - self.context)


@dataclass(frozen=True)
class FitReport:
    """The verdict for one model on its GPUs, with the numbers and the advice.

    Attributes:
        model: its served name.
        estimate: what one GPU of it needs.
        utilization: its ``--gpu-memory-utilization``.
        gpus: its GPUs as found.
        fits: whether it fits on every one of them.
        max_context: the longest context that would fit (0: none; only when it does not fit).
        utilization_range: the ``gpu_memory_utilization`` values with which it would fit, if any.
        quantized_fits: a 4-bit quantized checkpoint of it would fit.
        unload: models (of those passed in) whose unloading would make room.
    """

    model: str
    estimate: Estimate
    utilization: float
    gpus: tuple[GpuRoom, ...]
    fits: bool
    max_context: int = 0
    utilization_range: tuple[float, float] | None = None
    quantized_fits: bool = False
    unload: tuple[tuple[str, int], ...] = ()
    tensor_parallel: int = 0
    notes: tuple[str, ...] = field(default=())

    def budget(self, g: GpuRoom) -> int:
        """What ``--gpu-memory-utilization`` gives it of ``g``."""
        return int(self.utilization * g.total)

    def _fits_on(self, g: GpuRoom) -> bool:
        return self.estimate.needed <= self.budget(g) <= g.room

    @property
    def tightest(self) -> GpuRoom:
        """The GPU it fits worst on (of those it does not fit on, if any)."""
        short = [g for g in self.gpus if not self._fits_on(g)] or list(self.gpus)
        return min(short, key=lambda g: min(self.budget(g), g.room) - self.estimate.needed)

    @property
    def required(self) -> int:
        """What it takes of its tightest GPU: its needs, or its whole share when vLLM would find
        less than that free (vLLM reserves the share at start, whatever the model needs)."""
        g = self.tightest
        return max(self.estimate.needed, self.budget(g)) if self.budget(g) > g.room else self.estimate.needed

    @property
    def available(self) -> int:
        """What it would get on its tightest GPU: its share, or the free room when that is less."""
        g = self.tightest
        return min(self.budget(g), g.room)

    def message(self) -> str:
        """One line for ``last_error`` and the client: the numbers, then what would fit."""
        g = self.tightest
        e = self.estimate
        free = f"{gib(g.free)} free"
        if g.reclaimable:
            free += f", {gib(min(g.total, g.free + g.reclaimable))} once idle models are unloaded"
        if self.budget(g) > g.room:
            why = (f"vLLM takes gpu_memory_utilization {self.utilization:g} × {gib(g.total)} = {gib(self.budget(g))} "
                   f"of GPU {g.index} at start, which has {free}")
        else:
            why = (f"gpu_memory_utilization {self.utilization:g} × {gib(g.total)} gives it {gib(self.budget(g))} "
                   f"of GPU {g.index} ({free})")
        text = (f"model '{self.model}' requires more GPU memory ({gib(self.required)}) than is available ({gib(self.available)}): "
                f"it needs {e.describe()}{' per GPU' if e.split > 1 else ''}, but {why}")
        advice = self.advice()
        text += f"; it would fit {', or '.join(advice)}" if advice else "; it does not fit on these GPUs with any setting vllama knows"
        if self.notes:
            text += f" (estimate is a floor: {'; '.join(self.notes)})"
        return text

    def advice(self) -> list[str]:
        """What would fit, in words (empty: nothing found)."""
        out = []
        if self.utilization_range is not None:
            lo, hi = self.utilization_range
            out.append(f"with gpu_memory_utilization {lo:g}" if lo == hi else f"with gpu_memory_utilization between {lo:g} and {hi:g}")
        if self.max_context:
            at = ""
            low = self.lowest_room_share()
            if low < self.utilization:
                at = f" and gpu_memory_utilization {low:g}"
            out.append(f"with max_model_len ≤ {self.max_context}{at}")
        if self.quantized_fits and self.estimate.quantized_weights is not None:
            out.append(f"as a 4-bit quantized tag (AWQ/GPTQ: weights ~{gib(self.estimate.quantized_weights)})")
        if self.unload:
            out.append("after unloading " + " and ".join(f"'{n}' ({gib(b)})" for n, b in self.unload))
        if self.tensor_parallel:
            out.append(f"on {self.tensor_parallel} GPUs (tensor_parallel_size {self.tensor_parallel})")
        return out

    def lowest_room_share(self) -> float:
        """The largest utilization (2 decimals) every GPU has free room for."""
        return math.floor(min(g.room / g.total for g in self.gpus) * 100) / 100


def check(model: str, est: Estimate, utilization: float, gpus: Iterable[GpuRoom],
          unloadable: Sequence[tuple[str, dict[int | str, int]]] = ()) -> FitReport:
    """Whether ``est`` fits on ``gpus`` at ``utilization``, and what would fit if not.

    It fits on a GPU when vLLM's two start-up checks pass: the free memory it sees
    (:attr:`GpuRoom.room`) is at least ``utilization`` × total, and the weights, one request's
    KV cache and the overhead fit in that share.

    Args:
        model: its served name (for the message).
        est: :func:`estimate`.
        utilization: its ``--gpu-memory-utilization``.
        gpus: its GPUs.
        unloadable: loaded models that are not unloaded for it by themselves (pinned): name and
            bytes held on each GPU index; advice names the fewest whose unloading would do.
    """
    rooms = tuple(gpus)
    report = FitReport(model, est, utilization, rooms, True, notes=est.notes)
    fits = all(report._fits_on(g) for g in rooms)
    if fits or not rooms:
        return report
    room_share = report.lowest_room_share()
    usable = min(utilization, room_share)
    # a utilization that would hold it and that the GPUs have room for
    lo = math.ceil(max(est.needed / g.total for g in rooms) * 100) / 100
    util_range = (lo, room_share) if lo <= room_share and lo <= 1 else None
    budget = min(int(usable * g.total) for g in rooms)
    max_ctx = est.max_context(budget) if est.context else 0
    max_ctx = max_ctx if 0 < max_ctx < est.context else 0
    quantized_fits = est.quantized_weights is not None and est.needed - est.weights + est.quantized_weights <= budget
    unload = _unload_advice(est, utilization, rooms, unloadable)
    tp = 0
    if est.split == 1 and not util_range and not max_ctx:
        for n in (2, 4, 8):
            per = math.ceil(est.weights / n) + est.kv // n + est.overhead
            if all(per <= int(utilization * g.total) for g in rooms):
                tp = n
                break
    return FitReport(model, est, utilization, rooms, False, max_ctx, util_range, quantized_fits, unload, tp, est.notes)


def _unload_advice(est: Estimate, utilization: float, rooms: tuple[GpuRoom, ...],
                   unloadable: Sequence[tuple[str, dict[int | str, int]]]) -> tuple[tuple[str, int], ...]:
    """The fewest of ``unloadable`` (one, else the largest first) whose memory makes it fit."""
    if not unloadable or any(est.needed > int(utilization * g.total) for g in rooms):
        return ()

    def fits_after(chosen: Sequence[tuple[str, dict[int | str, int]]]) -> bool:
        return all(int(utilization * g.total) <= max(0, min(g.total, g.free + g.reclaimable + sum(h.get(g.index, 0) for _, h in chosen)) - g.context)
                   for g in rooms)

    def held(item: tuple[str, dict[int | str, int]]) -> int:
        return sum(item[1].get(g.index, 0) for g in rooms)

    singles = sorted((u for u in unloadable if fits_after([u])), key=held)
    if singles:
        chosen = [singles[0]]
    else:
        chosen = []
        for u in sorted(unloadable, key=held, reverse=True):
            chosen.append(u)
            if fits_after(chosen):
                break
        else:
            return ()
    return tuple((n, max(h.values(), default=0)) for n, h in chosen)
