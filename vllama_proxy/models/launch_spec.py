"""A served model's launch spec: one ``[[models]]`` table of the config file, or ``--model``.

(Not vllama's own settings, which are ``settings/``.) Each entry becomes one ``vllm serve`` child (its
own state machine, loopback port and process group); :meth:`ModelConfig.args` is the one builder of
its flags (a library name's reach it as fields and ``vllm_args``, ``models/library.py``). Typed fields
cover what operators set most (GPU memory share, GPUs, context, parsers), anything else goes in
``vllm_args``; policy fields say how vllama treats the model (``keep_alive``, ``preload``,
``sleep_mode``, ``pin``). A commented example: ``deploy/vllama.example.toml``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Set by vllama on every child; never accepted in ``vllm_args``.
RESERVED_VLLM_ARGS = ("--host", "--port", "--served-model-name")

#: vLLM's default ``--gpu-memory-utilization``.
VLLM_DEFAULT_GPU_SHARE = 0.9


def vllm_arg(args: list[str] | tuple[str, ...], *names: str) -> str | None:
    """The value of ``names`` (one flag and its aliases) in ``args`` (``--flag value`` or
    ``--flag=value``), the last one given winning as in vLLM's argparse; else ``None``."""
    found = None
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(name + "="):
                found = a.split("=", 1)[1]
    return found


def has_flag(args: list[str] | tuple[str, ...], name: str) -> bool:
    """Whether ``--name`` (or ``--name=...``) appears in ``args``."""
    return any(a == name or a.startswith(name + "=") for a in args)


def pooling(args: list[str] | tuple[str, ...]) -> bool:
    """Whether ``args`` run vLLM's pooling runner (``--runner pooling``, or the older ``--task embed``)."""
    for i, a in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) else ""
        if (a == "--runner" and nxt == "pooling") or a == "--runner=pooling":
            return True
        if (a == "--task" and nxt in ("embed", "embedding")) or a in ("--task=embed", "--task=embedding"):
            return True
        if (a == "--convert" and nxt == "embed") or a == "--convert=embed":
            return True
    return False


def served_name_for(model: str) -> str:
    """Default served name: a hub id as it is (``Qwen/Qwen2.5-1.5B-Instruct``), a local
    directory by its last component (``/models/qwen`` -> ``qwen``), so Ollama names stay clean."""
    p = Path(model).expanduser()
    return p.name if p.is_dir() else model


class ModelConfig(BaseModel):
    """One served model (a ``[[models]]`` table).

    The ``vllm serve`` command line is ``vllm serve MODEL --host 127.0.0.1 --port P
    --served-model-name NAME`` + the typed fields as vLLM flags + ``vllm_args``
    (vLLM's "Engine arguments" / "serve" CLI reference).

    Raises (as a validation error): unknown keys, ``--host``/``--port``/
    ``--served-model-name`` in ``vllm_args``, or a flag given both as a field and in
    ``vllm_args``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="What vLLM loads: a Hugging Face id or a local directory.")
    name: str | None = Field(None, description="Name vLLM serves it under and clients use (default: the hub id, or the directory's name).")
    aliases: list[str] = Field(default_factory=list, description="More Ollama names for it, e.g. qwen2.5:7b.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of each of its GPUs' memory vLLM may take (vLLM's default 0.9); models whose shares fit run at once."
    )
    gpus: list[int] | None = Field(
        None, description="GPU indices it runs on, as nvidia-smi numbers them (CUDA_VISIBLE_DEVICES); default: the first tensor-parallel-size GPUs."
    )
    tensor_parallel_size: int | None = Field(None, ge=1, description="GPUs per model replica (vLLM --tensor-parallel-size).")
    max_model_len: int | None = Field(None, ge=1, description="Context length in tokens (vLLM --max-model-len).")
    tool_call_parser: str | None = Field(None, description="Enables tool calls with this vLLM parser (--enable-auto-tool-choice --tool-call-parser).")
    reasoning_parser: str | None = Field(None, description="vLLM --reasoning-parser: thinking output for reasoning models.")
    vllm_args: list[str] = Field(default_factory=list, description="Any other `vllm serve` arguments.")
    port: int = Field(0, ge=0, le=65535, description="Loopback port of its vLLM (0: a free one).")
    # --- policy ---------------------------------------------------------------------
    keep_alive: str | None = Field(None, description="Its default keep_alive (default: the server's --keep-alive).")
    preload: bool = Field(True, description="Load when vllama starts (if it fits beside the models before it); else on the first request.")
    sleep_mode: bool | None = Field(
        None, description="On keep-alive expiry, `vllama stop` or eviction, sleep (weights to CPU RAM, fast wake) instead of stopping "
        "vLLM; unset: where vLLM can and host RAM allows (--sleep-on-stop); false: always stop.")
    pin: bool = Field(False, description="Never evicted to make room for another model (its keep_alive still applies).")

    @field_validator("vllm_args")
    @classmethod
    def _no_reserved(cls, args: list[str]) -> list[str]:
        for a in args:
            if a.split("=", 1)[0] in RESERVED_VLLM_ARGS:
                raise ValueError(f"{a.split('=', 1)[0]} is set by vllama (use the model's name/port fields)")
        return args

    @model_validator(mode="after")
    def _no_duplicates(self) -> ModelConfig:
        typed = {
            "--gpu-memory-utilization": self.gpu_memory_utilization,
            "--tensor-parallel-size": self.tensor_parallel_size,
            "--max-model-len": self.max_model_len,
            "--tool-call-parser": self.tool_call_parser,
            "--reasoning-parser": self.reasoning_parser,
        }
        for flag, value in typed.items():
            if value is not None and has_flag(self.vllm_args, flag):
                raise ValueError(f"{flag} is given both as a field and in vllm_args")
        if self.gpus is not None:
            if not self.gpus or len(set(self.gpus)) != len(self.gpus) or min(self.gpus) < 0:
                raise ValueError("gpus must list distinct GPU indices")
            if len(self.gpus) < self.gpu_count_needed():
                raise ValueError(f"gpus lists {len(self.gpus)} GPUs but the model needs {self.gpu_count_needed()} (tensor x pipeline x data parallel)")
        return self

    # -- derived ------------------------------------------------------------------------
    @property
    def served_name(self) -> str:
        """The name vLLM serves (``--served-model-name``)."""
        return self.name or served_name_for(self.model)

    def args(self) -> list[str]:
        """vLLM arguments after ``--served-model-name``: the typed fields as flags, then ``vllm_args``."""
        out: list[str] = []
        if self.gpu_memory_utilization is not None:
            out += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        if self.tensor_parallel_size is not None:
            out += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.max_model_len is not None:
            out += ["--max-model-len", str(self.max_model_len)]
        if self.tool_call_parser is not None:
            if not has_flag(self.vllm_args, "--enable-auto-tool-choice"):
                out.append("--enable-auto-tool-choice")
            out += ["--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser is not None:
            out += ["--reasoning-parser", self.reasoning_parser]
        if self.sleep_mode and not has_flag(self.vllm_args, "--enable-sleep-mode"):
            out.append("--enable-sleep-mode")
        return out + list(self.vllm_args)

    @property
    def sleeps(self) -> bool:
        """Whether vLLM runs in sleep mode (``sleep_mode`` or ``--enable-sleep-mode`` in ``vllm_args``)."""
        return bool(self.sleep_mode) or has_flag(self.vllm_args, "--enable-sleep-mode")

    @property
    def gpu_share(self) -> float:
        """The fraction of each of its GPUs it takes when loaded (``--gpu-memory-utilization``)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        value = vllm_arg(self.vllm_args, "--gpu-memory-utilization")
        return float(value) if value is not None else VLLM_DEFAULT_GPU_SHARE

    def gpu_count_needed(self) -> int:
        """tensor x pipeline x data parallel size: how many GPUs its vLLM occupies."""
        tp = self.tensor_parallel_size or int(vllm_arg(self.vllm_args, "--tensor-parallel-size", "-tp") or 1)
        pp = int(vllm_arg(self.vllm_args, "--pipeline-parallel-size", "-pp") or 1)
        dp = int(vllm_arg(self.vllm_args, "--data-parallel-size", "-dp") or 1)
        return tp * pp * dp

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        """The GPUs whose memory it shares: ``gpus``, else the first ``gpu_count_needed()`` visible ones."""
        return tuple(self.gpus) if self.gpus is not None else tuple(range(self.gpu_count_needed()))

    @property
    def context_length(self) -> int | None:
        """``max_model_len`` as configured (field or ``--max-model-len N``), if a plain integer."""
        if self.max_model_len is not None:
            return self.max_model_len
        value = vllm_arg(self.vllm_args, "--max-model-len")
        return int(value) if value is not None and value.isdigit() else None

    def env(self) -> dict[str, str]:
        """Environment for its child: ``CUDA_VISIBLE_DEVICES`` when ``gpus`` is set, with
        ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so the indices are nvidia-smi's (CUDA's own order
        puts the fastest GPU first)."""
        if self.gpus is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
