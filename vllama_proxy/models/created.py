"""Models made with ``POST /api/create``: a name, a base model vLLM serves, and Ollama's Modelfile layers.

A created model (``FROM base`` + ``SYSTEM``, ``PARAMETER``, ``MESSAGE``, ``LICENSE``, ``ADAPTER``) is
served by its base's vLLM: no weights copied, no GPU memory added; its layers apply per request
(``api/ollama/to_openai.py`` :func:`with_model_defaults`). They are kept in
``<state_dir>/created.json``, written under an ``flock`` and replaced atomically, as ``aliases.py``
does. :func:`render_modelfile` writes Ollama's Modelfile text; :func:`parse_modelfile` reads one
(Ollama's ``parser/parser.go`` grammar, :func:`vllama_proxy.read_modelfile`).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from vllama_proxy import ModelfileError, read_modelfile
from vllama_proxy.errors import BadRequest
from vllama_proxy.logs import get_logger
from . import state_file

log = get_logger("vllama.created")


class CreatedModel(BaseModel):
    """One created model.

    Attributes:
        name: its name without ``:latest`` (``mario``, ``team/coder:v2``).
        base: the served model's name requests go to (vLLM's ``model``).
        parent: the ``from`` as the client sent it (``details.parent_model``, ``FROM`` of its Modelfile).
        system: the default system prompt, or ``None``.
        parameters: default Ollama options (``{"temperature": 0.2, "stop": ["x"]}``); a request's own win.
        messages: messages put before every chat (Ollama's ``MESSAGE``), as ``{"role", "content"}``.
        license: license texts.
        adapters: LoRA adapters: the name vLLM serves each under -> where it was loaded from.
        draft: ``DRAFT``: speculative decoding's draft (``ngram``, a directory, a Hugging Face repo id;
            ``models/modelfile_v033.py``), which the base's vLLM runs with; ``None``: none.
        draft_num_predict: tokens drafted at a time (``PARAMETER draft_num_predict``); ``None``: Ollama's default.
        requires: ``REQUIRES``: the Ollama version the model needs (checked at create).
        renderer: ``RENDERER``, accepted where the base's chat template is of its family.
        parser: ``PARSER``, accepted where the base's vLLM parsers are its counterparts.
        created_at: seconds since the epoch.
    """

    name: str
    base: str
    parent: str
    system: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    license: list[str] = Field(default_factory=list)
    adapters: dict[str, str] = Field(default_factory=dict)
    draft: str | None = None
    draft_num_predict: int | None = None
    requires: str | None = None
    renderer: str | None = None
    parser: str | None = None
    created_at: float = Field(default_factory=time.time)

    @property
    def digest(self) -> str:
        """64 hex characters naming this content (``/api/tags``' ``digest``; Ollama 0.33's fields count
        only when set, so that a model made before them keeps its digest)."""
        dump = self.model_dump(exclude={"created_at"})
        for k in _V033:
            if dump[k] is None:
                del dump[k]
        return hashlib.sha256(json.dumps(dump, sort_keys=True).encode()).hexdigest()

    def served_as(self, base: str) -> str:
        """vLLM's ``model`` for a request to this model on ``base`` (its base as served): its LoRA adapter,
        which vLLM serves under that name (``models/adapters.py``), else ``base``."""
        return next(iter(self.adapters), base) if self.adapters else base

    def layers(self) -> list[tuple[str, str]]:
        """``(media type, sha256 hex)`` of each Modelfile layer, as Ollama names them in create's progress."""
        parts = [("application/vnd.ollama.image.system", self.system), ("application/vnd.ollama.image.params", self.parameters or None),
                 ("application/vnd.ollama.image.messages", self.messages or None),
                 ("application/vnd.ollama.image.license", self.license or None),
                 ("application/vnd.ollama.image.adapter", self.adapters or None)]
        return [(kind, hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()) for kind, v in parts if v is not None]


#: The fields of Ollama 0.33's Modelfile commands (``DRAFT``, ``REQUIRES``, ``RENDERER``, ``PARSER``).
_V033 = ("draft", "draft_num_predict", "requires", "renderer", "parser")


# ------------------------------------------------------------------------------ the store


class CreatedStore(state_file.NameStore[dict[str, CreatedModel]]):
    """``<state_dir>/created.json`` (see the module docstring); re-read when its mtime or size changed,
    looked at when a write of this server counted a change (or a second passed: ``state_file.RECHECK``).

    Args:
        path: the JSON file (its directory is made on the first write).
        changes: its change count shared by the server's processes (``state_file.Changes``): a lookup
            then looks at the file only when a write moved it; ``None``: a ``stat`` per lookup.
    """

    def __init__(self, path: Path, changes: state_file.Changes | None = None) -> None:
        super().__init__(path, lambda: {k.casefold(): m for k, m in self._read().items()}, dict, changes)

    def current(self) -> dict[str, CreatedModel]:
        """Folded name -> created model, as the file says now (``{}`` when absent or unreadable)."""
        return self._view.get()

    def lookup(self, name: str) -> CreatedModel | None:
        """The created model ``name`` (``X`` or ``X:latest``, any case) names, else ``None``."""
        return self.current().get(_key(name))

    def put(self, model: CreatedModel) -> None:
        """Add or replace ``model``.

        Raises:
            OSError: the state directory cannot be written.
        """
        self._put(model.name, model.model_dump())

    def _fold(self, name: str) -> str:
        return _key(name)

    def _read(self) -> dict[str, CreatedModel]:
        out = {}
        for k, v in state_file.read_object(self.path, log, "created_unreadable").items():
            try:
                out[str(k)] = CreatedModel.model_validate(v)
            except ValueError as e:
                log.warning("created_entry_unreadable", name=k, error=str(e))
        return out

    def _raw(self) -> dict[str, Any]:
        return {k: m.model_dump() for k, m in self._read().items()}


def _key(name: str) -> str:
    name = name.strip()
    return (name[: -len(":latest")] if name.endswith(":latest") else name).casefold()



# ------------------------------------------------------------------------------ Modelfiles


def _quoted(text: str) -> str:
    return f'"""{text}"""' if ("\n" in text or '"' in text or not text) else f'"{text}"'


def _param_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def parameter_lines(parameters: dict[str, Any]) -> list[str]:
    """``key value`` lines (a list, such as ``stop``, one line per value), as Ollama's show prints them."""
    out = []
    for k, v in parameters.items():
        for item in v if isinstance(v, list) else [v]:
            out.append(f"{k} {_param_value(item)}")
    return out


def render_modelfile(m: CreatedModel) -> str:
    """The Modelfile that makes ``m`` again (``FROM`` its parent; adapters by where they came from)."""
    lines = ['# Modelfile generated by vllama ("ollama show --modelfile")', f"FROM {m.parent or m.base}"]
    lines += [f"ADAPTER {src}" for src in m.adapters.values()]
    if m.draft is not None:
        lines.append(f"DRAFT {m.draft}")
    lines += [f"{cmd.upper()} {v}" for cmd, v in (("requires", m.requires), ("renderer", m.renderer), ("parser", m.parser)) if v]
    if m.system is not None:
        lines.append(f"SYSTEM {_quoted(m.system)}")
    lines += [f"PARAMETER {p}" for p in parameter_lines(m.parameters)]
    if m.draft_num_predict is not None:
        lines.append(f"PARAMETER draft_num_predict {m.draft_num_predict}")
    lines += [f"MESSAGE {msg['role']} {_quoted(str(msg.get('content') or ''))}" for msg in m.messages]
    lines += [f"LICENSE {_quoted(text)}" for text in m.license]
    return "\n".join(lines) + "\n"


def parse_modelfile(text: str) -> dict[str, Any]:
    """A Modelfile -> the fields of Ollama's create request (:func:`vllama_proxy.read_modelfile`,
    the grammar the client's ``vllama create`` reads too).

    Raises:
        BadRequest: what ``read_modelfile`` cannot read (a line that is no command, an
            unterminated ``\"\"\"``, a bad ``MESSAGE`` role).
    """
    try:
        return read_modelfile(text)
    except ModelfileError as e:
        raise BadRequest(str(e)) from None


__all__ = ["CreatedModel", "CreatedStore", "parameter_lines", "parse_modelfile", "render_modelfile"]
