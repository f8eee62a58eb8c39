"""``vllama serve --help``: metavars a person reads, options in groups, examples, and a "did you mean"
for a mistyped option (``CliParser``); the command-line source of the settings (``cli_source``)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from pydantic_settings import CliSettingsSource

from vllama_proxy import CliParser

from .core import Settings


#: ``--help`` metavars a person reads, where the field's type alone would show a Python type.
METAVARS = {
    "host": "HOST", "port": "PORT", "config": "FILE", "models": "JSON", "upstream": "URL", "model": "MODEL",
    "served_model_name": "NAME", "library": "FILE", "alias": "NAME=SERVED", "vllm_args": "ARG", "api_key_upstream": "KEY",
    "api_key": "KEY", "api_key_file": "FILE", "origins": "ORIGIN", "max_queue": "N", "max_running": "N", "fair_reserve": "N",
    "fair_light_running": "N", "retry_after": "SECONDS", "workers": "N|auto", "connect_concurrency": "N|auto", "cpus": "N", "max_body_size": "BYTES", "keep_alive": "DURATION", "sleep_unload_after": "DURATION",
    "sleep_host_memory_reserve": "BYTES", "state_dir": "DIR", "allowed_media_domains": "HOST",
    "vllm_executable": "PATH", "vllm_port": "PORT", "unhealthy_threshold": "N", "crash_loop_limit": "N",
    "gpu_context_share": "FRACTION", "on_demand_models": "NAME", "max_on_demand": "N",
    "session_header": "HEADER", "register_with": "URL", "advertise_url": "URL", "router": "POLICY",
    "router_port": "PORT", "router_args": "FLAGS", "fleet_secret": "SECRET", "state_url": "URL",
    "max_small_body_size": "BYTES", "cache_quota": "BYTES", "max_blob_size": "BYTES",
    "usage_db": "FILE|URL|off", "usage_retention_days": "DAYS", "usage_flush_rows": "N",
}
_NO_DEFAULT = re.compile(r" \((?:default: null|default factory: \w+)\)")


#: ``vllama serve --help``'s groups: each starts at this field and runs to the next one's start
#: (fields in the class's order), so a setting added inside a section lands in its group.
HELP_GROUPS = {
    "host": "where it listens", "config": "what it serves", "connect_timeout": "the connection to vLLM",
    "api_key": "access", "max_queue": "requests and the front end",
    "keep_alive": "models vllama runs (--model, --config, on demand)", "vllm_executable": "the vLLM process it supervises",
    "log_level": "logging", "usage_db": "the usage ledger and budgets",
}

SERVE_DESCRIPTION = """Serve the Ollama API in front of vLLM: launch and supervise `vllm serve` for --model (or
--config's [[models]], or models pulled earlier, started when a request names them), or
proxy a vLLM that already runs (--upstream). Durations are seconds, sizes bytes."""

SERVE_EXAMPLES = """examples:
  vllama serve --model qwen2.5:7b                     launch vLLM, serve the Ollama API on 127.0.0.1:11434
  vllama serve --model qwen2.5:7b -- --max-model-len 8192
                                                      arguments after -- go to `vllm serve`
  vllama serve                                        serve pulled models (vllama pull), each started on demand
  vllama serve --upstream http://127.0.0.1:8000       proxy a running vLLM (no GPU needed here)
  vllama serve --config vllama.toml                   several models (deploy/vllama.example.toml)
  OLLAMA_HOST=0.0.0.0 vllama serve --model qwen2.5:7b --api-key-file keys.txt
                                                      every address, clients need a key

Every option is also a VLLAMA_* variable (VLLAMA_KEEP_ALIVE=10m) and a config-file key
(docs/configuration.md lists them all)."""


def _group(parser: argparse.ArgumentParser, dest: str) -> Any:
    """The help group ``dest``'s option is shown in (:data:`HELP_GROUPS`), made on first use."""
    groups = parser.__dict__.setdefault("_vllama_groups", {})
    title = None
    for name in Settings.model_fields:
        title = HELP_GROUPS.get(name, title)
        if name == dest:
            break
    if title is None or dest not in Settings.model_fields:
        return parser
    if title not in groups:
        groups[title] = parser.add_argument_group(title)
    return groups[title]


def _readable_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> Any:
    """``add_argument`` for the settings' CLI: metavars from :data:`METAVARS` (``SECONDS`` for the
    other floats, ``N`` for the other ints), no ``(default: null)``/``(default factory: list)``,
    each option in its group of :data:`HELP_GROUPS`."""
    field = Settings.model_fields.get(str(kwargs.get("dest", "")))
    dest, kind = str(kwargs.get("dest", "")), str(kwargs.get("metavar", ""))
    if field is not None and "metavar" in kwargs and (dest in METAVARS or not kind.startswith("{")):
        kwargs["metavar"] = METAVARS.get(dest) or ("SECONDS" if "float" in kind else "N" if "int" in kind else dest.upper())
    if isinstance(kwargs.get("help"), str):
        kwargs["help"] = _NO_DEFAULT.sub("", kwargs["help"])
    if isinstance(parser, CliParser) and field is not None:
        return _group(parser, str(kwargs["dest"])).add_argument(*names, **kwargs)
    return parser.add_argument(*names, **kwargs)


def cli_source(args: list[str]) -> CliSettingsSource[Settings]:
    """The command-line source of ``vllama serve``'s settings, with a ``--help`` a person reads:
    options in groups, examples, and a "did you mean" for a mistyped one (:class:`CliParser`)."""
    parser = CliParser(prog="vllama serve", usage="%(prog)s [options] [-- vllm serve arguments]",
                         description=SERVE_DESCRIPTION, epilog=SERVE_EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    return CliSettingsSource(Settings, cli_hide_none_type=True, add_argument_method=_readable_argument,
                             root_parser=parser)(args=args)
