"""The local models: what ``vllama pull`` (or ``huggingface-cli download``) left in the Hugging Face cache.

As Ollama lists every local model and runs any the moment a request names it (``server/routes.go``
ListHandler, ``server/sched.go``), vllama's local models are the model repos of the Hugging Face cache
(``HF_HUB_CACHE``) whose ``main`` snapshot (else newest revision) holds a ``config.json`` and
safetensors weights, named as Ollama would name them: by the library name whose repo it is
(``Qwen/Qwen2.5-0.5B-Instruct`` -> ``qwen2.5:0.5b``), else by the Hugging Face id; a request may also
use any library name of its repo or the id. Invariant: local paths are never on-demand models (a
client must not make the server load an arbitrary directory). Everything reads the disk: callers run
:func:`scan` in a worker thread; the cache is read by ``huggingface_hub``'s ``scan_cache_dir``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
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


def scan(library: Library | None) -> list[LocalModel]:
    """Every loadable model repo in the cache (``huggingface_hub.scan_cache_dir``), by name (see the
    module's docstring); ``[]`` when there is no cache. A repo is loadable when the revision its
    ``main`` ref points to (else its newest) has ``config.json`` and safetensors at its top; a
    half-downloaded or corrupted one is skipped (the library lists it in its warnings)."""
    from huggingface_hub import scan_cache_dir  # here: the server's import stays light (models/hub.py says why)
    from huggingface_hub.errors import CacheNotFound
    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    names = repo_names(library)
    out: list[LocalModel] = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = next((r for r in repo.revisions if "main" in r.refs), None) or max(repo.revisions, key=lambda r: r.last_modified)
        top = {f.file_name: f for f in rev.files if f.file_path.parent == rev.snapshot_path}
        weights = [f for name, f in top.items() if name.endswith(_WEIGHTS)]
        if "config.json" not in top or not weights:
            continue
        out.append(LocalModel(name=names.get(repo.repo_id.casefold(), repo.repo_id), repo=repo.repo_id, path=rev.snapshot_path,
                              size=sum(f.size_on_disk for f in weights), modified=top["config.json"].blob_last_modified))
    return out


#: The file naming a model directory built from uploaded blobs (``/api/create`` ``files``).
NAME_FILE = ".vllama-name"


def uploaded_dir(root: Path, name: str) -> Path:
    """The directory under ``root`` that holds the files uploaded for model ``name``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return root / f"{safe}-{hashlib.sha256(name.casefold().encode()).hexdigest()[:8]}"


def scan_uploaded(root: Path | None) -> list[LocalModel]:
    """The model directories ``/api/create`` built from uploaded files under ``root``
    (``<state_dir>/models``): each has ``config.json``, safetensors and :data:`NAME_FILE`. vLLM is
    given the directory; these are the only local paths that run on demand, as vllama made them."""
    out: list[LocalModel] = []
    if root is None or not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        try:
            name = (d / NAME_FILE).read_text().strip()
            weights = [f for f in d.iterdir() if f.name.endswith(_WEIGHTS)]
            if not name or not (d / "config.json").is_file() or not weights:
                continue
            out.append(LocalModel(name=name, repo=str(d), path=d, size=sum(f.stat().st_size for f in weights),
                                  modified=(d / "config.json").stat().st_mtime))
        except OSError:
            continue
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
