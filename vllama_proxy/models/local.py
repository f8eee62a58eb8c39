"""The local models: what ``vllama pull`` (or ``huggingface-cli download``) left in the Hugging Face cache.

Ollama lists every local model in ``/api/tags`` and runs any of them the moment a request
names it (``server/routes.go`` ListHandler, ``server/sched.go``). vllama's local models are
the model repos of the Hugging Face cache (``HF_HUB_CACHE``, what vLLM loads from) that hold
a ``config.json`` and safetensors weights in the snapshot their ``main`` ref (or, without
one, their newest revision) points to. Each is named as Ollama would name it: by the library
name whose repo it is (``Qwen/Qwen2.5-0.5B-Instruct`` -> ``qwen2.5:0.5b``,
``models/library.toml``), else by its Hugging Face id.

A request may name a local model by that name, by any library name of its repo
(``qwen2.5:0.5b-instruct``, ``qwen2.5:0.5b`` when it is not the default tag), or by its
Hugging Face id. Local paths are never on-demand models: a client must not make the server
load an arbitrary directory.

Everything here reads the disk: callers run :func:`scan` in a worker thread.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from .library import Library, looks_like_library_name

_WEIGHTS = ".safetensors"


@dataclass(frozen=True)
class LocalModel:
    """One model repo in the Hugging Face cache that vLLM can load offline.

    Attributes:
        name: the name Ollama would list it under (a library name, else the repo id).
        repo: the Hugging Face id (what ``vllm serve`` is given).
        path: the snapshot directory holding its files.
        size: bytes of its weight files.
        modified: seconds since the epoch (its ``config.json``'s mtime).
    """

    name: str
    repo: str
    path: Path
    size: int
    modified: float


def cache_dir() -> Path:
    """The Hugging Face hub cache vLLM reads (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` points to, else the newest one."""
    snaps = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text().strip()
        if (snaps / commit).is_dir():
            return snaps / commit
    try:
        found = [p for p in snaps.iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def repo_names(library: Library | None) -> dict[str, str]:
    """Repo id (case-folded) -> the library name it is listed under: a plain tag's repo, first in the
    table's order (``Qwen/Qwen2.5-0.5B-Instruct`` -> ``qwen2.5:0.5b``); a row's default tag is
    ``name:tag`` too, as ``ollama list`` shows ``llama3.2:latest``'s size tag only when pulled by it."""
    out: dict[str, str] = {}
    if library is None:
        return out
    for name in library.names:
        row = library.model(name)
        assert row is not None
        for t in row.tag:
            out.setdefault(t.repo.casefold(), f"{row.name}:{t.tag}")
    return out


def scan(library: Library | None, root: Path | None = None) -> list[LocalModel]:
    """Every loadable model repo in the cache, by name (see the module's docstring); ``[]`` when
    there is no cache. Never raises for a half-downloaded or foreign entry: it is skipped."""
    root = root or cache_dir()
    names = repo_names(library)
    out: list[LocalModel] = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return out
    for d in entries:
        if not d.name.startswith("models--") or not d.is_dir():
            continue
        repo = d.name[len("models--"):].replace("--", "/")
        snap = _snapshot(d)
        if snap is None or not (snap / "config.json").is_file():
            continue
        try:
            weights = [p for p in snap.iterdir() if p.name.endswith(_WEIGHTS)]
            size = sum(p.stat().st_size for p in weights)  # through the symlinks: the blobs' sizes
            modified = (snap / "config.json").stat().st_mtime
        except OSError:
            continue
        if not weights:
            continue
        out.append(LocalModel(name=names.get(repo.casefold(), repo), repo=repo, path=snap, size=size, modified=modified))
    return out


def find(name: str, models: list[LocalModel], library: Library | None) -> tuple[LocalModel, str] | None:
    """The local model a request's ``name`` means, and the name to serve it under; ``None`` if none.

    ``name`` may be the listed name (``qwen2.5:0.5b``, with or without ``:latest``), any library
    name resolving to the model's repo (served under that name as written, ``:latest`` dropped),
    or the repo id (any case)."""
    key = name.strip().removesuffix(":latest")
    folded = key.casefold()
    for m in models:
        if folded in (m.name.casefold().removesuffix(":latest"), m.repo.casefold()):
            return m, m.name if folded == m.name.casefold() else m.repo
    if library is not None and looks_like_library_name(key) and key.partition(":")[0] in library:
        try:
            repo = library.resolve(key).repo.casefold()
        except Exception:  # noqa: BLE001 - an unknown tag: not local
            return None
        for m in models:
            if m.repo.casefold() == repo:
                return m, key
    return None


def allowed(name: str, repo: str, patterns: list[str]) -> bool:
    """Whether the allow-list (names or shell patterns, any case) admits a model asked for as
    ``name`` whose repo is ``repo``; an empty list admits every local model."""
    if not patterns:
        return True
    candidates = {name.casefold(), name.casefold().removesuffix(":latest"), repo.casefold()}
    return any(fnmatch.fnmatchcase(c, p.casefold()) for p in patterns for c in candidates)

