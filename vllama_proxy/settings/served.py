"""What vllama serves: the models it launches or the upstream it proxies (``Served``), how long
they stay loaded (``ModelLifetime``), which may start on demand and be evicted (``OnDemandPolicy``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from vllama_proxy.models.launch_spec import ModelConfig


def duration(value: str) -> str:
    """``value`` if it is an Ollama keep_alive (seconds or a Go duration), else ValueError saying so."""
    from vllama_proxy.errors import BadRequest
    from vllama_proxy.models.keep_alive import parse_keep_alive

    try:
        parse_keep_alive(value, default=300.0)
    except BadRequest:
        raise ValueError(f"{value!r} is not a duration (seconds, or like 5m, 1h30m, -1 for forever)") from None
    return value


def default_state_dir() -> Path:
    """Where vllama keeps what it writes (aliases from ``/api/copy``): systemd's
    ``$STATE_DIRECTORY``, else ``$XDG_STATE_HOME/vllama``, else ``~/.local/state/vllama``."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "vllama"


class Served(BaseModel):
    """What it serves: the models vllama launches, an upstream it proxies, on-demand models."""

    config: Path | None = Field(
        None,
        description="TOML file with settings (by field name) and [[models]] tables, one per served model "
        "(see deploy/vllama.example.toml); VLLAMA_CONFIG works too.",
    )
    models: list[ModelConfig] = Field(
        default_factory=list,
        description="Models to serve, one vLLM each (the config file's [[models]]; --model is the one-model shorthand).",
    )
    upstream: str | None = Field(
        None,
        description="URL of an already-running vLLM OpenAI server to proxy (no supervisor), e.g. http://127.0.0.1:8000.",
    )
    model: str | None = Field(
        None,
        description="Model for the supervisor to serve with `vllm serve`: an Ollama library name (qwen2.5:7b, llama3.2; "
        "see docs/library.md), a Hugging Face id or a local directory.",
    )
    served_model_name: str | None = Field(
        None,
        description="Name vLLM serves the model under (default: the library name or hub id as given, or a local directory's name).",
    )
    library: Path | None = Field(
        None,
        description="Your own library file (Ollama names -> Hugging Face repos, the packaged table's schema): its rows "
        "add names or replace packaged rows of the same name (default: <state-dir>/library.toml when it exists; "
        "see docs/library.md).",
    )
    on_demand: bool = Field(
        True,
        description="Start a local model (pulled into the Hugging Face cache) the first time a request names it, as Ollama "
        "does, with its library name's vLLM arguments; off: only --model / [[models]] are served.",
    )
    on_demand_models: list[str] = Field(
        default_factory=list,
        description="Allow-list for on-demand models: names or shell patterns (qwen2.5:*, Qwen/*), repeatable "
        "(empty: any local model).",
    )
    max_on_demand: int | None = Field(
        None, ge=1,
        description="On-demand models loaded or asleep at once (default: 3 per GPU, Ollama's OLLAMA_MAX_LOADED_MODELS); "
        "the least recently used idle one is unloaded for the next.",
    )
    alias: dict[str, str] = Field(
        default_factory=dict,
        description="Ollama names for served models, NAME=SERVED (repeatable), e.g. qwen2.5:1.5b=Qwen/Qwen2.5-1.5B-Instruct.",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="Arguments after `--`: passed to `vllm serve`, and read for capabilities (tools, pooling, reasoning) also with --upstream.",
    )
    api_key_upstream: str | None = Field(
        None,
        description="Bearer token vLLM expects (its --api-key), sent on every upstream request.",
    )

    @field_validator("upstream")
    @classmethod
    def _strip_slash(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError("upstream must be an http:// or https:// URL")
        return v.rstrip("/")



class ModelLifetime(BaseModel):
    """How long models stay loaded, sleep, and where vllama keeps its state."""

    keep_alive: str = Field(
        "5m",
        description="How long a model stays loaded after a request (Ollama's keep_alive: duration or seconds, negative = forever); "
        "then it sleeps (sleep mode: --sleep-on-stop) or vLLM stops. OLLAMA_KEEP_ALIVE is honoured; "
        "write negative durations as --keep-alive=-1m.",
    )
    load_timeout: float = Field(
        600.0, gt=0, description="Seconds a request waits for a sleeping or unloaded model to come back (including the wait for idle models to make room)."
    )
    gpu_context_share: float = Field(
        0.01,
        ge=0,
        lt=0.5,
        description="Share of a GPU each model's vLLM holds beyond its gpu_memory_utilization, loaded or asleep (CUDA context: "
        "~0.6 GiB loaded, ~1.4 GiB asleep on an H200); counted when fitting several models on a GPU. "
        "On smaller GPUs use about 1.5 GiB / the GPU's memory (0.02 for 80 GB).",
    )
    sleep_host_memory_reserve: int = Field(
        4 * 1024**3,
        ge=0,
        description="Bytes of host RAM that must stay free beyond a model's weights for it to sleep; with less, vLLM is stopped instead.",
    )
    sleep_on_stop: bool = Field(
        True,
        description="Models launched for --model or [[models]] (unless sleep_mode says) run with vLLM's sleep mode when vLLM runs "
        "on a GPU and free host RAM holds their weights plus --sleep-host-memory-reserve, as on-demand models do: `vllama stop` "
        "and keep_alive's end then put vLLM to sleep (GPU memory freed but its CUDA context; back in about a second) "
        "instead of stopping it (decided and logged per model); off: they stop.",
    )
    sleep_unload_after: str = Field(
        "30m",
        description="How long a model sleeps before its vLLM is stopped for real (its weights leave host RAM, its CUDA context "
        "the GPU); duration or seconds, negative = never.",
    )
    state_dir: Path = Field(
        default_factory=default_state_dir,
        description="Directory for vllama's own state (aliases made with /api/copy); default $STATE_DIRECTORY or ~/.local/state/vllama.",
    )
    allowed_media_domains: list[str] = Field(
        default_factory=list,
        description="Hosts the supervised vLLM may fetch image/audio/video URLs from when a /v1/* request names one "
        "(repeatable; vLLM's --allowed-media-domains; redirects off). None: vLLM fetches nothing; * : any host "
        "(vLLM's own default). The Ollama API takes base64 images only and never asks vLLM to fetch.",
    )

    @field_validator("keep_alive", "sleep_unload_after")
    @classmethod
    def _keep_alive_duration(cls, v: str) -> str:
        # checked at start: a typo was a traceback (supervised) or ignored (--upstream)
        return duration(v)

    def keep_alive_seconds(self) -> float:
        """The default keep_alive in seconds (negative: forever)."""
        from vllama_proxy.models.keep_alive import parse_keep_alive

        return parse_keep_alive(self.keep_alive, default=300.0)

    def sleep_unload_seconds(self) -> float:
        """``sleep_unload_after`` in seconds (negative: never)."""
        from vllama_proxy.models.keep_alive import parse_keep_alive

        return parse_keep_alive(self.sleep_unload_after, default=1800.0)


class OnDemandPolicy(BaseModel):
    """Which models may start, for whom, and which may be evicted."""

    max_aliases: int = Field(
        256, ge=0, description="Most aliases /api/copy may make (each is listed in every /api/tags).",
    )
    detect_parsers: bool = Field(
        True, description="A model no library name describes (a directory, a cached hub id) gets the vLLM tool and reasoning "
        "parsers its chat template tells (logged as parsers_detected); flags it is given win (docs/agents.md).",
    )
    on_demand_admin_only: bool = Field(
        False, description="Only admin keys start a model that is not loaded; user keys use the models already loaded.",
    )
    protect_models: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Never evict an operator's model (--model, [[models]]) to make room for an on-demand one; an admin "
        "still unloads it with keep_alive 0 (auto: on with --api-key-file).",
    )
