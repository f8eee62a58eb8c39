"""Local models started the moment a request names them, as Ollama does (``--on-demand``, on by default).

The catalog (``catalog.py``) asks here when a name is none of the configured models: a
name an on-demand slot already holds resolves to that slot's backend; a local model
(``local.py``: pulled into the Hugging Face cache) that the allow-list admits claims a slot
(``supervisor/slots.py``, handed in from above), served under the name as asked with its
library name's vLLM arguments (tool calling, reasoning parser, pooling runner: ``library.py``
``resolve_spec``) after those of the server's own ``--`` arguments that are safe for any repo
(:func:`safe_args`). The request then waits for it to
load like any unloaded model's (``api/routes/model_use.py`` ``model_in_use``), and the pool makes
GPU room by evicting least-recently-used idle models.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vllama_proxy.errors import ModelNotAllowed, SlotsFull, SlotsKept
from vllama_proxy.logs import get_logger
from . import local
from .vllm_servers import ServedModel
from .family import with_detected_parsers
from .boards import SlotBoard
from .launch_spec import ModelConfig
from .library import Library, resolve_spec

if TYPE_CHECKING:  # pragma: no cover
    from .vllm_servers import Backend

log = get_logger("vllama.on_demand")


#: The operator's ``--`` arguments an on-demand model gets: those that size, place and
#: tune the engine, safe for any repository a user may pull. Flag -> whether it takes a value.
#: Everything else is left out: ``--trust-remote-code`` (runs the repo's own Python),
#: ``--load-format`` (``pt`` unpickles), ``--hf-overrides``, ``--tokenizer``, ``--chat-template``,
#: ``--tool-parser-plugin``, ``--middleware``, ``--allowed-local-media-path``, ``--revision``...:
#: they are right for the model the operator named, not for whatever a user pulls. A library
#: entry's own arguments (``models/library.toml``) still apply to the repos it lists.
SAFE_FOR_ANY_REPO: dict[str, bool] = {
    **dict.fromkeys((
        "--gpu-memory-utilization", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
        "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
        "--dtype", "--kv-cache-dtype", "--block-size", "--swap-space", "--cpu-offload-gb", "--seed",
        "--api-server-count", "--scheduling-policy", "--max-logprobs", "--uvicorn-log-level",
        "--distributed-executor-backend", "--max-num-partial-prefills", "--long-prefill-token-threshold",
        "--compilation-config", "-O", "--max-parallel-loading-workers", "--kv-cache-memory-bytes",
        "--allowed-media-domains", "--limit-mm-per-prompt", "--max-seq-len-to-capture",
    ), True),
    **dict.fromkeys((
        "--enforce-eager", "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
        "--no-enable-chunked-prefill", "--disable-log-stats", "--disable-log-requests", "--enable-log-requests",
        "--disable-uvicorn-access-log", "--enable-sleep-mode", "--disable-custom-all-reduce", "--enable-expert-parallel",
        "--async-scheduling", "--no-async-scheduling", "--disable-cascade-attn", "--disable-fastapi-docs",
    ), False),
}


def safe_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(kept, left out)`` of the operator's ``--`` arguments for on-demand models: only the flags of
    :data:`SAFE_FOR_ANY_REPO` (``--flag value``, ``--flag=value`` or a bare switch) are kept; any
    other flag is left out with its value (the token after it when that is not a flag)."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, _ = arg.partition("=")
        takes = SAFE_FOR_ANY_REPO.get(flag)
        value = not eq and i + 1 < len(args) and not args[i + 1].startswith("-")
        if takes is None:
            n = 2 if value else 1
            dropped += args[i:i + n]
        else:
            n = 2 if takes and not eq and i + 1 < len(args) else 1
            kept += args[i:i + n]
        i += n
    return kept, dropped


class OnDemand:
    """The on-demand slots as the request path sees them.

    Args:
        slots: the slot table (``supervisor/slots.py``: ``find``, ``spec``, ``claim``, ``boards``).
        backends: one per slot, in slot order (its board and its vLLM's URL).
        library: for names and each family's vLLM arguments.
        allow: the allow-list (``--on-demand-models``; empty: every local model).
        vllm_args: the server's own arguments after ``--``; those safe for any repo (:func:`safe_args`)
            are given to every on-demand model.
        keep_alive: the server's default keep_alive (``--keep-alive``), as each model's own.
        load_timeout: seconds a request waits for a slot to free up (``--load-timeout``).
        worker: this proxy process's index (``--workers``): the slots' news it waits on.
        ttl: seconds a scan of the cache counts as fresh (a miss rescans at most this often).
        uploaded: where ``/api/create`` builds models from uploaded files (``local.scan_uploaded``).
        detect_parsers: a model no library name lists gets the parsers its chat template tells (``family.py``).
    """

    def __init__(self, slots: SlotBoard, backends: Sequence[Backend], *, library: Library | None, allow: list[str],
                 vllm_args: list[str], keep_alive: str | None = None, load_timeout: float = 600.0, ttl: float = 2.0,
                 uploaded: Path | None = None, detect_parsers: bool = True, worker: int = 0) -> None:
        self.worker = worker
        self.uploaded = uploaded
        self.detect_parsers = detect_parsers
        self.slots = slots
        self.load_timeout = load_timeout
        self.backends = list(backends)
        self.library = library
        self.allow = list(allow)
        self.vllm_args, _ = safe_args(vllm_args)  # never --trust-remote-code and its kin
        self.keep_alive = keep_alive
        self.ttl = ttl
        self._scan: list[local.LocalModel] = []
        self._scanned_at = 0.0
        self._task: asyncio.Task[list[local.LocalModel]] | None = None
        self._served_cache: dict[int, tuple[int, ServedModel | None]] = {}  # slot -> (its generation, its model)

    async def local(self, *, fresh: bool = False) -> list[local.LocalModel]:
        """The local models (a scan of the cache, in a worker thread, shared by concurrent callers)."""
        if fresh or time.monotonic() - self._scanned_at > self.ttl:
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(asyncio.to_thread(self._scan_all))
            self._scan = await asyncio.shield(self._task)
            self._scanned_at = time.monotonic()
        return self._scan

    def _scan_all(self) -> list[local.LocalModel]:
        return local.scan(self.library) + local.scan_uploaded(self.uploaded)

    def held(self, name: str) -> ServedModel | None:
        """The model a slot holds under served name ``name`` (``:latest`` ignored, any case)."""
        i = self.slots.find(name.strip().removesuffix(":latest"))
        return self._served(i) if i is not None else None

    def models(self) -> list[ServedModel]:
        """The models the slots hold now (loaded or not)."""
        out = []
        for i in range(len(self.slots)):
            m = self._served(i)
            if m is not None:
                out.append(m)
        return out

    def backend_of(self, model: ServedModel) -> Backend | None:
        i = self.slots.find(model.name)
        return self.backends[i] if i is not None else None

    async def lookup(self, name: str) -> ServedModel | None:
        """The model ``name`` names, as it would be served, without claiming a slot or loading it:
        the slot's model when one holds it, else the local model's (``None``: no local model).
        What ``/api/show``, ``/api/copy``, ``/api/pull``, ``/api/delete`` and ``GET /v1/models/<name>``
        read (looking a model up never loads it).

        Raises:
            ModelNotAllowed: a local model the allow-list does not admit.
        """
        held = self.held(name)
        if held is not None:
            return held
        spec = await self._spec(name)
        return None if spec is None else _served_model(spec)

    def serving(self, name: str, repo: str | None = None) -> bool:
        """Whether a slot holds served name ``name`` (or a model of ``repo``) loaded, loading, asleep
        or with requests using or waiting for it: its weights must stay (``/api/delete``)."""
        for i in range(len(self.slots)):
            model = self._served(i)
            if model is None:
                continue
            if model.name.casefold() != name.casefold() and (repo is None or model.root.casefold() != repo.casefold()):
                continue
            if not self.slots.reusable(i):
                return True
        return False

    async def claim(self, name: str, *, evict_kept: bool = True) -> ServedModel | None:
        """The slot's model for ``name`` when it names a local model (claiming a slot for it); ``None``
        when it names none. Only inference and an explicit load (an empty-prompt generate) claim.

        Raises:
            ModelNotAllowed: a local model the allow-list does not admit.
            SlotsFull: every slot holds a model in use (``SlotTable.claim``), and none became free
                within ``load_timeout``; with ``evict_kept`` false (a user key's claim), every slot holds a model
                within its keep_alive: 503 with ``Retry-After`` until the first one ends.
        """
        spec = await self._spec(name)
        if spec is None:
            return None
        i = await self._claim(spec, evict_kept)
        log.info("on_demand_claim", model=spec.served_name, repo=spec.model, slot=i)
        return self._served(i)

    async def _spec(self, name: str) -> ModelConfig | None:
        """The on-demand spec of the local model ``name`` names (``None``: none): served under the
        name as asked, its family's vLLM arguments after the operator's safe ones (:func:`safe_args`)."""
        found = local.find(name, await self.local(), self.library)
        if found is None:
            found = local.find(name, await self.local(fresh=True), self.library)  # pulled a moment ago
        if found is None:
            return None
        model, served = found
        if not local.allowed(served, model.repo, self.allow):
            raise ModelNotAllowed(f"model '{name}' is a local model, but this server starts only "
                                  f"{', '.join(self.allow)} on demand (--on-demand-models)")
        # the family's vLLM arguments: by the library name asked for, else by the one the repo is listed under
        key = served if self.library is not None and "/" not in served and served.partition(":")[0] in self.library else None
        key = key or local.repo_names(self.library).get(model.repo.casefold())
        spec = ModelConfig(model=key or model.repo, name=served, vllm_args=self.vllm_args, keep_alive=self.keep_alive, preload=False)
        if key and self.library is not None:
            spec, _ = resolve_spec(spec, self.library)
            spec = spec.model_copy(update={"model": model.repo})  # the cached repo (a quantization tag names another)
        elif self.detect_parsers:
            spec = await asyncio.to_thread(with_detected_parsers, spec)  # its chat template tells its parsers
        return spec

    async def _claim(self, spec: ModelConfig, evict_kept: bool = True) -> int:
        """A slot for ``spec``; when all hold loaded models, the least recently used idle one is
        unloaded (``SlotTable.evict_idle``, a message to its supervisor) and the claim retried when a
        slot's supervisor answers, up to ``load_timeout``."""
        deadline = time.monotonic() + self.load_timeout
        while True:
            try:
                return self.slots.claim(spec)
            except SlotsFull:
                if time.monotonic() > deadline:
                    raise
                if not self.slots.leaving():
                    victim = self.slots.evict_idle(kept=evict_kept)
                    if victim is None and not evict_kept:
                        wait = self.slots.kept_until() - time.time()
                        raise SlotsKept(f"every on-demand slot holds a model another request used within its keep_alive; "
                                        f"'{spec.served_name}' can load once one ends (an admin key may unload one)",
                                        retry_after=max(1, int(wait + 0.999)) if wait < 86400 else 60) from None
                    if victim is None:
                        raise
                    log.info("on_demand_unload", model=victim, for_model=spec.served_name)
                else:
                    self.slots.hurry_leaving()
            # until a slot's supervisor answers (its new state, or a release declined: SlotTable.changed)
            await self.slots.changed(self.worker, deadline - time.monotonic())

    def _served(self, i: int) -> ServedModel | None:
        """Slot ``i``'s model (parsed once per model the slot takes: the request path reads it)."""
        generation = self.slots.generation(i)
        cached = self._served_cache.get(i)
        if cached is None or cached[0] != generation:
            spec = self.slots.spec(i)
            model = None if spec is None else _served_model(spec)
            cached = self._served_cache[i] = (generation, model)
        return cached[1]


def _served_model(spec: ModelConfig) -> ServedModel:
    return ServedModel(name=spec.served_name, root=spec.model, max_model_len=spec.context_length, created=int(time.time()),
                       vllm_args=tuple(spec.args()))
