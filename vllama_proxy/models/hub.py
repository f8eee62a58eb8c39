"""Hugging Face models in the local cache: pull them (Ollama's ``/api/pull``) and delete them (``/api/delete``).

A pull fills the Hugging Face cache vLLM loads from and reports it in Ollama's words: ``pulling
manifest``, ``pulling <sha256[:12]>`` per file (``digest``, ``total``, ``completed``, at most every
100 ms; a small git file announced once, complete), ``verifying sha256 digest``, ``writing manifest``
(``refs/<revision>``, so the name resolves offline), ``success``. Files go through ``hf_hub_download``
with a byte-counting ``tqdm_class``, so cache layout, locks, Xet and ``HF_*`` variables are the
library's own; with safetensors present, weights vLLM never reads are skipped. Invariants: a pull runs
in a daemon thread of its own (a multi-GB download must neither starve ``to_thread`` work nor hold up
shutdown), its events reach the loop by ``call_soon_threadsafe``, a consumer gone stops it at its next
report, and every failure becomes a vllama error in one place, :func:`hub_error`.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import hashlib
import os
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# huggingface_hub's API, errors and HTTP client (httpx2) are imported by the functions that pull, delete
# or validate (~0.1 s, and most servers never pull): every worker of every ``vllama serve`` imports this module.
from huggingface_hub import constants

from vllama_proxy import __version__
from vllama_proxy.errors import (
    BadRequest,
    DigestMismatch,
    HubAuthRequired,
    HubBadAnswer,
    HubForbidden,
    HubModelNotFound,
    HubUnavailable,
    ModelNotFound,
    NotEnoughSpace,
    PullFailed,
    StorageFailed,
    VllamaError,
)
from vllama_proxy.logs import get_logger
from vllama_proxy.models.pull_room import PullLimits, reserve

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.hf_api import RepoFile

log = get_logger("vllama.hub")

#: The first status of every pull; routes hold it back until the manifest is known, so that
#: a missing or gated repository is still an HTTP status, not a stream that starts and fails.
MANIFEST = "pulling manifest"
#: Seconds between two progress events of one file (Ollama's own ticker is 60 ms).
PROGRESS_INTERVAL = 0.1
#: Ollama-style prefixes naming the Hugging Face Hub (``ollama pull hf.co/org/name``).
_HUB_PREFIXES = ("hf.co/", "huggingface.co/")
#: A revision after ``:``: a branch, tag or (short) commit. No ``/``: Ollama's tag syntax has none.
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
#: Weight formats vLLM does not load when safetensors are there (it prefers them, as transformers does).
_UNUSED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".onnx_data", ".ot", ".tflite", ".gguf")

Emit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class HubModel:
    """A model on the Hugging Face Hub, as named in an Ollama request.

    Attributes:
        repo_id: ``org/name``.
        revision: the branch, tag or commit after ``:``; ``None`` for none or ``latest``
            (pull: the ``main`` branch; delete: every cached revision).
    """

    repo_id: str
    revision: str | None = None

    @property
    def rev(self) -> str:
        """The revision to download: the one named, else ``main``."""
        return self.revision or constants.DEFAULT_REVISION

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.revision}" if self.revision else self.repo_id


def parse_model(name: str) -> HubModel | None:
    """The Hugging Face model ``name`` means, or ``None`` when it is not a hub id.

    ``org/name`` and ``org/name:latest`` are the ``main`` branch; ``org/name:<tag>`` names a
    revision (branch, tag or commit). ``hf.co/`` and ``huggingface.co/`` prefixes are accepted.
    A name without exactly one ``/`` (``llama3:8b``) is not a hub id.

    Raises:
        BadRequest: it has the hub form but is not a valid repo id or revision.
    """
    base = name.strip()
    for prefix in _HUB_PREFIXES:
        if base.lower().startswith(prefix):
            base = base[len(prefix):]
            break
    repo_id, _, tag = base.partition(":")
    if repo_id.count("/") != 1 or "/" in tag:
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:
        if not repo_id.isascii():  # the Hub's names are ASCII; validate_repo_id's \w is not
            raise HFValidationError(repo_id)
        validate_repo_id(repo_id)
    except HFValidationError:
        raise BadRequest(f"invalid model name '{name}': a Hugging Face model id is org/name "
                         "(ASCII letters, digits, '-', '_' and '.')") from None
    if tag.casefold() in ("", "latest"):
        return HubModel(repo_id)
    if not _REVISION.fullmatch(tag):
        raise BadRequest(f"invalid model name '{name}': '{tag}' is not a revision (branch, tag or commit)")
    return HubModel(repo_id, tag)


def select_files(paths: Iterable[str]) -> list[str]:
    """The files of a repository worth pulling for vLLM, in the order given.

    With safetensors weights in the repository, other weight formats and Meta's ``original/``
    checkpoints are left out: vLLM loads only the safetensors (its default ``--load-format
    auto`` prefers them and ignores ``original/**``). Without safetensors, everything is kept.
    """
    paths = list(paths)
    if not any(p.endswith(".safetensors") for p in paths):
        return paths
    return [p for p in paths if not p.startswith("original/") and not p.endswith(_UNUSED_WEIGHTS)]


# ---------------------------------------------------------------------------- pull


class PullCancelled(Exception):
    """The consumer of a pull left; raised in the pulling thread to stop it."""


async def pull(model: HubModel, limits: PullLimits | None = None) -> AsyncIterator[dict[str, Any]]:
    """Download ``model`` into the Hugging Face cache, yielding Ollama's progress objects.

    The last object is ``{"status": "success"}``. Closing the iterator early (``aclose``,
    cancellation) stops the download at its next progress report. With ``limits``, the bytes
    it needs are reserved before it downloads (:func:`vllama_proxy.models.pull_room.reserve`), so concurrent pulls cannot
    all pass the free-space check, and at most ``limits.max_pulls`` run at once.

    Raises:
        VllamaError: see :func:`hub_error`.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | VllamaError | None] = asyncio.Queue()
    cancel = threading.Event()

    def put(item: dict[str, Any] | VllamaError | None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody listens any more
            cancel.set()
            raise PullCancelled() from None

    def run() -> None:
        outcome: VllamaError | None = None  # None: success
        try:
            _pull(model, put, cancel, limits)
        except PullCancelled:
            log.info("pull_cancelled", model=str(model))
            return
        except Exception as e:  # noqa: BLE001 - every failure is reported to the consumer
            outcome = hub_error(e, model)
        with suppress(PullCancelled):
            put(outcome)

    # The copied context carries the request's log fields (request_id) into the thread.
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name=f"pull {model}", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, VllamaError):
                raise item
            yield item
    finally:
        cancel.set()


@dataclass
class _Verify:
    path: str
    kind: str  # "sha256" or "git blob"
    want: str
    got: str | None = None  # known already for git files (hashed when announced)


def _pull(model: HubModel, emit: Emit, cancel: threading.Event, limits: PullLimits | None = None) -> None:
    """The blocking pull, run in a worker thread; ``emit`` hands one event to the event loop."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.hf_api import RepoFile
    started = time.monotonic()
    emit({"status": MANIFEST})
    if constants.is_offline_mode():
        _pull_offline(model)
        emit({"status": "success"})
        return
    api = HfApi(library_name="vllama", library_version=__version__)
    info = api.model_info(model.repo_id, revision=model.rev)
    if info.gated:
        api.auth_check(model.repo_id)  # GatedRepoError now, before any file event
    commit = info.sha
    if not commit:
        raise HubBadAnswer(f"the Hugging Face Hub at {constants.ENDPOINT} did not say which commit '{model}' is")
    tree = [f for f in api.list_repo_tree(model.repo_id, revision=commit, recursive=True) if isinstance(f, RepoFile)]
    keep = set(select_files(f.path for f in tree))
    files = [f for f in tree if f.path in keep]
    cached = {f.path: p for f in files if isinstance(p := try_to_load_from_cache(model.repo_id, f.path, revision=commit), str)}
    needed = sum(f.size for f in files if f.path not in cached)
    with reserve(str(model), needed, limits):
        log.info("pull_started", model=str(model), commit=commit, files=len(files), cached=len(cached), bytes=needed)
        checks: list[_Verify] = []
        for f in files:
            if cancel.is_set():
                raise PullCancelled()
            checks += _pull_file(model, commit, f, cached.get(f.path), emit, cancel)
    emit({"status": "verifying sha256 digest"})
    for check in checks:
        if cancel.is_set():
            raise PullCancelled()
        _verify(check)
    emit({"status": "writing manifest"})
    _write_ref(model, commit)
    log.info("pull_finished", model=str(model), commit=commit, bytes=needed, duration_s=round(time.monotonic() - started, 3))
    emit({"status": "success"})


def _pull_file(model: HubModel, commit: str, f: RepoFile, cached: str | None, emit: Emit,
               cancel: threading.Event) -> list[_Verify]:
    """Download (or find) one file and announce it; returns what the verify step must check."""
    sha256 = f.lfs.sha256 if f.lfs is not None else None
    if sha256 is None:  # a git file: its sha256 is known only once it is here
        path = cached or _download(model, commit, f.path, _Silent)
        got_sha256, got_blob = _hashes(path)
        progress = _Progress(emit, got_sha256, f.size, cancel)
        progress.finish()
        return [] if cached else [_Verify(path, "git blob", f.blob_id, got_blob)]
    progress = _Progress(emit, sha256, f.size, cancel)
    if cached:
        progress.finish()
        return []
    progress.send()
    path = _download(model, commit, f.path, progress.bar_class())
    progress.finish()
    return [_Verify(path, "sha256", sha256)]


def _download(model: HubModel, commit: str, path: str, bar: type) -> str:
    from huggingface_hub import hf_hub_download
    return hf_hub_download(model.repo_id, path, revision=commit, tqdm_class=bar,
                           library_name="vllama", library_version=__version__)


def _pull_offline(model: HubModel) -> None:
    """With ``HF_HUB_OFFLINE`` set a pull succeeds only for a model already complete in the cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        snapshot_download(model.repo_id, revision=model.rev, local_files_only=True)
    except LocalEntryNotFoundError:  # IncompleteSnapshotError too
        raise HubUnavailable(
            f"cannot pull '{model}': HF_HUB_OFFLINE is set, so nothing is downloaded from the Hugging Face Hub, "
            f"and it is not in the cache at {constants.HF_HUB_CACHE}; unset HF_HUB_OFFLINE to pull it"
        ) from None


class _Progress:
    """Ollama's ``pulling <digest>`` events for one file, fed by huggingface_hub's progress bar.

    ``update`` comes from the pulling thread (plain HTTP, once per 10 MiB read) or from hf_xet's
    threads (Xet). Cancellation is raised only in the pulling thread, where huggingface_hub
    lets it unwind the download and remove the partial file.
    """

    def __init__(self, emit: Emit, sha256: str, total: int, cancel: threading.Event) -> None:
        self._emit = emit
        self._digest = "sha256:" + sha256
        self._status = "pulling " + sha256[:12]
        self._total = total
        self._cancel = cancel
        self._owner = threading.get_ident()
        self._lock = threading.Lock()
        self._completed = 0
        self._sent: int | None = None
        self._sent_at = 0.0

    def send(self) -> None:
        with self._lock:
            completed = self._completed
            self._sent, self._sent_at = completed, time.monotonic()
        self._emit({"status": self._status, "digest": self._digest, "total": self._total, "completed": completed})

    def add(self, n: float) -> None:
        with self._lock:
            self._completed = max(0, min(self._total, self._completed + int(n)))
            due = time.monotonic() - self._sent_at >= PROGRESS_INTERVAL and self._completed != self._sent
        if self._cancel.is_set() and threading.get_ident() == self._owner:
            raise PullCancelled()
        if due:
            self.send()

    def finish(self) -> None:
        self._completed = self._total
        if self._sent != self._total:
            self.send()

    def bar_class(self) -> type:
        """A ``tqdm_class`` for ``hf_hub_download`` that reports to this file's progress."""
        progress = self

        class Bar(_Silent):
            def update(self, n: float | None = 1) -> None:
                self.n += n or 0
                progress.add(n or 0)

        return Bar


class _Silent:
    """The part of tqdm's interface huggingface_hub drives, doing nothing (no bars on the server's stderr).

    ``update_transfer`` makes hf_xet report network and disk progress through one bar, of
    which ``update`` counts the bytes written.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.n = 0
        self.total = kwargs.get("total")
        if kwargs.get("initial"):  # a resumed download starts with the bytes it has
            self.update(kwargs["initial"])

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0

    def update_transfer(self, n: float | None = 1) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hashes(path: str) -> tuple[str, str]:
    """``(sha256, git blob id)`` of a file."""
    size = os.path.getsize(path)
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha256.update(chunk)
            sha1.update(chunk)
    return sha256.hexdigest(), sha1.hexdigest()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _verify(check: _Verify) -> None:
    """Ollama's check after download; a mismatch removes the file (from the blobs and the snapshot)."""
    got = check.got or _sha256(check.path)
    if got == check.want:
        return
    blob = os.path.realpath(check.path)
    for p in (check.path, blob):
        Path(p).unlink(missing_ok=True)
    prefix = "sha256:" if check.kind == "sha256" else "git blob "
    raise DigestMismatch(f"digest mismatch, file must be downloaded again: want {prefix}{check.want}, got {prefix}{got}")


def _write_ref(model: HubModel, commit: str) -> None:
    """``refs/<revision>`` -> commit (the cache's own record of a branch or tag), written atomically."""
    if model.rev == commit:
        return
    from huggingface_hub.file_download import repo_folder_name
    ref = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=model.repo_id, repo_type="model") / "refs" / model.rev
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f"{ref.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


# ---------------------------------------------------------------------------- delete


def delete(model: HubModel, name: str) -> list[str]:
    """Remove ``model`` from the Hugging Face cache (blocking); returns the commits removed.

    Without a revision every cached revision goes (and with them the repository's folder);
    with one, only the revisions it names (a branch or tag in ``refs/``, or a commit prefix).

    Raises:
        ModelNotFound: nothing of it is cached (``model 'name' not found``).
    """
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        info = scan_cache_dir()
    except CacheNotFound:
        raise ModelNotFound(name) from None
    wanted = model.repo_id.casefold()
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id.casefold() == wanted), None)
    revisions = [] if repo is None else [
        r for r in repo.revisions
        if model.revision is None or model.revision in r.refs or r.commit_hash.startswith(model.revision)
    ]
    if not revisions:
        raise ModelNotFound(name)
    commits = [r.commit_hash for r in revisions]
    strategy = info.delete_revisions(*commits)
    strategy.execute()
    log.info("model_deleted", model=str(model), commits=commits, freed_bytes=strategy.expected_freed_size)
    return commits


# ---------------------------------------------------------------------------- errors


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes, as Python's traceback shows them (explicit cause, else context)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)


def hub_error(exc: BaseException, model: HubModel) -> VllamaError:
    """The one mapping of a failed pull onto vllama's errors (status + Ollama-style message).

    404 unknown repository or revision (Ollama's ``pull model manifest: file does not
    exist``, naming the hub); 401/403 gated or private (saying to set ``HF_TOKEN``); 503 hub
    unreachable, rate-limited or ``HF_HUB_OFFLINE``; 507 disk full; 502 the hub misbehaved.
    """
    if isinstance(exc, VllamaError):
        return exc
    import httpx2
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        DisabledRepoError,
        FileMetadataError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    chain = list(_chain(exc))

    def find(*types: type[BaseException]) -> Any:
        return next((e for e in chain if isinstance(e, types)), None)

    full = next((e for e in chain if isinstance(e, OSError) and e.errno == errno.ENOSPC), None)

    endpoint, cache, repo = constants.ENDPOINT, constants.HF_HUB_CACHE, model.repo_id
    url = f"{endpoint}/{repo}"
    token = get_token() is not None
    if find(OfflineModeIsEnabled):
        return HubUnavailable(f"cannot pull '{model}': HF_HUB_OFFLINE is set, so nothing is downloaded from the Hugging Face Hub; "
                              "unset it to pull")
    if find(GatedRepoError):
        if token:
            return HubForbidden(f"'{repo}' is a gated model and the account of HF_TOKEN has no access to it: "
                                f"request access at {url}")
        return HubAuthRequired(f"'{repo}' is a gated model on the Hugging Face Hub: accept its conditions at {url} "
                               "and set HF_TOKEN to a token of that account")
    if find(RevisionNotFoundError):
        return HubModelNotFound(f"pull model manifest: file does not exist: '{repo}' has no revision '{model.rev}' "
                                f"on the Hugging Face Hub at {endpoint}")
    if find(RepositoryNotFoundError):
        hint = "; if it is private, check that the account of HF_TOKEN can read it" if token else \
            "; if it is private, set HF_TOKEN to a token that can read it"
        return HubModelNotFound(f"pull model manifest: file does not exist: no model '{repo}' on the Hugging Face Hub "
                                f"at {endpoint}{hint}")
    if find(DisabledRepoError):
        return HubForbidden(f"'{repo}' is disabled on the Hugging Face Hub at {endpoint}")
    if (e := find(RemoteEntryNotFoundError)) is not None:
        return HubBadAnswer(f"the Hugging Face Hub at {endpoint} lists a file of '{model}' it does not serve: {_first_line(e)}")
    if full is not None:
        return NotEnoughSpace(f"not enough disk space in {cache} to pull '{model}': {full.strerror or full}")
    if (e := find(httpx2.TransportError, ConnectionError, TimeoutError)) is not None:
        return HubUnavailable(f"cannot reach the Hugging Face Hub at {endpoint}: {_first_line(e)}")
    if (e := find(HfHubHTTPError)) is not None:
        return _http_error(e, model, token)
    if (e := find(FileMetadataError)) is not None:
        return HubBadAnswer(f"the server at {endpoint} (HF_ENDPOINT) does not answer like the Hugging Face Hub: "
                            f"{_first_line(e)}")
    if (e := find(LocalEntryNotFoundError)) is not None:  # a download that found neither the hub nor a cached copy
        return HubUnavailable(f"cannot reach the Hugging Face Hub at {endpoint}: {_first_line(e)}")
    if (e := find(OSError)) is not None:
        return StorageFailed(f"cannot write '{model}' to the Hugging Face cache at {cache}: {_first_line(e)}")
    log.error("pull_failed", model=str(model), error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    return PullFailed(f"cannot pull '{model}': {type(exc).__name__}: {_first_line(exc)}")


def _http_error(e: HfHubHTTPError, model: HubModel, token: bool) -> VllamaError:
    endpoint = constants.ENDPOINT
    status = e.response.status_code if e.response is not None else 0
    if status == 401:
        fix = "HF_TOKEN was refused: set it to a valid token" if token else "set HF_TOKEN to a token that can read it"
        return HubAuthRequired(f"the Hugging Face Hub at {endpoint} requires authentication for '{model.repo_id}': {fix}")
    if status == 403:
        return HubForbidden(f"the Hugging Face Hub at {endpoint} forbids access to '{model.repo_id}'"
                            + (" for the account of HF_TOKEN" if token else "; set HF_TOKEN to a token that can read it"))
    if status == 429:
        return HubUnavailable(f"the Hugging Face Hub at {endpoint} is rate-limiting this server (429); try again later"
                              + ("" if token else " or set HF_TOKEN for a higher limit"))
    return HubBadAnswer(f"the Hugging Face Hub at {endpoint} answered {status or 'an error'}: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
