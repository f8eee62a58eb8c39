"""Aliases made with ``POST /api/copy``: a JSON file every proxy process reads, kept across restarts.

Ollama's copy makes a second name for a model (``docs/wire.md``
"Routes"); for a model served by vLLM that is an alias. The file is
``<state_dir>/aliases.json``, ``{"alias": "served name"}``. Writers take an ``flock``
on a lock file beside it and replace the file atomically (write, fsync, rename), so
concurrent copies from different workers do not lose each other's names and a crash
never leaves half a file. Readers re-read it only when its mtime or size changed, and look
(a ``stat``) at a lookup of a name that is not a served name or configured alias only when a write
of this server counted a change or a second passed (``state_file.Changes``).
"""

from __future__ import annotations

from pathlib import Path

from vllama_proxy.logs import get_logger
from . import state_file

log = get_logger("vllama.aliases")


class AliasStore(state_file.NameStore[tuple[dict[str, str], dict[str, str]]]):
    """The aliases file (see the module docstring).

    Args:
        path: the JSON file (its directory is created on the first write).
        changes: its change count shared by the server's processes (``state_file.Changes``); ``None``:
            a ``stat`` per lookup.
    """

    def __init__(self, path: Path, changes: state_file.Changes | None = None) -> None:
        # alias -> served name, and the same keyed by the case-folded alias
        super().__init__(path, self._parse, lambda: ({}, {}), changes)

    def _parse(self) -> tuple[dict[str, str], dict[str, str]]:
        aliases = self._raw()
        return aliases, {k.casefold(): v for k, v in aliases.items()}

    def current(self) -> dict[str, str]:
        """Alias -> served name, as the file says now (``{}`` when there is none or it is unreadable)."""
        return self._view.get()[0]

    def lookup(self, alias: str) -> str | None:
        """The served name ``alias`` stands for, compared without case as Ollama names are."""
        return self._view.get()[1].get(alias.casefold())

    def set(self, alias: str, target: str) -> None:
        """Make ``alias`` name ``target`` (replacing what it, in any case, named before).

        Raises:
            OSError: the state directory cannot be written.
        """
        self._put(alias, target)

    def _raw(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in state_file.read_object(self.path, log, "aliases_unreadable").items()}
