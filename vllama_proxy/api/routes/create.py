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

from vllama_proxy.errors import BadRequest, ModelNotFound, UpstreamError, StorageFailed, UpstreamRejected
from vllama_proxy.models.adapters import AdapterMode, adapter_mode, check_adapter, lora_plan
from vllama_proxy.models.launch_spec import has_flag
from vllama_proxy.models.model_files import ModelFiles, read_model_files
from vllama_proxy.models.modelfile_v033 import check_draft, check_parser, check_renderer, check_requires, draft_tokens
from vllama_proxy.models.vllm_servers import ServedModel
from vllama_proxy.models.catalog import strip_latest
from vllama_proxy.models.blobs import parse_digest
from vllama_proxy.supervisor import probes
from vllama_proxy.supervisor.states import State
from vllama_proxy.upstream import read_response
from vllama_proxy.models.created import CreatedModel, parse_modelfile
from vllama_proxy.models.family import detect_parsers
from vllama_proxy.models.local import NAME_FILE, uploaded_dir
from .body import read_request
from .model_use import model_in_use
from .manage import _NAME
from ..ollama.types import OPTIONS, CreateRequest, Message, Options, validation_message
from ..app_state import BLOBS, CATALOG, SETTINGS, WORKER

#: Option names a ``PARAMETER`` may set: Ollama's (``api.Options``) and vLLM's extras vllama accepts.
_PARAMETERS = frozenset(Options.__annotations__)


def check_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` checked as Ollama ``options``; ``stop`` always a list.

    Raises:
        BadRequest: an unknown name (Ollama: ``unknown parameter``) or a wrong type.
    """
    unknown = sorted(set(parameters) - _PARAMETERS)
    if unknown:
        raise BadRequest(f"unknown parameter '{unknown[0]}'")
    try:
        opts = OPTIONS.validate_python(parameters)
    except ValidationError as e:
        raise BadRequest(validation_message(e).replace("invalid ", "invalid parameter ", 1)) from None
    out = {k: v for k, v in opts.items() if v is not None}
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


async def create(request: web.Request) -> web.StreamResponse:
    """Ollama's create (``docs/wire.md`` "Routes"; ``server/create.go``).

    Errors (before any progress line): 400 ``model is required``, an invalid name, a name that is a
    served model or a configured alias, ``from`` missing, a ``template`` other than the base
    model's own chat template (Ollama's Go templates are not vLLM's Jinja: vllama always applies
    the base's own; its own, as ``show --modelfile`` prints it, is accepted so that a shown
    Modelfile is created unchanged), ``quantize``, unknown ``parameters``, and Ollama 0.33's
    commands where they have no meaning here (``models/modelfile_v033.py``: a ``REQUIRES`` above the level
    vllama speaks, a ``RENDERER`` or ``PARSER`` that is not the base's, a ``DRAFT`` vllama cannot start the
    base with: :func:`_v033_fields`); 404 ``from`` unknown. A ``DRAFT`` restarts the base (:func:`serve_draft`).
    """
    req = await read_request(request, CreateRequest)
    fields: dict[str, Any] = parse_modelfile(req.modelfile) if req.modelfile else {}
    name = (req.model or req.name or "").strip()
    if not name:
        raise BadRequest("model is required")
    if len(name) > 256 or not _NAME.fullmatch(name):
        raise BadRequest(f'model name "{name}" is invalid')
    template = req.template if req.template is not None else fields.get("template")
    if getattr(req, "draft_quantize", None):
        raise BadRequest("draft_quantize is not supported: vLLM loads the draft model as published; name a quantized draft instead")
    if req.quantize:
        raise BadRequest("quantize is not supported: vLLM serves published quantizations; "
                         "name one instead (a library tag such as qwen2.5:7b-q4_K_M, or an AWQ/GPTQ/FP8 repo)")
    source = (req.from_ or fields.get("from") or "").strip()
    if not source and not req.files:
        raise BadRequest("neither 'from' or 'files' was specified")
    catalog = request.app[CATALOG]
    if catalog.created(name) is None and catalog.is_served_name(name):
        raise BadRequest(f"'{name}' is a served model or an alias; choose another name")
    parent = catalog.created(source) if source else None
    lines: list[dict[str, str]] = []
    base: ServedModel | None = None
    if req.files:  # weights uploaded with /api/blobs: a model directory, run on demand under this name
        if source:
            raise BadRequest("give either 'from' or 'files', not both")
        if template:
            raise _template_refused()
        layers = await build_model_dir(request, strip_latest(name), req.files)
        base_name, source = strip_latest(name), ""
        own_dir = uploaded_dir(request.app[SETTINGS].state_dir / "models", strip_latest(name))
        base_files = await asyncio.to_thread(read_model_files, str(own_dir), base_name)
        lines += [{"status": f"copying file sha256:{d}"} for d in layers]
    else:
        try:
            base = await catalog.resolve(source)
        except ModelNotFound as e:
            raise ModelNotFound(source, e.message.partition(": ")[2] or None) from None
        base_name = base.name
        base_files = await catalog.files(base)
        if template and not same_template(template, base_files.chat_template):
            raise _template_refused()
        lines.append({"status": "using existing layer sha256:" + base_files.digest})
    v033 = await _v033_fields(request, req, fields, parent, name, base, base_name, base_files)
    adapters = dict(parent.adapters) if parent else {}
    sources: list[str] = list(fields.get("adapters", []))
    if req.adapters or sources:
        if req.files:
            raise BadRequest("adapters need a base model: give 'from', not 'files'")
        if len(sources) + bool(req.adapters) > 1:
            raise BadRequest("one adapter per model: vLLM applies one LoRA adapter to a request")
        path = await adapter_dir(request, strip_latest(name), req.adapters or {}, sources)
        base_files = await catalog.files(base)
        await asyncio.to_thread(check_adapter, path, base_files.config, base.root)
        adapters = {strip_latest(name): str(path)}
        lines.append({"status": f"using adapter {path.name}"})
    system = req.system if req.system is not None else fields.get("system", parent.system if parent else None)
    params = dict(parent.parameters) if parent else {}
    given = {**fields.get("parameters", {}), **(req.parameters or {})}
    given.pop("draft_num_predict", None)  # a launch option of the draft (_v033_fields), not a request's
    params.update(check_parameters(given))
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
        adapters=adapters, **v033,
    )
    others = [m for m in catalog.created_models() if m.name.casefold() != made.name.casefold()]
    plan_before = await asyncio.to_thread(lora_plan, others, made.base)
    if made.draft and plan_before.speculative and lora_plan([made], made.base).speculative != plan_before.speculative:
        holder = next(m.name for m in others if m.base == made.base and m.draft)
        raise BadRequest(f"the base model {made.base} already runs with another draft ({holder}'s): vLLM runs one draft "
                         "per model; give the same DRAFT and draft_num_predict, or delete that model first")
    try:
        await asyncio.to_thread(catalog.created_store.put, made)
    except OSError as e:
        raise StorageFailed(f"cannot save the model in {catalog.created_store.path}: {e.strerror or e} (see --state-dir)") from None
    if made.adapters and not (parent is not None and parent.adapters == made.adapters):
        lines += await serve_adapter(request, made)
    if made.draft and lora_plan([*others, made], made.base).speculative != plan_before.speculative:
        lines += await serve_draft(request, made)
    lines += [{"status": f"creating new layer sha256:{digest}"} for _, digest in made.layers()]
    lines += [{"status": "writing manifest"}, {"status": "success"}]
    if req.stream is False:
        return web.Response(body=orjson.dumps(lines[-1]), content_type="application/json")
    body = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    return web.Response(body=body, content_type="application/x-ndjson")


async def _v033_fields(request: web.Request, req: CreateRequest, fields: dict[str, Any], parent: CreatedModel | None,
                       name: str, base: ServedModel | None, base_name: str, base_files: ModelFiles) -> dict[str, Any]:
    """Ollama 0.33's fields of a create (``models/modelfile_v033.py``), each the request's, else its
    Modelfile's, else the parent's: ``draft``, ``draft_num_predict``, ``requires``, ``renderer``, ``parser``.

    Raises:
        BadRequest: a ``RENDERER`` or ``PARSER`` with no meaning for the base; a ``DRAFT`` that is no
            directory, repo id or ``ngram``, on a base vllama does not launch (``--upstream``) or that
            already has a ``--speculative-config`` of its own; a bad ``draft_num_predict``.
    """
    def pick(key: str) -> Any:
        given = getattr(req, key)
        return given if given is not None else fields.get(key, getattr(parent, key) if parent else None)

    out: dict[str, Any] = {"requires": pick("requires")}
    if out["requires"]:
        out["requires"] = check_requires(out["requires"])
    base_args = base.vllm_args if base is not None else ()
    if pick("parser"):
        parsers = ([] if base is not None else
                   [a for flag, p in (("--tool-call-parser", detect_parsers(base_files).tool_call_parser),
                                      ("--reasoning-parser", detect_parsers(base_files).reasoning_parser)) if p for a in (flag, p)])
        out["parser"] = check_parser(pick("parser"), tuple(base_args) or tuple(parsers))
    if pick("renderer"):
        out["renderer"] = check_renderer(pick("renderer"), base_files)
    draft = pick("draft")
    if req.draft_files:
        draft = str(await draft_dir(request, strip_latest(name), req.draft_files))
    tokens = {**fields.get("parameters", {}), **(req.parameters or {})}.get("draft_num_predict")
    out["draft_num_predict"] = draft_tokens(tokens) if tokens is not None else (parent.draft_num_predict if parent else None)
    if draft:
        out["draft"] = await asyncio.to_thread(check_draft, draft)
        if has_flag(base_args, "--speculative-config"):
            raise BadRequest(f"the base model {base_name} already runs with a --speculative-config of its own; leave DRAFT out")
        if base is not None and catalog_backend_unsupervised(request, base):
            raise BadRequest("DRAFT needs vllama to launch the base model's vLLM (it runs with --upstream here): "
                             "give that vLLM --speculative-config instead")
    elif out["draft_num_predict"] is not None:
        raise BadRequest("draft_num_predict needs a DRAFT model")
    return out


def catalog_backend_unsupervised(request: web.Request, base: ServedModel) -> bool:
    """Whether ``base``'s vLLM is one vllama does not launch (``--upstream``), so it cannot restart it."""
    try:
        return request.app[CATALOG].backend_of(base).board is None
    except ModelNotFound:  # an on-demand model no slot holds: vllama launches it
        return False


async def draft_dir(request: web.Request, name: str, files: dict[str, str]) -> Path:
    """``<state_dir>/drafts/<dir>`` holding a draft model's uploaded files (Ollama's ``draft_files``).

    Raises:
        BadRequest: a file name with a path part, a blob not uploaded, no ``config.json``.
    """
    blobs = request.app[BLOBS]
    for fname, digest in files.items():
        if not _FILE.fullmatch(fname) or fname.startswith("."):
            raise BadRequest(f"invalid file name {fname!r}: files are named without a directory")
        if not blobs.exists(digest):
            raise BadRequest(f"blob {digest} not found: upload {fname} first (POST /api/blobs/{digest})")
    if "config.json" not in files:
        raise BadRequest("draft_files must hold a Hugging Face model directory: config.json and *.safetensors")
    target = uploaded_dir(request.app[SETTINGS].state_dir / "drafts", name)
    await asyncio.to_thread(_link_dir, target, {f: blobs.path(d) for f, d in files.items()}, name)
    return target


async def serve_draft(request: web.Request, made: CreatedModel) -> list[dict[str, str]]:
    """Restart the base's vLLM with ``made``'s draft (``--speculative-config``, which vLLM takes only at
    launch): the supervisor is told as for an adapter declared at launch (``StatusBoard.adapters_changed``)
    and restarts it, draining its requests in flight (``--adapters launch``) or once idle (``runtime``);
    this waits for the restart and the start after it. Progress lines for create's stream.

    Raises:
        BadRequest: vLLM did not start with the draft (its words); the model is not kept, and the base
            is told again, so that it starts without it.
    """
    catalog = request.app[CATALOG]
    base = await catalog.resolve(made.base)  # a lookup: creating a model starts no on-demand base
    try:
        backend = catalog.backend_of(base)
    except ModelNotFound:
        return [{"status": "the draft loads with the base model"}]
    board = backend.board
    if board is None or board.state is State.UNLOADED:
        return [{"status": "the draft loads with the base model"}]
    async with model_in_use(request, backend, None):
        pass
    board.adapters_changed()  # rings the owner loop: its plan's --speculative-config changed, it restarts
    await board.wait_left_ready(3 * request.app[SETTINGS].health_interval + 30, request.app[WORKER])
    if board.ready:  # the base stayed busy: its restart is tried again at each check
        return [{"status": "speculative decoding starts once the base model restarts (when its requests end)"}]
    try:
        async with model_in_use(request, backend, None):  # waits for the start with the draft
            pass
    except UpstreamError as e:
        await asyncio.to_thread(catalog.created_store.remove, made.name)
        board.adapters_changed()
        raise BadRequest(f"vLLM did not start with the draft: {e.message}") from None
    return [{"status": "restarted the base model with speculative decoding (--speculative-config)"}]


def same_template(template: str, own: str | None) -> bool:
    """Whether a create's ``template`` is the model's own chat template (what ``show`` prints in its
    Modelfile), line endings and the whitespace around it aside."""
    def norm(text: str) -> str:
        return "\n".join(text.strip().splitlines())

    return own is not None and norm(template) == norm(own)


def _template_refused() -> BadRequest:
    return BadRequest("TEMPLATE is not supported unless it is the model's own chat template: vllama serves a model with "
                      "its own template (Jinja, applied by vLLM), not Ollama's Go templates; leave TEMPLATE out, or as "
                      "`vllama show MODEL --modelfile` prints it")


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


async def adapter_dir(request: web.Request, name: str, blobs_of: dict[str, str], sources: list[str]) -> Path:
    """The PEFT directory of the adapter: built from uploaded blobs (``adapters``: file name -> digest,
    in ``<state_dir>/adapters``), a local directory, or a Hugging Face repo id (downloaded into the cache).

    Raises:
        BadRequest: a blob not uploaded, a path part in a file name, a directory that is not there,
            a repo that cannot be fetched.
    """
    if blobs_of:
        blobs = request.app[BLOBS]
        for fname, digest in blobs_of.items():
            if not _FILE.fullmatch(fname) or fname.startswith("."):
                raise BadRequest(f"invalid file name {fname!r}: files are named without a directory")
            if not blobs.exists(digest):
                raise BadRequest(f"blob {digest} not found: upload {fname} first (POST /api/blobs/{digest})")
        target = uploaded_dir(request.app[SETTINGS].state_dir / "adapters", name)
        await asyncio.to_thread(_link_dir, target, {f: blobs.path(d) for f, d in blobs_of.items()}, name)
        return target
    source = sources[0].strip()
    local = Path(source).expanduser()
    if local.is_absolute() or source.startswith("."):
        if not local.is_dir():
            raise BadRequest(f"adapter {source}: no such directory on the server")
        return local
    if source.count("/") != 1:
        raise BadRequest(f"adapter {source!r}: name a PEFT directory on the server or a Hugging Face repo id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(await asyncio.to_thread(snapshot_download, source))
    except Exception as e:  # noqa: BLE001 - not found, offline, gated: the client is told which
        raise BadRequest(f"adapter {source}: cannot fetch it from Hugging Face: {e}") from None


async def serve_adapter(request: web.Request, made: CreatedModel) -> list[dict[str, str]]:
    """Make the base's vLLM serve ``made``'s adapter, as its adapter mode says (``models/adapters.py``,
    ``--adapters``): in ``runtime`` mode loaded into the running vLLM when its LoRA limits allow it; in
    ``launch`` mode the supervisor, told at once (``StatusBoard.adapters_changed``: an ``ADAPTERS``
    message), restarts vLLM with the adapter in ``--lora-modules``, draining the
    requests in flight (``lifecycle.Supervisor._drain``), and when a limit must grow in ``runtime`` mode
    once it is idle; this waits for that restart (requests for the base meanwhile wait for the start, as
    for any start: a second vLLM of the model would not fit beside the first) and asks vLLM whether it
    lists the adapter. Progress lines for create's stream; the last says whether vLLM serves it now.

    Raises:
        BadRequest: vLLM refused the adapter (its message); the model is not kept.
    """
    catalog = request.app[CATALOG]
    base = await catalog.resolve(made.base)  # a lookup: creating a model starts no on-demand base
    try:
        backend = catalog.backend_of(base)
    except ModelNotFound:  # an on-demand base no slot holds: it starts with the adapter when a request names it
        return [{"status": "the adapter loads with the base model"}]
    board = backend.board
    lora_name, path = next(iter(made.adapters.items()))
    mode = adapter_mode(request.app[SETTINGS].adapters, base.vllm_args)
    others = [m for m in catalog.created_models() if m.name.casefold() != made.name.casefold()]
    before = await asyncio.to_thread(lora_plan, others, made.base)
    after = await asyncio.to_thread(lora_plan, [*others, made], made.base)
    if board is not None and board.state is State.UNLOADED:
        return [{"status": "the adapter loads with the base model"}]  # its next start has it (--lora-modules)
    if board is None or (mode.mode == "runtime" and before.covers(after)):
        async with model_in_use(request, backend, None):  # awake (or started) while it loads
            try:
                body = orjson.dumps({"lora_name": lora_name, "lora_path": path})
                async with backend.upstream.request("POST", "/v1/load_lora_adapter", body=body) as resp:
                    await read_response(resp)  # vLLM answers in plain text
                loaded = True
            except UpstreamRejected as e:
                if "already been loaded" in e.message:
                    loaded = True
                elif board is not None and e.status == 404:
                    # no such route: the supervisor launched this vLLM without runtime loading (an on-demand
                    # model's API servers are chosen when a slot takes it): its restart declares the adapter
                    loaded, mode = False, AdapterMode("launch", "its vLLM runs without runtime loading")
                else:
                    await asyncio.to_thread(catalog.created_store.remove, made.name)
                    raise BadRequest(f"vLLM did not load the adapter: {e.message}") from None
        if loaded:
            return [{"status": "loaded the adapter into the running model"}]
    # a restart (declared at launch, or a limit must grow): the supervisor, told once vLLM is awake, restarts it
    # (in runtime mode once idle)
    async with model_in_use(request, backend, None):
        pass
    board.adapters_changed()  # rings the owner loop; its restart leaves READY, and its news says so
    await board.wait_left_ready(3 * request.app[SETTINGS].health_interval + 30, request.app[WORKER])
    async with model_in_use(request, backend, None):
        served = await probes.serves(backend.upstream, lora_name)
    if not served:  # the base stayed busy: its restart is tried again at each check
        when = ("its requests in flight did not finish within --drain-timeout" if mode.mode == "launch"
                else "when no request uses it")
        return [{"status": f"the adapter is served once the base model restarts ({when})"}]
    how = (f"({after.max_loras} adapters per batch, max rank {after.max_rank})" if mode.mode == "runtime"
           else f"declared at launch, its API servers kept ({mode.why})")
    return [{"status": f"restarted the base model with LoRA {how}"}]


async def unload_adapter(request: web.Request, made: CreatedModel) -> None:
    """Best effort: the base's running vLLM forgets ``made``'s adapter (``/v1/unload_lora_adapter``);
    a vLLM that is not running, or refuses, is left as it is (its next start no longer has it)."""
    catalog = request.app[CATALOG]
    try:
        base = await catalog.resolve(made.base)
        backend = catalog.backend_of(base)
        if backend.board is not None and not backend.board.ready:
            return
        body = orjson.dumps({"lora_name": next(iter(made.adapters))})
        async with backend.upstream.request("POST", "/v1/unload_lora_adapter", body=body) as resp:
            await read_response(resp)
    except (UpstreamError, ModelNotFound):
        pass


def _same(a: str, b: str) -> bool:
    return strip_latest(a.strip()).casefold() == strip_latest(b.strip()).casefold()
