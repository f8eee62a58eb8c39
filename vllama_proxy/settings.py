"""vllama's settings: one typed class, read from CLI flags, ``VLLAMA_*`` variables and ``.env``.

Precedence (highest first): command-line flags, ``VLLAMA_*`` environment variables,
``.env`` in the working directory, ``OLLAMA_HOST`` (for the listen address only, as
Ollama reads it), then the defaults below. ``vllama serve --help`` and the README's
settings table are both generated from the field descriptions here
(``scripts/settings_table.py``; a test keeps the README in step).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Ollama's default port (``envconfig.Host`` in ollama/ollama).
OLLAMA_DEFAULT_PORT = 11434


def parse_ollama_host(value: str) -> tuple[str, int]:
    """Split an ``OLLAMA_HOST`` value into ``(host, port)`` the way Ollama does.

    Accepts ``host``, ``host:port``, ``:port``, ``scheme://host:port`` and bracketed IPv6.
    A bare host gets port 11434; an empty host means ``127.0.0.1``.

    Raises:
        ValueError: the port is not a number in 0..65535.
    """
    value = value.strip().strip('"').strip("'")
    if "://" not in value:
        value = "http://" + value
    parts = urlsplit(value)
    host = parts.hostname or "127.0.0.1"
    port = parts.port if parts.port is not None else OLLAMA_DEFAULT_PORT
    return host, port


class Settings(BaseSettings):
    """Everything ``vllama serve`` can be told. Durations are seconds, sizes bytes."""

    model_config = SettingsConfigDict(
        env_prefix="VLLAMA_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        cli_prog_name="vllama serve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_enforce_required=False,
        validate_default=True,
    )

    # --- where the proxy listens -------------------------------------------------
    host: str = Field(
        "127.0.0.1",
        description="Address the Ollama API listens on (OLLAMA_HOST is honoured when this is not set).",
    )
    port: int = Field(OLLAMA_DEFAULT_PORT, ge=0, le=65535, description="Port the Ollama API listens on.")

    # --- what it proxies -----------------------------------------------------------
    upstream: str | None = Field(
        None,
        description="URL of an already-running vLLM OpenAI server to proxy (no supervisor), e.g. http://127.0.0.1:8000.",
    )
    model: str | None = Field(
        None,
        description="Model for the supervisor to serve with `vllm serve` (HF id or local directory).",
    )
    served_model_name: str | None = Field(
        None,
        description="Name vLLM serves the model under (default: the hub id, or a local directory's name).",
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

    # --- upstream connection -----------------------------------------------------
    connect_timeout: float = Field(10.0, gt=0, description="Seconds to open a connection to vLLM.")
    read_timeout: float = Field(
        600.0,
        gt=0,
        description="Idle-read timeout: seconds without a byte from vLLM before a request fails (no total timeout).",
    )
    models_ttl: float = Field(
        10.0,
        ge=0,
        description="Seconds the list of served models (vLLM /v1/models) is cached.",
    )

    # --- access ------------------------------------------------------------------------
    api_key: list[SecretStr] = Field(
        default_factory=list,
        description="API key clients must send as `Authorization: Bearer` on /api/* and /v1/* (repeatable; none: open).",
    )
    api_key_file: Path | None = Field(None, description="File of API keys, one per line (# comments); added to --api-key.")
    origins: list[str] = Field(
        default_factory=list,
        description="CORS origins allowed besides Ollama's defaults (repeatable, * wildcards); OLLAMA_ORIGINS is honoured too.",
    )

    # --- request handling --------------------------------------------------------
    max_queue: int = Field(
        512,
        ge=0,
        description="Requests allowed to wait beyond what vLLM runs before 503 server busy (OLLAMA_MAX_QUEUE semantics; honoured).",
    )
    max_running: int | None = Field(
        None,
        ge=1,
        description="Requests vLLM runs at once (default: its --max-num-seqs from the arguments after --, else 256).",
    )
    retry_after: int = Field(2, ge=0, description="Seconds in the Retry-After header of a 503 server busy.")
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="Proxy processes sharing the port (SO_REUSEPORT); more than 1 when one core cannot keep up with vLLM's token rate.",
    )
    max_body_size: int = Field(
        128 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted, bytes (base64 images count); larger gets 413.",
    )

    # --- the supervisor (with --model) -------------------------------------------------
    keep_alive: str = Field(
        "5m",
        description="How long a model stays loaded after a request (Ollama's keep_alive: duration or seconds, negative = forever); "
        "then it sleeps (with --enable-sleep-mode after --) or vLLM stops. OLLAMA_KEEP_ALIVE is honoured; "
        "write negative durations as --keep-alive=-1m.",
    )
    load_timeout: float = Field(600.0, gt=0, description="Seconds a request waits for a sleeping or unloaded model to come back.")
    vllm_executable: str = Field("vllm", description="The `vllm` executable the supervisor launches (looked up on PATH).")
    vllm_port: int = Field(0, ge=0, le=65535, description="Loopback port for the supervised vLLM (0: pick a free one).")
    startup_timeout: float = Field(900.0, gt=0, description="Seconds vLLM may take to become ready (download, load, compile).")
    startup_progress_extension: float = Field(
        300.0, ge=0, description="The startup deadline is pushed to this many seconds after vLLM's latest loading-progress log line."
    )
    startup_poll_interval: float = Field(0.5, gt=0, description="Seconds between readiness probes while vLLM starts.")
    health_interval: float = Field(5.0, gt=0, description="Seconds between /health (and hang) checks of a ready vLLM.")
    health_timeout: float = Field(10.0, gt=0, description="Seconds a single health or metrics probe may take.")
    unhealthy_threshold: int = Field(3, ge=1, description="Consecutive failed /health probes that trigger a restart.")
    hang_timeout: float = Field(
        120.0, ge=0, description="Restart when requests are pending but no token was generated for this long (0: off)."
    )
    stop_grace: float = Field(30.0, ge=0, description="Seconds between SIGTERM and SIGKILL when stopping vLLM's process group.")
    drain_timeout: float = Field(30.0, ge=0, description="On SIGTERM/SIGINT, seconds in-flight requests may take to finish.")
    restart_backoff_initial: float = Field(1.0, ge=0, description="First restart delay, seconds; doubles per failure.")
    restart_backoff_max: float = Field(60.0, ge=0, description="Cap of the restart delay, seconds.")
    restart_reset_after: float = Field(300.0, ge=0, description="Seconds of readiness after which the failure count resets.")
    crash_loop_limit: int = Field(5, ge=1, description="Consecutive failures after which the state is `failed` (retrying slowly).")
    failed_retry_interval: float = Field(300.0, ge=0, description="Seconds between retries in the `failed` state.")
    gpu_check: bool = Field(True, description="Check GPUs with NVML before launching and wait for memory release after stopping.")
    gpu_release_timeout: float = Field(60.0, ge=0, description="Seconds to wait for a stopped vLLM's GPU memory to be released.")

    # --- logging -----------------------------------------------------------------
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["auto", "console", "json"] = Field(
        "auto",
        description="Log format: console on a TTY, JSON otherwise (auto), or forced.",
    )
    access_log: bool = Field(True, description="Log one line per request (route, status, duration).")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v

    @field_validator("upstream")
    @classmethod
    def _strip_slash(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError("upstream must be an http:// or https:// URL")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _reserved_vllm_args(self) -> Settings:
        # vLLM must only ever listen on loopback, on the port the supervisor chose.
        if self.model:
            for arg in self.vllm_args:
                if arg.split("=", 1)[0] in ("--host", "--port", "--served-model-name"):
                    raise ValueError(f"{arg.split('=', 1)[0]} is set by vllama; use --vllm-port / --served-model-name")
        return self

    @model_validator(mode="after")
    def _ollama_env(self) -> Settings:
        # Ollama's own variables, where ours were not given.
        origins = os.environ.get("OLLAMA_ORIGINS")
        if origins:
            self.origins = [*self.origins, *(o.strip() for o in origins.split(",") if o.strip())]
        keep = os.environ.get("OLLAMA_KEEP_ALIVE")
        if keep and "keep_alive" not in self.model_fields_set:
            self.keep_alive = keep
        queue = os.environ.get("OLLAMA_MAX_QUEUE")
        if queue and "max_queue" not in self.model_fields_set:
            self.max_queue = int(queue)
        return self

    def keep_alive_seconds(self) -> float:
        """The default keep_alive in seconds (negative: forever)."""
        from .ollama_types import parse_keep_alive

        return parse_keep_alive(self.keep_alive, default=300.0)

    def api_keys(self) -> list[str]:
        """Every configured API key: ``--api-key`` values and the lines of ``--api-key-file``.

        Raises:
            OSError: the key file cannot be read.
        """
        keys = [k.get_secret_value() for k in self.api_key]
        if self.api_key_file is not None:
            for line in self.api_key_file.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return keys

    def inflight_limit(self) -> int:
        """Requests one proxy process admits at once: (vLLM's running capacity + max_queue) / workers."""
        running = self.max_running
        if running is None:
            running = 256  # vLLM's max_num_seqs default for the OpenAI server
            for i, a in enumerate(self.vllm_args):
                if a == "--max-num-seqs" and i + 1 < len(self.vllm_args):
                    running = int(self.vllm_args[i + 1])
                elif a.startswith("--max-num-seqs="):
                    running = int(a.split("=", 1)[1])
        return -(-(running + self.max_queue) // self.workers)

    @model_validator(mode="after")
    def _ollama_host(self) -> Settings:
        # Ollama reads OLLAMA_HOST for its bind address; our own flags/variables win.
        raw = os.environ.get("OLLAMA_HOST")
        if raw and "host" not in self.model_fields_set and "port" not in self.model_fields_set:
            self.host, self.port = parse_ollama_host(raw)
        return self
