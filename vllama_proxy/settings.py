"""vllama's settings: one typed class, read from CLI flags, ``VLLAMA_*`` variables and ``.env``.

Precedence (highest first): command-line flags, ``VLLAMA_*`` environment variables,
``.env`` in the working directory, ``OLLAMA_HOST`` (for the listen address only, as
Ollama reads it), then the defaults below. ``vllama serve --help`` and the README's
settings table are both generated from the field descriptions here
(``scripts/settings_table.py``; a test keeps the README in step).
"""

from __future__ import annotations

import os
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
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
        description="Name vLLM serves the model under (default: the model argument).",
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

    # --- request handling --------------------------------------------------------
    max_body_size: int = Field(
        128 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted, bytes (base64 images count); larger gets 413.",
    )

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
    def _ollama_host(self) -> Settings:
        # Ollama reads OLLAMA_HOST for its bind address; our own flags/variables win.
        raw = os.environ.get("OLLAMA_HOST")
        if raw and "host" not in self.model_fields_set and "port" not in self.model_fields_set:
            self.host, self.port = parse_ollama_host(raw)
        return self
