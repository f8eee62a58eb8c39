"""Where settings come from besides flags, ``VLLAMA_*`` variables and ``.env``: the TOML config file
(``ConfigFile``) and Ollama's own variables (``ollama_variables``), each below what vllama's own give."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, TomlConfigSettingsSource

from vllama_proxy import parse_ollama_host

from .served import duration

#: The config file being read (set by ``Settings.load`` around construction).
CONFIG_FILE: ContextVar[Path | None] = ContextVar("vllama_config_file", default=None)


class ConfigFile(TomlConfigSettingsSource):
    """The TOML config file as a settings source; a key that is no setting is an error (a typo
    would otherwise be ignored silently)."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} not found")
        try:
            super().__init__(settings_cls, toml_file=path)
        except ValueError as e:  # tomllib.TOMLDecodeError
            raise ValueError(f"{path}: not valid TOML: {e}") from None
        unknown = sorted(set(self.toml_data) - set(settings_cls.model_fields) - {"config"})
        if unknown:
            raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}")


def ollama_variables(given: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The settings Ollama's own variables give where vllama's sources gave none (``given``: the
    values every source gave, by field name): ``OLLAMA_HOST`` (host and port, when neither is given),
    ``OLLAMA_KEEP_ALIVE``, ``OLLAMA_MAX_QUEUE``. ``OLLAMA_ORIGINS`` adds to ``--origins``
    (``tenancy.Access``).

    Raises:
        ValueError: ``OLLAMA_KEEP_ALIVE`` is no duration.
    """
    out: dict[str, Any] = {}
    raw = environ.get("OLLAMA_HOST")
    if raw and "host" not in given and "port" not in given:
        out["host"], out["port"] = parse_ollama_host(raw)
    keep = environ.get("OLLAMA_KEEP_ALIVE")
    if keep and "keep_alive" not in given:
        try:
            out["keep_alive"] = duration(keep)
        except ValueError as e:
            raise ValueError(f"invalid OLLAMA_KEEP_ALIVE: {e}") from None
    queue = environ.get("OLLAMA_MAX_QUEUE")
    if queue and "max_queue" not in given:
        out["max_queue"] = queue
    return out
