"""Aliases made with ``POST /api/copy``: a JSON file every proxy process reads, kept across restarts.

Ollama's copy makes a second name for a model (``shared/ollama-api.md``, "Copy a
Model"); for a model served by vLLM that is an alias. The file is
``<state_dir>/aliases.json``, ``{"alias": "served name"}``. Writers take an ``flock``
on a lock file beside it and replace the file atomically (write, fsync, rename), so
concurrent copies from different workers do not lose each other's names and a crash
never leaves half a file. Readers re-read it only when its mtime or size changed: one
``stat`` per lookup of a name that is not a served name or configured alias.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from vllama_proxy.logs import get_logger
from . import state_file

log = get_logger("vllama.aliases")


class AliasStore:
    """The aliases file (see the module docstring).

    Args:
        path: the JSON file (its directory is created on the first write).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # alias -> served name, and the same keyed by the case-folded alias
        self._view = state_file.FileView(path, self._parse, lambda: ({}, {}))

    def _parse(self) -> tuple[dict[str, str], dict[str, str]]:
        aliases = self._read()
        return aliases, {k.casefold(): v for k, v in aliases.items()}

    def current(self) -> dict[str, str]:
        """Alias -> served name, as the file says now (``{}`` when there is none or it is unreadable)."""
        return self._view.get()[0]

    def lookup(self, alias: str) -> str | None:
        """The served name ``alias`` stands for, compared without case as Ollama names are."""
        return self._view.get()[1].get(alias.casefold())

    def set(self, alias: str, target: str) -> None:
        """Make ``alias`` name ``target`` (replacing what it named before).

        Raises:
            OSError: the state directory cannot be written.
        """
        def put(aliases: dict[str, str]) -> None:
            for key in [k for k in aliases if k.casefold() == alias.casefold()]:
                del aliases[key]  # one entry per name, whatever its case
            aliases[alias] = target

        self._update(put)

    def remove(self, alias: str) -> bool:
        """Forget ``alias`` (any case); whether it existed. Writes nothing when it does not.

        Raises:
            OSError: the state directory cannot be written.
        """
        if self.lookup(alias) is None:
            return False
        found = False

        def drop(aliases: dict[str, str]) -> None:
            nonlocal found
            for key in [k for k in aliases if k.casefold() == alias.casefold()]:
                found = aliases.pop(key, None) is not None or found

        self._update(drop)
        return found

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("aliases_unreadable", path=str(self.path), error=str(e))
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _update(self, change: Callable[[dict[str, str]], None]) -> None:
        state_file.rewrite(self.path, self._read, change)
        self._view.forget()  # re-read on the next lookup
