"""``POST /api/create``: a new model name on a served model, with its own system prompt, options and messages.

Ollama's JSON (``model``, ``from``, ``system``, ``template``, ``parameters``, ``messages``,
``license``, ``adapters``, ``files``, ``stream``; the legacy ``modelfile`` text is read as the
fields it sets). The model is kept by ``models/created.py`` and served by its base model's vLLM:
nothing is loaded, no GPU memory is added. Progress lines are Ollama's (``creating new layer
sha256:...``, ``writing manifest``, ``success``), one JSON object with ``stream: false``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from vllama_proxy.errors import BadRequest, ModelNotFound, VllamaError
from vllama_proxy.models.catalog import strip_latest
from vllama_proxy.models.blobs import parse_digest
from vllama_proxy.models.created import CreatedModel, parse_modelfile
from vllama_proxy.models.local import NAME_FILE, uploaded_dir
from .common import read_request
from .manage import _NAME
from ..ollama_types import CreateRequest, Message, Options, validation_message
from ..state import BLOBS, CATALOG, SETTINGS

#: Option names a ``PARAMETER`` may set: Ollama's (``api.Options``) and vLLM's extras vllama accepts.
_PARAMETERS = frozenset(Options.model_fields)


def check_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` checked as Ollama ``options``; ``stop`` always a list.

    Raises:
        BadRequest: an unknown name (Ollama: ``unknown parameter``) or a wrong type.
    """
    unknown = sorted(set(parameters) - _PARAMETERS)
    if unknown:
        raise BadRequest(f"unknown parameter '{unknown[0]}'")
    try:
        opts = Options.model_validate(parameters)
    except ValidationError as e:
        raise BadRequest(validation_message(e).replace("invalid ", "invalid parameter ", 1)) from None
    out = opts.model_dump(exclude_none=True)
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


async def create(request: web.Request) -> web.StreamResponse:
    """Ollama's create (``shared/ollama-api.md`` "Create a Model"; ``server/create.go``).

    Errors (before any progress line): 400 ``model is required``, an invalid name, a name that is a
    served model or a configured alias, ``from`` missing, a ``template`` (Ollama's Go templates are
    not vLLM's Jinja: vllama always applies the base model's own chat template), ``quantize``,
    unknown ``parameters``; 404 ``from`` unknown.
    """
    req = await read_request(request, CreateRequest)
    fields: dict[str, Any] = parse_modelfile(req.modelfile) if req.modelfile else {}
    name = (req.model or req.name or "").strip()
    if not name:
        raise BadRequest("model is required")
    if len(name) > 256 or not _NAME.fullmatch(name):
        raise BadRequest(f'model name "{name}" is invalid')
    template = req.template if req.template is not None else fields.get("template")
    if template:
        raise BadRequest("TEMPLATE is not supported: vllama serves a model with its own chat template (Jinja, applied by vLLM), "
                         "not Ollama's Go templates; leave TEMPLATE out (the base model's template is used)")
    if req.quantize:
        raise BadRequest("quantize is not supported: vLLM serves published quantizations; "
                         "name one instead (a library tag such as qwen2.5:7b-q4_K_M, or an AWQ/GPTQ/FP8 repo)")
    if req.adapters or fields.get("adapters"):
        raise BadRequest("adapters are not supported yet: create a model FROM a served one")
    source = (req.from_ or fields.get("from") or "").strip()
    if not source and not req.files:
        raise BadRequest("neither 'from' or 'files' was specified")
    catalog = request.app[CATALOG]
    if catalog.created(name) is None and catalog.is_served_name(name):
        raise BadRequest(f"'{name}' is a served model or an alias; choose another name")
    parent = catalog.created(source) if source else None
    lines: list[dict[str, str]] = []
    if req.files:  # weights uploaded with /api/blobs: a model directory, run on demand under this name
        if source:
            raise BadRequest("give either 'from' or 'files', not both")
        layers = await build_model_dir(request, strip_latest(name), req.files)
        base_name, source = strip_latest(name), ""
        lines += [{"status": f"copying file sha256:{d}"} for d in layers]
    else:
        try:
            base = await catalog.resolve(source)
        except ModelNotFound as e:
            raise ModelNotFound(source, e.message.partition(": ")[2] or None) from None
        base_name = base.name
        lines.append({"status": "using existing layer sha256:" + (await catalog.files(base)).digest})
    system = req.system if req.system is not None else fields.get("system", parent.system if parent else None)
    params = dict(parent.parameters) if parent else {}
    params.update(check_parameters({**fields.get("parameters", {}), **(req.parameters or {})}))
    raw_msgs = [m.model_dump(exclude_none=True) for m in req.messages] if req.messages is not None else fields.get("messages")
    messages = [{"role": m["role"], "content": m.get("content") or ""} for m in raw_msgs] if raw_msgs is not None else (
        list(parent.messages) if parent else [])
    for i, m in enumerate(messages):
        if m["role"] not in ("system", "user", "assistant"):
            raise BadRequest(f'invalid messages[{i}].role: must be "system", "user" or "assistant", not "{m["role"]}"')
        Message.model_validate(m)
    lic = req.license if req.license is not None else fields.get("license", parent.license if parent else [])
    made = CreatedModel(
        name=strip_latest(name), base=base_name, parent=parent.parent if parent and _same(source, name) else source,
        system=system, parameters=params, messages=messages, license=[lic] if isinstance(lic, str) else list(lic),
    )
    try:
        await asyncio.to_thread(catalog.created_store.put, made)
    except OSError as e:
        raise VllamaError(f"cannot save the model in {catalog.created_store.path}: {e.strerror or e} (see --state-dir)",
                          status=500) from None
    lines += [{"status": f"creating new layer sha256:{digest}"} for _, digest in made.layers()]
    lines += [{"status": "writing manifest"}, {"status": "success"}]
    if req.stream is False:
        return web.Response(body=orjson.dumps(lines[-1]), content_type="application/json")
    body = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    return web.Response(body=body, content_type="application/x-ndjson")


#: A file name of an uploaded model: flat, no path parts.
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


async def build_model_dir(request: web.Request, name: str, files: dict[str, str]) -> list[str]:
    """``<state_dir>/models/<dir>`` holding ``files`` (file name -> blob digest), linked from the
    blobs; ``local.scan_uploaded`` lists it under ``name`` and it runs on demand. Returns the digests.

    Raises:
        BadRequest: a file name with a path part, a blob not uploaded, GGUF weights (vLLM serves
            safetensors: upload the model's Hugging Face directory), no ``config.json`` or no
            ``.safetensors``, or no on-demand models here (``--upstream``, or ``--no-on-demand``).
    """
    blobs = request.app[BLOBS]
    for fname, digest in files.items():
        if not _FILE.fullmatch(fname) or fname.startswith("."):
            raise BadRequest(f"invalid file name {fname!r}: files are named without a directory")
        if fname.lower().endswith(".gguf"):
            raise BadRequest(f"{fname}: GGUF is not served by vllama (vLLM loads safetensors); upload the model's "
                             "Hugging Face directory (config.json, tokenizer files, *.safetensors) instead")
        if not blobs.exists(digest):
            raise BadRequest(f"blob {digest} not found: upload {fname} first (POST /api/blobs/{digest})")
    if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        raise BadRequest("files must hold a safetensors model directory: config.json and *.safetensors (and the tokenizer's files)")
    if request.app[CATALOG].on_demand is None:
        raise BadRequest("a model made from files runs on demand, which needs vllama to run vLLM itself "
                         "(not --upstream) with on-demand models on")
    root = request.app[SETTINGS].state_dir / "models"
    target = uploaded_dir(root, name)
    await asyncio.to_thread(_link_dir, target, {f: blobs.path(d) for f, d in files.items()}, name)
    return [parse_digest(d) for d in files.values()]


def _link_dir(target: Path, files: dict[str, Path], name: str) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for fname, blob in files.items():
        try:
            os.link(blob, tmp / fname)  # same disk: no copy
        except OSError:
            shutil.copyfile(blob, tmp / fname)
    (tmp / NAME_FILE).write_text(name + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _same(a: str, b: str) -> bool:
    return strip_latest(a.strip()).casefold() == strip_latest(b.strip()).casefold()
