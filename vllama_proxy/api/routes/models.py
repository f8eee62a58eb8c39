"""``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``: the served models in Ollama's shapes.

Built from vLLM's ``/v1/models`` and the model's own files (``models/model_files.py``);
shapes from ``docs/wire.md`` "Responses" — ``details`` and ``model_info``
always present, ``capabilities`` always a list (Copilot and Continue break otherwise). Ollama 0.33's:
``capabilities`` in every ``/api/tags`` entry too, ``details.context_length`` and ``details.embedding_length``
everywhere ``details`` is (Ollama's ``launch`` picks models by them: ``cmd/launch/model_inventory.go``),
and a created model's ``requires``, ``renderer`` and ``parser`` in ``/api/show``.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from vllama_proxy.errors import UpstreamError, VllamaError
from vllama_proxy.models.vllm_servers import Backend, ServedModel
from vllama_proxy.models.catalog import ollama_name, reported_context
from vllama_proxy.models.created import CreatedModel, parameter_lines, render_modelfile
from vllama_proxy.models.model_files import ModelFiles, format_parameter_size
from vllama_proxy.supervisor import gpu
from .body import read_request
from .model_use import choose, may_list, may_list_created
from ..policy.keys import key_of
from ..request.call import Call
from ..ollama.types import ModelRef
from ..app_state import CATALOG
from ..ollama.timestamps import rfc3339

#: ``expires_at`` of a model that never unloads: Ollama's "forever" is ~292 years ahead.
_FOREVER_S = 292 * 365 * 24 * 3600


def details(files: ModelFiles, model: ServedModel | None = None) -> dict[str, Any]:
    """Ollama's ``details`` object; ``context_length`` (what vLLM accepts: ``max_model_len``, else the
    config's ``max_position_embeddings``) and ``embedding_length`` (``hidden_size``) left out where unknown,
    as Ollama's ``omitempty`` does."""
    family = files.architecture
    out: dict[str, Any] = {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": format_parameter_size(files.parameter_count),
        "quantization_level": files.quantization_level,
    }
    cfg = files.config.get("text_config") or files.config
    context = (model.max_model_len if model is not None else None) or cfg.get("max_position_embeddings")
    if isinstance(context, int) and context > 0:
        out["context_length"] = context
    if isinstance(cfg.get("hidden_size"), int):
        out["embedding_length"] = cfg["hidden_size"]
    return out


def _modified_at(model: ServedModel, files: ModelFiles) -> str:
    return rfc3339(files.modified_at or model.created)


def model_info(model: ServedModel, files: ModelFiles) -> dict[str, Any]:
    """Ollama's ``model_info``: ``general.*`` and ``<arch>.*`` keys from ``config.json``.

    ``<arch>.context_length`` is vLLM's ``max_model_len`` (what the server accepts),
    not the model's trained maximum; Copilot reads it to size prompts.
    """
    cfg = files.config.get("text_config") or files.config
    arch = files.architecture
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": model.name.rsplit("/", 1)[-1]}
    if files.parameter_count:
        info["general.parameter_count"] = files.parameter_count
    ctx = model.max_model_len or cfg.get("max_position_embeddings")
    if ctx:
        info[f"{arch}.context_length"] = ctx
    for key, cfg_key in (
        ("embedding_length", "hidden_size"),
        ("block_count", "num_hidden_layers"),
        ("feed_forward_length", "intermediate_size"),
        ("attention.head_count", "num_attention_heads"),
        ("attention.head_count_kv", "num_key_value_heads"),
        ("rope.freq_base", "rope_theta"),
        ("vocab_size", "vocab_size"),
    ):
        if cfg.get(cfg_key) is not None:
            info[f"{arch}.{key}"] = cfg[cfg_key]
    return info


def parameters_text(model: ServedModel, files: ModelFiles) -> str:
    """Ollama's ``parameters`` text, one ``key value`` per line (Continue parses ``num_ctx`` and ``stop``).

    Sampling defaults come from ``generation_config.json``, which vLLM applies to
    requests that leave them unset.
    """
    lines = []
    if model.max_model_len:
        lines.append(f"num_ctx {model.max_model_len}")
    if files.eos_token:
        lines.append(f"stop {orjson.dumps(files.eos_token).decode()}")
    gen = files.generation_config
    for ollama_key, hf_key in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("repeat_penalty", "repetition_penalty")):
        if gen.get(hf_key) is not None:
            lines.append(f"{ollama_key} {gen[hf_key]}")
    return "\n".join(lines)


def _modelfile(name: str, model: ServedModel, files: ModelFiles, params: str) -> str:
    """A served model's Modelfile, which ``create`` takes back unchanged: ``FROM`` the
    name it was shown by (a model made from it is served by the same vLLM; Ollama prints a blob path
    there and the name in a comment), the weights' place in the comment, ``TEMPLATE`` its own chat
    template (``create`` accepts that one), its ``PARAMETER``s."""
    lines = [f"# Modelfile generated by vllama (served by vLLM from {model.root})", f"FROM {name}"]
    if files.chat_template:
        lines.append(f'TEMPLATE """{files.chat_template}"""')
    lines += [f"PARAMETER {p}" for p in params.splitlines()]
    return "\n".join(lines) + "\n"


async def tags(request: web.Request) -> web.Response:
    """``{"models": [{name, model, modified_at, size, digest, details}]}``; aliases are listed as their own entries."""
    catalog = request.app[CATALOG]
    out = []
    served_caps: dict[str, tuple[ServedModel, list[str]]] = {}
    for model in await catalog.models():
        if model.root.startswith("/") and not Path(model.root).exists():
            continue  # an on-demand slot still holds a model whose uploaded files were deleted (/api/delete)
        caps = await catalog.capabilities(model)
        served_caps[model.name] = (model, caps)  # a created model of a base this key may not list has them too
        if not may_list(request, model, catalog.names_for(model)):
            continue
        files = await catalog.files(model)
        entry = {"modified_at": _modified_at(model, files), "size": files.size, "digest": files.digest,
                 "details": details(files, model), "capabilities": caps}
        out += [{"name": n, "model": n, **entry} for n in catalog.names_for(model)]
    if catalog.on_demand is not None:  # pulled models, which start when a request names them (Ollama lists them all)
        listed = {e["name"].casefold() for e in out}
        roots = {m.root.casefold() for m in await catalog.models()}
        for lm in await catalog.on_demand.local():
            name = ollama_name(lm.name)
            if name.casefold() in listed or lm.repo.casefold() in roots or not key_of(request).may_use(name, lm.repo):
                continue
            try:  # as it would be served (its parsers told by its files), without loading it
                as_served = await catalog.on_demand.lookup(name) or _unserved(lm)
            except VllamaError:
                as_served = _unserved(lm)
            files = await catalog.files(as_served)
            caps = await catalog.capabilities(as_served)
            served_caps[as_served.name] = (as_served, caps)
            out.append({"name": name, "model": name, "modified_at": rfc3339(lm.modified), "size": files.size or lm.size,
                        "digest": files.digest, "details": details(files, as_served), "capabilities": caps})
    listed = {e["name"].casefold() for e in out}
    for made in catalog.created_models():  # made with /api/create: the base's weights, their own digest
        if not may_list_created(request, made):
            continue
        name = ollama_name(made.name)
        if name.casefold() in listed and _folded(made.name) == _folded(made.base):
            continue  # made from uploaded files: it is its own base, listed already (once, as Ollama lists it)
        base, caps = served_caps.get(made.base, (None, ["completion"]))
        files = await catalog.files(base) if base is not None else ModelFiles()
        out.append({"name": name, "model": name, "modified_at": rfc3339(made.created_at), "size": files.size,
                    "digest": made.digest, "details": created_details(made, files, base), "capabilities": caps})
    return web.Response(body=orjson.dumps({"models": out}), content_type="application/json")


async def show(request: web.Request) -> web.Response:
    """Ollama's show for ``{"model": X}`` (or legacy ``{"name": X}``)."""
    req = await read_request(request, ModelRef)
    use = await choose(request, Call(key=key_of(request)), req.ref, load=False)  # never loads it (not admitted: no call.key)
    name, model = use.name, use.model
    catalog = request.app[CATALOG]
    files = await catalog.files(model)
    params = parameters_text(model, files)
    made = catalog.created(name)
    body = {
        "license": "",
        "modelfile": _modelfile(name, model, files, params),
        "parameters": params,
        "template": files.chat_template or "",
        "details": details(files, model),
        "model_info": model_info(model, files),
        "capabilities": await catalog.capabilities(model),
        "modified_at": _modified_at(model, files),
    }
    if made is not None:  # Ollama's show of a created model: its own layers, its parent
        own = parameter_lines(made.parameters)
        keys = set(made.parameters)
        body.update(
            modelfile=render_modelfile(made),
            parameters="\n".join(own + [p for p in params.splitlines() if p.split(" ", 1)[0] not in keys]),
            system=made.system or "",
            license="\n".join(made.license),
            messages=made.messages,
            details=created_details(made, files, model),
            modified_at=rfc3339(made.created_at),
        )
        body.update({k: v for k in ("requires", "renderer", "parser") if (v := getattr(made, k))})
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def created_details(made: CreatedModel, files: ModelFiles, base: ServedModel | None = None) -> dict[str, Any]:
    """``details`` of a model made with ``/api/create``: its base's, with ``parent_model`` the ``from`` it was made of."""
    return {**details(files, base), "parent_model": made.parent}


def _unserved(lm: Any) -> ServedModel:
    """A pulled model no slot holds, as its files say (``/api/tags``' fallback)."""
    return ServedModel(name=lm.name, root=str(lm.path), max_model_len=None, created=int(lm.modified))


def _folded(name: str) -> str:
    return ollama_name(name).casefold()


async def ps(request: web.Request) -> web.Response:
    """The loaded models, with ``expires_at`` when their keep_alive ends ("forever" ~292 years
    ahead when it is negative, or when vllama only proxies a vLLM it does not manage).
    A sleeping or unloaded model is not listed, as Ollama lists only loaded ones.

    ``size_vram`` is the GPU memory of the model's vLLM process tree measured with NVML
    when vllama supervises it (weights + KV cache); otherwise, or when NVML cannot see
    the processes, it equals ``size`` (the weights, which are on the GPU), unless vllama
    runs it on a host with no NVIDIA GPU: then 0 (on the CPU). ``context_length`` is the
    one vLLM reports when the model's configuration did not say it (an on-demand model).
    """
    catalog = request.app[CATALOG]
    out = []
    no_gpu: bool | None = None
    for model in await catalog.models():
        backend = catalog.backend_of(model)
        board = backend.board
        if board is not None and not board.ready:
            continue  # asleep, unloaded or loading: not loaded
        files = await catalog.files(model)
        vram = await board.vram_bytes() if board is not None else 0
        if board is not None and not vram and no_gpu is None:
            # vllama runs it and NVML measured nothing: on a host without a GPU it is on the CPU
            # ("100% CPU" in ps, not "100% GPU")
            no_gpu = await asyncio.to_thread(gpu.count) == 0
        context = model.max_model_len or await _reported_context(backend, model.name)
        until = board.expires_at if board is not None else math.inf
        name = catalog.names_for(model)[0]
        entry = {
            "name": name,
            "model": name,
            "size": files.size,
            "digest": files.digest,
            "details": details(files, model),
            "expires_at": rfc3339(time.time() + _FOREVER_S if math.isinf(until) else until),
            "size_vram": vram or (0 if board is not None and no_gpu else files.size),
            "context_length": context,
        }
        if may_list(request, model, catalog.names_for(model)):
            out.append(entry)
        for made in catalog.created_models():  # loaded with their base: the same vLLM serves them
            if made.base == model.name and may_list_created(request, made):
                own = ollama_name(made.name)
                if _folded(made.name) == _folded(made.base) and may_list(request, model, catalog.names_for(model)):
                    continue  # its own base, listed already
                out.append({**entry, "name": own, "model": own, "digest": made.digest, "details": created_details(made, files, model)})
    return web.Response(body=orjson.dumps({"models": out}), content_type="application/json")


async def _reported_context(backend: Backend, name: str) -> int:
    """The ``max_model_len`` the model's vLLM reports in ``/v1/models`` (0 when it says none or
    cannot be asked): ``ps``'s CONTEXT for a model whose configuration did not give one."""
    try:
        data = await backend.upstream.get_json("/v1/models")
    except UpstreamError:
        return 0
    return reported_context(data, name) or 0
