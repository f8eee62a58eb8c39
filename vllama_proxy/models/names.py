"""Where an Ollama model name resolves: the one owner of "which model does this name mean".

Invariant: every kind of name is looked up here, in this order, the first that knows it winning
(without ``:latest``, without case, as Ollama): (1) a model made with ``/api/create`` (``created.py``)
-> its base's served name, its layers riding along; (2) a served name; (3) a configured alias; (4) an
``/api/copy`` alias (``aliases.py``); (5) a library name (``library.py``) or Hugging Face repo id of a
served model's repo, so no on-demand slot starts a second copy of the same weights; (6) a local model
started on demand (``on_demand.py``), asked by ``catalog.py`` after 1-5 because it may start a model
(an alias there by its target, :meth:`Names.alias_target`). Outside this order: ``hub.parse_model``
and the settings' ``library.resolve_spec`` for ``--model``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllama_proxy.errors import ModelNotFound
from .vllm_servers import ServedModel
from .library import Library

if TYPE_CHECKING:  # pragma: no cover
    from .aliases import AliasStore
    from .created import CreatedModel, CreatedStore

LATEST = ":latest"


def strip_latest(name: str) -> str:
    """``X:latest`` -> ``X``; other tags are kept (``qwen2.5:1.5b`` stays)."""
    return name[: -len(LATEST)] if name.endswith(LATEST) else name


def ollama_name(name: str) -> str:
    """The ``X:latest`` form Ollama lists (a name that has a tag keeps it)."""
    tail = name.rsplit("/", 1)[-1]
    return name if ":" in tail else name + LATEST


class Names:
    """The name sources of steps 1-5 (see the module docstring).

    Args:
        aliases: configured aliases, alias -> served name.
        store: aliases made with ``/api/copy``.
        created: models made with ``/api/create``.
        library: the library table.
    """

    def __init__(self, aliases: Mapping[str, str] | None = None, *, store: AliasStore | None = None,
                 created: CreatedStore | None = None, library: Library | None = None) -> None:
        self.configured = {strip_latest(k): v for k, v in (aliases or {}).items()}
        self._folded = {k.casefold(): v for k, v in self.configured.items()}
        self.store = store
        self.created_store = created
        self.library = library

    def created(self, name: str) -> CreatedModel | None:
        """Step 1: the model made with ``/api/create`` that ``name`` names."""
        return self.created_store.lookup(name) if self.created_store is not None else None

    def lookup(self, models: Mapping[str, ServedModel], name: str) -> ServedModel | None:
        """Steps 2-5 over ``models`` (served name -> model): the served model ``name`` means, else ``None``."""
        key = strip_latest(name)
        m = models.get(key)
        if m is None:
            target = self.alias_target(key)
            if target is not None:
                m = models.get(target)
        if m is None:
            folded = key.casefold()
            m = next((v for k, v in models.items() if k.casefold() == folded), None)
        if m is None and self.library is not None:
            m = self._by_library_name(models, name)
        if m is None:
            m = by_repo_id(models, name)
        return m

    def alias_target(self, name: str) -> str | None:
        """Steps 3-4 alone: the name a configured alias or one made with ``/api/copy`` stands for, else
        ``None`` (also for an alias of an on-demand model, which step 6 then starts by that name)."""
        key = strip_latest(name)
        target = self._folded.get(key.casefold())
        if target is None and self.store is not None:
            target = self.store.lookup(key)
        return target

    def is_configured_alias(self, name: str) -> bool:
        """Whether ``name`` is an alias from the settings (``/api/copy`` and ``/api/create`` do not replace those)."""
        return strip_latest(name).casefold() in self._folded

    def aliases(self) -> dict[str, str]:
        """Every alias -> served name: configured ones, then those made with ``/api/copy``."""
        if self.store is None:
            return self.configured
        return {**{strip_latest(k): v for k, v in self.store.current().items()}, **self.configured}

    def _by_library_name(self, models: Mapping[str, ServedModel], name: str) -> ServedModel | None:
        """Step 5: the served model loaded from the repo a library name maps to (``qwen2.5:7b`` ->
        the model served from ``Qwen/Qwen2.5-7B-Instruct``, whatever its served name)."""
        assert self.library is not None
        if name.strip() not in self.library:
            return None
        try:
            repo = self.library.resolve(name).repo.casefold()
        except ModelNotFound:
            return None
        return next((m for m in models.values() if m.root.casefold() == repo), None)


_HUB_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/")


def by_repo_id(models: Mapping[str, ServedModel], name: str) -> ServedModel | None:
    """Step 5's last part: the served model loaded from the Hugging Face repo ``name`` names
    (``org/name``, ``org/name:<revision>``, any case, ``hf.co/`` prefixed), else ``None``. The
    revision does not pick another copy: the operator serves one, and it answers."""
    base = name.strip()
    for prefix in _HUB_PREFIXES:
        if base.casefold().startswith(prefix):
            base = base[len(prefix):]
            break
    repo = base.partition(":")[0].casefold()
    if repo.count("/") != 1:
        return None
    return next((m for m in models.values() if m.root.casefold() == repo), None)
