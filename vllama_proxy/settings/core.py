"""``Settings``: the field groups assembled into the one class ``vllama serve`` reads, its sources,
the cross-field refusals (``checks.py``) run once, and the values derived from several fields.

Precedence (highest first): command-line flags, ``VLLAMA_*`` environment variables,
``.env`` in the working directory, the TOML config file (``--config``/``VLLAMA_CONFIG``:
any setting by its field name, plus ``[[models]]`` tables), Ollama's variables (``OLLAMA_HOST``
for the listen address, ``OLLAMA_KEEP_ALIVE``, ``OLLAMA_MAX_QUEUE``; ``sources.py``), then the
defaults. Fields keep the order of the groups below: ``--help``'s groups (``help.py``) and the
settings table of ``docs/configuration.md`` (``scripts/settings_table.py``) follow it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from vllama_proxy.models.launch_spec import ModelConfig

from . import checks
from .engine import Engine
from .fleet import Fleet
from .front import ClientConnections, Listen, Logging, Requests, UpstreamConnection
from .served import ModelLifetime, OnDemandPolicy, Served
from .sources import CONFIG_FILE, ConfigFile, ollama_variables
from .tenancy import Access, AdminSignIn, FairShare, TenantLimits
from .usage import Usage


# Fields are collected along the reversed MRO: the last base's come first.
class Settings(Usage, FairShare, TenantLimits, ClientConnections, OnDemandPolicy, Fleet, Logging, Engine,
               ModelLifetime, Requests, AdminSignIn, Access, UpstreamConnection, Served, Listen, BaseSettings):
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

    @model_validator(mode="before")
    @classmethod
    def _ollama_variables(cls, data: Any) -> Any:
        # below every source of ours: only what none of them gave (sources.py)
        if isinstance(data, dict):
            return {**ollama_variables(data), **data}
        return data

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Settings:
        secret = self.fleet_secret.get_secret_value() if self.fleet_secret is not None else None
        checks.reserved_vllm_args(self.model, self.vllm_args)
        checks.fleet_node_keys(secret, self.register_with, self.api_key_file, [k.get_secret_value() for k in self.api_key])
        checks.router_alone(self.router, self.upstream, self.router_port, self.model, self.models)
        checks.one_source_of_models(self.model, self.models, self.upstream_url, self.vllm_args, self.port)
        checks.admin_oidc(self.admin_oidc_issuer, self.admin_oidc_client_id,
                          self.admin_oidc_client_secret is not None or self.admin_oidc_client_secret_file is not None,
                          self.admin_oidc_redirect_url)
        return self

    @property
    def upstream_url(self) -> str | None:
        """The vLLM (or router) this front proxies: ``--upstream``, or the vllm-router ``--router``
        starts on loopback; ``None``: vllama launches its own vLLM (``checks.upstream_url``)."""
        return checks.upstream_url(self.upstream, self.router, self.router_port)

    @property
    def upstream_bearer(self) -> str | None:
        """The bearer token sent upstream: ``--api-key-upstream``, else ``--fleet-secret``."""
        secret = self.fleet_secret.get_secret_value() if self.fleet_secret is not None else None
        return checks.upstream_bearer(self.api_key_upstream, secret)

    @property
    def client_keys(self) -> list[str]:
        """The keys clients may send besides the keys file: ``--api-key``, or a node's fleet secret alone."""
        secret = self.fleet_secret.get_secret_value() if self.fleet_secret is not None else None
        return checks.client_keys([k.get_secret_value() for k in self.api_key], secret, self.register_with)

    def protects_models(self) -> bool:
        """Whether on-demand models may not evict the operator's (``protect_models``)."""
        return self.protect_models == "on" or (self.protect_models == "auto" and self.api_key_file is not None)

    def fair(self) -> bool:
        """Whether keys share the admission bound and vLLM schedules by priority (``fair_share``)."""
        return self.fair_share == "on" or (self.fair_share == "auto" and self.api_key_file is not None)

    def configured_models(self) -> list[ModelConfig]:
        """The models vllama launches as configured: the ``[[models]]`` tables, or the one ``--model``
        describes. Library names (``qwen2.5:7b``) are resolved at start-up, not here
        (``models/resolved.py``)."""
        if self.models:
            return list(self.models)
        if self.model:
            return [ModelConfig(model=self.model, name=self.served_model_name, vllm_args=self.vllm_args, port=self.vllm_port)]
        return []

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = CONFIG_FILE.get()
        config = (ConfigFile(settings_cls, path),) if path is not None else ()
        return (init_settings, env_settings, dotenv_settings, *config, file_secret_settings)

    @classmethod
    def load(cls, config: Path | None = None, **kwargs: Any) -> Settings:
        """Settings with ``config`` (a TOML file) as a source below flags and the environment.

        Raises:
            ValueError: the file is missing, is not TOML, or names an unknown setting.
            pydantic.ValidationError: a value is invalid.
        """
        token = CONFIG_FILE.set(config)
        try:
            return cls(**kwargs)
        finally:
            CONFIG_FILE.reset(token)



