"""vllama's settings: one typed class (``Settings``, ``core.py``) made of field groups by concern
(``front.py``, ``served.py``, ``engine.py``, ``tenancy.py``, ``fleet.py``, ``usage.py``), read from CLI
flags, ``VLLAMA_*`` variables, ``.env``, the TOML config file and Ollama's variables (``sources.py``);
cross-field rules refuse or derive (``checks.py``), none rewrites a field; ``vllama serve --help``
(``help.py``) and the settings table of ``docs/configuration.md`` (``scripts/settings_table.py``; a
test keeps the page in step) are generated from the field descriptions.
"""

from vllama_proxy import parse_ollama_host

from .core import Settings
from .help import cli_source
from .served import default_state_dir

__all__ = ["Settings", "cli_source", "default_state_dir", "parse_ollama_host"]
