"""LoRA adapters of created models (``ADAPTER``): checked at create time, served by the base model's vLLM.

vLLM serves many LoRA adapters of one base in one batch (``--enable-lora``, ``--max-loras``,
``--max-lora-rank``; PEFT directories), where Ollama loads one per model; a created model with an
adapter is served under its own name by the base's vLLM (requests name the adapter as ``model``).
The limits vLLM starts with are derived from the adapters in ``created.json`` (:func:`lora_plan`),
each a ``--lora-modules`` entry. An adapter created later reaches the running vLLM by the mode
(:func:`adapter_mode`, ``--adapters``): ``launch`` restarts vLLM, drained, with it declared
(:meth:`LoraPlan.declares`; the compile cache is kept); ``runtime`` loads it
(``/v1/load_lora_adapter``, needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` and so one API server),
restarting only when a limit must grow (:meth:`LoraPlan.covers`). Why two modes: ``docs/decisions.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllama_proxy.errors import BadRequest
from .created import CreatedModel
from .launch_spec import vllm_arg
from .model_files import read_safetensors_header
from .modelfile_v033 import speculative_json

#: The ranks vLLM's ``--max-lora-rank`` accepts (vLLM 0.2x ``LoRAConfig``).
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
#: Adapters of one base served in one batch, at least (vLLM's default is 1); more adapters than this
#: raise ``--max-loras`` to the next power of two, so that a create seldom changes the compile cache's key.
MIN_MAX_LORAS = 4
#: ``--adapters`` values: how a created adapter reaches a running vLLM (module docstring).
ADAPTER_MODES = ("launch", "runtime")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LoraPlan:
    """The arguments the created models of one base ask its vLLM to run with: their LoRA adapters, and
    a ``DRAFT``'s speculative decoding (``models/modelfile_v033.py``), both launch options of the base.

    Attributes:
        modules: adapter name -> its directory, loaded at start (``--lora-modules``).
        max_rank: ``--max-lora-rank``.
        max_loras: ``--max-loras`` (adapters in one batch).
        speculative: ``--speculative-config``'s JSON, ``""`` for none; a change always restarts vLLM
            (it has no run-time form).
    """

    modules: dict[str, str] = field(default_factory=dict)
    max_rank: int = 0
    max_loras: int = 0
    speculative: str = ""

    def args(self) -> list[str]:
        """``vllm serve`` arguments (none when no adapter or draft is known)."""
        spec = ["--speculative-config", self.speculative] if self.speculative else []
        if not self.modules:
            return spec
        return ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_rank),
                "--lora-modules", *(f"{n}={p}" for n, p in sorted(self.modules.items())), *spec]

    def covers(self, other: LoraPlan) -> bool:
        """Whether a vLLM started with this plan can load ``other``'s adapters at run time (no restart),
        and runs with its draft."""
        if self.speculative != other.speculative:
            return False
        if not other.modules:
            return True
        return bool(self.modules) and other.max_rank <= self.max_rank and other.max_loras <= self.max_loras

    def declares(self, other: LoraPlan) -> bool:
        """Whether a vLLM started with this plan serves every adapter of ``other`` as launched (``launch``
        mode: no restart): each declared by the same name and path, within this plan's limits. An adapter
        deleted since the start needs no restart (no name of vllama's routes to it)."""
        return self.covers(other) and all(self.modules.get(n) == p for n, p in other.modules.items())

    def needs_restart(self, wanted: LoraPlan, mode: str) -> bool:
        """Whether a vLLM started with this plan must restart to serve ``wanted`` in ``mode``
        (:data:`ADAPTER_MODES`)."""
        return not (self.declares(wanted) if mode == "launch" else self.covers(wanted))


def lora_plan(models: Iterable[CreatedModel], base: str, ranks: dict[str, int] | None = None) -> LoraPlan:
    """The plan for served model ``base`` from the created models whose adapters it serves.

    ``max_rank`` is the smallest vLLM rank at least the largest adapter's (16 at least, so most
    adapters made later fit without a restart); ``max_loras`` is the adapter count rounded up to a
    power of two, at least 4 (both are part of vLLM's compile cache key: they change in steps).
    ``ranks`` (adapter name -> rank) spares reading each ``adapter_config.json``. ``speculative``: the
    draft of the earliest created model of ``base`` that has one (create keeps one draft per base).
    """
    modules: dict[str, str] = {}
    drafts: list[CreatedModel] = []
    for m in models:
        if m.base == base:
            modules.update(m.adapters)
            if m.draft:
                drafts.append(m)
    first = min(drafts, key=lambda m: m.created_at, default=None)
    spec = speculative_json(first.draft, first.draft_num_predict) if first is not None and first.draft else ""
    if not modules:
        return LoraPlan(speculative=spec)
    top = max((ranks or {}).get(n) or adapter_rank(Path(p)) for n, p in modules.items())
    rank = next((r for r in LORA_RANKS if r >= max(top, 16)), LORA_RANKS[-1])
    return LoraPlan(modules, rank, max(MIN_MAX_LORAS, 1 << (len(modules) - 1).bit_length()), spec)


@dataclass(frozen=True)
class AdapterMode:
    """How created adapters reach one model's vLLM, and why (logged when vLLM starts with LoRA).

    Attributes:
        mode: ``"launch"`` or ``"runtime"`` (module docstring).
        why: the reason, for the log and the create's progress line.
    """

    mode: str
    why: str


def adapter_mode(setting: str, vllm_args: Iterable[str]) -> AdapterMode:
    """The mode for a model whose vLLM runs with ``vllm_args`` (its launch spec's, with the API
    servers vllama chose: ``sizing.with_api_servers``), given ``--adapters`` (``auto``, ``launch``,
    ``runtime``).

    ``auto``: ``launch`` when vLLM runs more than one API server, since runtime loading would cut them
    to one; else ``runtime``, which costs nothing then and makes a create answer at once instead of
    after a restart (the numbers: ``docs/decisions.md``).
    """
    if setting in ADAPTER_MODES:
        return AdapterMode(setting, f"--adapters {setting}")
    given = vllm_arg(list(vllm_args), "--api-server-count", "-asc")
    servers = int(given) if given is not None and given.isdigit() else 1
    if servers > 1:
        return AdapterMode("launch", f"auto: vLLM runs {servers} API servers, which runtime loading would cut to one")
    return AdapterMode("runtime", "auto: vLLM runs one API server, so adapters load at run time without a restart")


def adapter_rank(path: Path) -> int:
    """The largest rank in ``adapter_config.json`` (``r`` and any ``rank_pattern``); 0 when unreadable."""
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return 0
    ranks = [cfg.get("r") or 0, *((cfg.get("rank_pattern") or {}).values())]
    return max(int(r) for r in ranks if isinstance(r, (int, float)))


def check_adapter(path: Path, base_config: dict[str, Any], base_root: str) -> int:
    """Check a PEFT LoRA directory against the base model it is to be served with; its rank.

    Raises:
        BadRequest: GGUF (vLLM loads PEFT safetensors), no ``adapter_config.json`` or not LoRA, no
            ``adapter_model.safetensors``, a rank over 512 (vLLM's largest ``--max-lora-rank``), or a
            base that does not match: a ``base_model_name_or_path`` naming another Hugging Face repo,
            a layer past the base's layers, or a LoRA matrix whose input or output size is none of
            the base's projection sizes.
    """
    if any(f.suffix == ".gguf" for f in path.iterdir()):
        raise BadRequest(f"{path.name}: GGUF adapters are not served by vllama (vLLM loads PEFT adapters: "
                         "adapter_config.json + adapter_model.safetensors)")
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        raise BadRequest("the adapter has no readable adapter_config.json (a PEFT LoRA directory is expected)") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise BadRequest(f"the adapter is {cfg.get('peft_type')}, not LoRA: vLLM serves LoRA adapters only")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise BadRequest("the adapter has no adapter_model.safetensors (vLLM loads safetensors adapters)")
    rank = adapter_rank(path)
    if rank > LORA_RANKS[-1]:
        raise BadRequest(f"the adapter's rank {rank} is over vLLM's largest --max-lora-rank ({LORA_RANKS[-1]})")
    named = str(cfg.get("base_model_name_or_path") or "")
    if named.count("/") == 1 and not Path(named).exists() and base_root.count("/") == 1 and not Path(base_root).exists() \
            and named.casefold() != base_root.casefold():
        raise BadRequest(f"base mismatch: the adapter was made for {named}, the model is {base_root}")
    cfg_b = base_config.get("text_config") or base_config
    hidden = cfg_b.get("hidden_size")
    heads, kv = cfg_b.get("num_attention_heads"), cfg_b.get("num_key_value_heads") or cfg_b.get("num_attention_heads")
    head_dim = cfg_b.get("head_dim") or (hidden // heads if hidden and heads else None)
    sizes = {s for s in (hidden, cfg_b.get("intermediate_size"), heads and head_dim and heads * head_dim,
                         kv and head_dim and kv * head_dim, cfg_b.get("moe_intermediate_size")) if s}
    layers = cfg_b.get("num_hidden_layers")
    for name, t in read_safetensors_header(weights).items():
        shape = t.get("shape") or []
        m = _LAYER.search(name)
        if layers and m and int(m.group(1)) >= layers:
            raise BadRequest(f"base mismatch: the adapter has layer {m.group(1)}, the model {layers} layers")
        if sizes and len(shape) == 2:
            outer = shape[1] if "lora_A" in name else shape[0] if "lora_B" in name else None
            if outer is not None and outer not in sizes and not name.endswith(("embed_tokens.lora_A.weight", "lm_head.lora_B.weight")):
                raise BadRequest(f"base mismatch: the adapter's {name} has size {outer}, which none of the model's "
                                 f"projections has ({', '.join(str(s) for s in sorted(sizes))})")
    return rank
