"""The configured models resolved once, at start-up: the library table and what each model launches.

``vllama serve`` reads its settings (plain data: ``settings/``), then resolves them here, once:
the library (the packaged table, extended by the user's file) is loaded, and every ``[[models]]``
table or ``--model`` naming a library name (``qwen2.5:7b``) becomes its repo and vLLM arguments
(``library.py``), so that a tag the table lacks stops the server at start instead of reaching
vLLM as a model it cannot load. The result travels to whoever needs it (the sizing, the
supervisors, each worker's app) as an argument, pickled to the ``--workers`` processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import library
from .family import with_detected_parsers
from .launch_spec import ModelConfig


@dataclass(frozen=True)
class ResolvedModels:
    """What ``vllama serve`` launches, resolved.

    Attributes:
        library: the library table (packaged + the user's file).
        specs: the launched models, in configuration order, library names resolved
            (``qwen2.5:7b`` -> ``Qwen/Qwen2.5-7B-Instruct`` served as ``qwen2.5:7b`` with tool
            calling on); a hub id or a directory as configured.
        entries: served name -> the library entry it came from, for the models named by a library name.
    """

    library: library.Library
    specs: tuple[ModelConfig, ...] = ()
    entries: dict[str, library.Entry] = field(default_factory=dict)


def library_file(given: Path | None, state_dir: Path) -> Path | None:
    """The user's library file: ``given`` (``--library``), else ``<state_dir>/library.toml`` when it
    exists, else none (the packaged table alone)."""
    if given is None and (state_dir / "library.toml").is_file():
        return state_dir / "library.toml"
    return given


def resolve_models(configured: Sequence[ModelConfig], *, library_path: Path | None, state_dir: Path,
                   detect_parsers: bool = True) -> ResolvedModels:
    """The library loaded (see :func:`library_file`) and ``configured`` resolved through it; with
    ``detect_parsers``, a model no library name describes gets the tool and reasoning parsers its
    chat template tells (``family.py``) unless it names its own.

    Raises:
        LibraryError: a library file is unreadable or breaks the schema.
        ModelNotFound: a model names a ``name:tag`` the table does not know (the message says what is close).
    """
    table = library.load(library_file(library_path, state_dir))
    pairs = [library.resolve_spec(spec, table) for spec in configured]
    if detect_parsers:
        pairs = [(with_detected_parsers(spec) if entry is None else spec, entry) for spec, entry in pairs]
    return ResolvedModels(table, tuple(spec for spec, _ in pairs),
                          {spec.served_name: entry for spec, entry in pairs if entry is not None})
