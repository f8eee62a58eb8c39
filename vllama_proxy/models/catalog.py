"""Which models vLLM serves, under which Ollama names, with which capabilities.

The models vllama launches are known from its settings; an ``--upstream`` vLLM is asked ``GET
/v1/models``. Invariant: resolving a name on the request path is a dict lookup, not a round trip: a
stale list is served while a refresh runs in the background, and only an unknown name forces one (at
most once a second), so a model added upstream is found. Names follow Ollama (``docs/wire.md``): each
served model is listed as ``<served>:latest``; aliases, library names and created models resolve in
``models/names.py``'s order, which the catalog feeds with the served models, asking the on-demand
slots last; an unknown name is a 404 naming the closest known ones. Resolving also chooses where the
requests go (:meth:`Catalog.backend_of`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from vllama_proxy.errors import ModelNotFound, UpstreamError
from vllama_proxy.logs import get_logger
from .vllm_servers import ServedModel
from .launch_spec import has_flag, vllm_arg
from .fim import FimFormat, fim_format
from .library import Library, load as load_library, looks_like_library_name
from .library_advice import advice
from .model_files import ModelFiles, read_model_files
from .names import LATEST, Names, ollama_name, strip_latest  # noqa: F401 - re-exported: the catalog's callers use them

if TYPE_CHECKING:  # pragma: no cover
    from .aliases import AliasStore
    from .vllm_servers import Backend
    from .created import CreatedModel, CreatedStore
    from .on_demand import OnDemand

log = get_logger("vllama.catalog")

def capabilities(model: ServedModel, files: ModelFiles) -> list[str]:
    """Ollama capabilities from how vLLM was started and what the model is.

    ``embedding`` for pooling runners (``--runner pooling``, ``--task embed``,
    ``--convert embed``), else ``completion``; ``tools`` only with
    ``--enable-auto-tool-choice`` and a ``--tool-call-parser``; ``thinking`` with a
    ``--reasoning-parser``; ``vision`` when the config has a vision tower. ``insert``
    (``suffix``) is added by :meth:`Catalog.capabilities` for a model with a fill-in-the-middle
    format (``models/fim.py``): vLLM's completions endpoint has no ``suffix`` of its own.
    """
    args = model.vllm_args
    pooling = (vllm_arg(args, "--runner") == "pooling" or vllm_arg(args, "--task") in ("embed", "embedding")
               or vllm_arg(args, "--convert") == "embed")
    caps = ["embedding"] if pooling else ["completion"]
    if not pooling:
        if has_flag(args, "--enable-auto-tool-choice") and has_flag(args, "--tool-call-parser"):
            caps.append("tools")
        if has_flag(args, "--reasoning-parser"):
            caps.append("thinking")
        cfg = files.config
        if "vision_config" in cfg or "image_token_id" in cfg or "image_token_index" in cfg:
            caps.append("vision")
    return caps


#: ``Catalog.resolve``'s ``made`` when the caller did not read the created models' file.
_UNREAD: object = object()


class Catalog:
    """The served models, their Ollama names, and the backend serving each.

    Args:
        backends: the vLLM servers. One launched by vllama names its model (known even
            while it sleeps, is unloaded or starts; its ``/v1/models`` only refines the
            context length once it is ready). One given by ``--upstream`` is asked what it serves.
        aliases: Ollama name -> served name (``--alias`` and the config's ``aliases``).
        vllm_args: arguments vLLM runs with, per served name (``"*"`` for all), for an
            ``--upstream`` server's models.
        ttl: seconds a fetched list counts as fresh.
        store: aliases made with ``/api/copy`` (:class:`~vllama_proxy.models.aliases.AliasStore`).
        library: Ollama library names -> repos (``models/library.py``), for names that are not served names.
        on_demand: local models started when a request names them (``models/on_demand.py``; ``None``: off).
        created: models made with ``/api/create`` (``models/created.py``): each resolves to its base.
    """

    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        aliases: Mapping[str, str] | None = None,
        vllm_args: Mapping[str, Iterable[str]] | None = None,
        ttl: float = 10.0,
        store: AliasStore | None = None,
        library: Library | None = None,
        on_demand: OnDemand | None = None,
        created: CreatedStore | None = None,
    ) -> None:
        self._on_demand = on_demand
        self._created = created
        self._backends = list(backends)
        self._library = library
        #: every name but the on-demand ones resolves there (models/names.py)
        self.names = Names(aliases, store=store, created=created, library=library)
        self._store = store
        self._args = {k: tuple(v) for k, v in (vllm_args or {}).items()}
        self._ttl = ttl
        self._backend_of: dict[str, Backend] = {b.model.name: b for b in self._backends if b.model is not None}
        self._models: dict[str, ServedModel] | None = None
        if all(b.model is not None for b in self._backends):  # all launched by vllama: known up front
            self._models = {b.model.name: b.model for b in self._backends if b.model is not None}
            self._fetched_at = time.monotonic()
        else:
            self._fetched_at = 0.0
        self._fetch_task: asyncio.Task[dict[str, ServedModel]] | None = None
        self._refined: set[str] = set()  # launched models whose context their ready vLLM reported
        self._files: dict[str, asyncio.Task[ModelFiles]] = {}
        self._caps: dict[ServedModel, tuple[ModelFiles, tuple[str, ...]]] = {}  # capabilities(): per model and its files

    async def models(self) -> list[ServedModel]:
        """All served models (fetching the list if none is cached), then those on-demand slots hold."""
        served = list((await self._current()).values()) if self._backends else []
        if self._on_demand is not None:
            names = {s.name for s in served}
            served += [m for m in self._on_demand.models() if m.name not in names]
        return served

    @property
    def on_demand(self) -> OnDemand | None:
        return self._on_demand

    async def resolve(self, name: str, *, claim: bool = False, made: CreatedModel | None | object = _UNREAD,
                      evict_kept: bool = True) -> ServedModel:
        """The served model an Ollama name refers to (for a model made with ``/api/create``: its base).

        ``claim``: a local model no on-demand slot holds claims one (it will load) — only inference
        and an explicit load ask for that; a lookup (show, copy, pull, delete, ``GET /v1/models/X``)
        gets the model as it would be served and changes nothing of what is loaded.

        Raises:
            ModelNotFound: neither a served name (with or without ``:latest``, any case), an alias,
                nor a library name of a served repo; for a name of the library's form, the message
                says what is close and how to name a Hugging Face model.
            UpstreamUnavailable: no list is cached and vLLM cannot be asked.

        ``evict_kept``: a claim may end another model's keep_alive for its slot (false for a user key's).

        ``made``: what :meth:`created` said of ``name`` when the caller already asked (one look at the
        created models' file per request, not one per step).
        """
        if made is _UNREAD:
            made = self.created(name)
        if made is not None:
            return await self._resolve(made.base, claim, evict_kept)  # a served name: created models never stand on created ones
        return await self._resolve(name, claim, evict_kept)

    def is_served_name(self, name: str) -> bool:
        """Whether ``name`` names a served model or an alias in the list cached now (no fetch, no
        on-demand start): ``/api/create`` does not replace those."""
        return self._lookup(self._models or {}, name) is not None

    def created(self, name: str) -> CreatedModel | None:
        """The model made with ``/api/create`` that ``name`` names, else ``None``."""
        return self.names.created(name)

    def created_models(self) -> list[CreatedModel]:
        """Every model made with ``/api/create``."""
        return list(self._created.current().values()) if self._created is not None else []

    @property
    def created_store(self) -> CreatedStore:
        """Where ``/api/create`` keeps its models.

        Raises:
            RuntimeError: the catalog was built without one.
        """
        return _given(self._created, "created-model store")

    async def _resolve(self, name: str, claim: bool, evict_kept: bool = True) -> ServedModel:
        models = await self._current() if self._backends else {}
        found = self._lookup(models, name)
        if found is None and self._on_demand is not None:
            target = self.names.alias_target(name) or name  # an alias made with /api/copy of an on-demand model
            found = self._on_demand.held(target) or (await self._on_demand.claim(target, evict_kept=evict_kept) if claim
                                                     else await self._on_demand.lookup(target))
        if found is None and self._backends and time.monotonic() - self._fetched_at > 1.0:
            found = self._lookup(await self._fetch(), name)
        if found is None:
            raise self.not_found(name, models)
        return found

    @property
    def library(self) -> Library | None:
        return self._library

    def not_found(self, name: str, models: Mapping[str, ServedModel]) -> ModelNotFound:
        """The 404 for ``name``: with the library's advice when it has a library name's form; "try
        pulling it first" (Ollama's words) for one on-demand would start once it is pulled."""
        pull = "try pulling it first (vllama pull, or POST /api/pull)"
        if self._on_demand is not None and name.strip().count("/") == 1:
            return ModelNotFound(name, pull)
        if self._on_demand is not None and self._library is not None and name.strip() in self._library:
            try:
                entry = self._library.resolve(name)
            except ModelNotFound as e:  # an unknown tag: the name's tags
                return e
            return ModelNotFound(name, f"vllama's library maps it to {entry.repo}, which is not pulled here; {pull}")
        if self._library is None or not looks_like_library_name(name.strip()):
            return ModelNotFound(name)
        try:
            entry = self._library.resolve(name)
        except ModelNotFound as e:
            if name.partition(":")[0] in self._library:  # a known name, an unknown tag
                return e
            return ModelNotFound(name, advice(name, self._library.names, [strip_latest(n) for n in models]))
        return ModelNotFound(name, f"vllama's library maps it to {entry.repo}, which this server does not serve")

    def backend_of(self, model: ServedModel) -> Backend:
        """The backend serving ``model`` (an ``--upstream`` server serves every model it lists).

        Raises:
            ModelNotFound: an on-demand model no slot holds any more (another model took it).
        """
        found = self._backend_of.get(model.name)
        if found is None and self._on_demand is not None:
            found = self._on_demand.backend_of(model)
            if found is None:
                raise ModelNotFound(model.name, "it was unloaded; retry")
        return found or self._backends[0]

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends)

    def aliases(self) -> dict[str, str]:
        """Every alias -> served name: configured ones, then those made with ``/api/copy``."""
        return self.names.aliases()

    @property
    def store(self) -> AliasStore:
        """Where ``/api/copy`` keeps aliases.

        Raises:
            RuntimeError: the catalog was built without one.
        """
        return _given(self._store, "alias store")

    def is_configured_alias(self, name: str) -> bool:
        """Whether ``name`` is an alias from the settings (``/api/copy`` does not replace those)."""
        return self.names.is_configured_alias(name)

    def names_for(self, model: ServedModel) -> list[str]:
        """Every Ollama name of ``model``: ``<served>:latest`` first, then its aliases."""
        names = [ollama_name(model.name)]
        for alias, target in self.aliases().items():
            if target == model.name and ollama_name(alias) not in names:
                names.append(ollama_name(alias))
        return names

    async def files(self, model: ServedModel) -> ModelFiles:
        """The model's own files (read once, in a worker thread, then cached)."""
        task = self._files.get(model.name)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.ensure_future(asyncio.to_thread(read_model_files, model.root, model.name))
            self._files[model.name] = task
        return await asyncio.shield(task)

    async def capabilities(self, model: ServedModel) -> list[str]:
        """See :func:`capabilities`; ``insert`` when :meth:`fim` finds a format. Worked out once per
        model (its arguments and files do not change; every generate and chat request asks)."""
        files = await self.files(model)
        hit = self._caps.get(model)
        if hit is not None and hit[0] is files:
            return list(hit[1])
        caps = capabilities(model, files)
        if "completion" in caps and await self.fim(model) is not None:
            caps.append("insert")
        if len(self._caps) >= 256:  # models come and go (on demand, a refreshed list): keep it small
            self._caps.clear()
        self._caps[model] = (files, tuple(caps))
        return caps

    async def fim(self, model: ServedModel) -> FimFormat | None:
        """The model's fill-in-the-middle format (``models/fim.py``), or ``None``."""
        if self._library is None:
            self._library = load_library()
        return fim_format(model.root, await self.files(model), self._library)

    def is_configured(self, model: ServedModel) -> bool:
        """Whether ``model`` is one of the operator's (``--model``, ``[[models]]``, ``--upstream``), not an on-demand one."""
        return model.name in self._backend_of or (bool(self._backends) and self._backends[0].model is None)

    # -- internals -------------------------------------------------------------
    def _lookup(self, models: Mapping[str, ServedModel], name: str) -> ServedModel | None:
        return self.names.lookup(models, name)

    async def _current(self) -> dict[str, ServedModel]:
        if self._models is None or any(b.model is not None and b.model.name not in self._refined
                                       and b.board is not None and b.board.ready for b in self._backends):
            return await self._fetch()  # a launched model's vLLM is ready: its context, as it reports it, from now on
        if time.monotonic() - self._fetched_at > self._ttl and (self._fetch_task is None or self._fetch_task.done()):
            self._fetch_task = asyncio.ensure_future(self._do_fetch())
            self._fetch_task.add_done_callback(_consume_exception)
        return self._models

    async def _fetch(self) -> dict[str, ServedModel]:
        # One fetch at a time, shared by every waiter; shielded so that a client
        # leaving does not cancel the fetch other requests wait on.
        if self._fetch_task is None or self._fetch_task.done():
            self._fetch_task = asyncio.ensure_future(self._do_fetch())
            self._fetch_task.add_done_callback(_consume_exception)
        return await asyncio.shield(self._fetch_task)

    async def _do_fetch(self) -> dict[str, ServedModel]:
        models: dict[str, ServedModel] = {}
        for backend in self._backends:
            if backend.model is not None:
                models[backend.model.name] = await self._refine(backend, backend.model)
                continue
            try:
                data = await backend.upstream.get_json("/v1/models")
            except UpstreamError:
                if self._models is not None:
                    log.warning("models_refresh_failed", keeping=len(self._models))
                    return self._models
                raise
            for entry in _entries(data):
                name = str(entry["id"])
                args = self._args.get(name, self._args.get("*", ()))
                models[name] = ServedModel(
                    name=name,
                    root=str(entry.get("root") or name),
                    max_model_len=entry.get("max_model_len") if isinstance(entry.get("max_model_len"), int) else None,
                    created=int(entry.get("created") or time.time()),
                    vllm_args=args,
                )
        if models != self._models:
            log.info("models", served=sorted(models))
        self._models = models
        self._fetched_at = time.monotonic()
        return models

    async def _refine(self, backend: Backend, known: ServedModel) -> ServedModel:
        """A launched model, with the context length its ready vLLM reports (vLLM may derive
        one shorter than the config's); as configured while it is not ready."""
        current = (self._models or {}).get(known.name, known)
        if backend.board is None or not backend.board.ready:
            return current
        self._refined.add(known.name)  # asked once it is ready (again each ttl): not on every request if it fails
        try:
            data = await backend.upstream.get_json("/v1/models")
        except UpstreamError:
            return current
        context = reported_context(data, known.name)
        return replace(current, max_model_len=context) if context is not None else current


def reported_context(data: object, name: str) -> int | None:
    """The ``max_model_len`` a ``/v1/models`` answer (vLLM's ``ModelCard``) gives model ``name``; ``None``: none."""
    for entry in _entries(data):
        if entry["id"] == name and isinstance(entry.get("max_model_len"), int):
            return entry["max_model_len"]
    return None


def _entries(data: object) -> list[dict]:
    """The model entries of a ``/v1/models`` answer (malformed ones skipped)."""
    items = data.get("data", []) if isinstance(data, dict) else []
    return [e for e in items if isinstance(e, dict) and e.get("id")]


def _consume_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


_T = TypeVar("_T")


def _given(store: _T | None, what: str) -> _T:
    """``store``, which the catalog needs here and was built with; ``RuntimeError("no <what>")`` when it was not."""
    if store is None:
        raise RuntimeError(f"no {what}")
    return store
