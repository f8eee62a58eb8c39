"""The schema of the library table (``library.toml``, and a user's file of the same shape), and reading one file.

The pydantic models below are the table's rows: a ``[[model]]`` (:class:`Model`) per Ollama name
with its ``[[model.tag]]`` (:class:`Tag`) sizes and variants, their ``quant.<class>``
(:class:`Quant`), the ``[fim.<style>]`` formats (:class:`Fim`) and the ``[quant_classes]``.
Validation checks one file's shape and inner consistency (a ``tools`` capability has a tool
parser, an embedding model runs vLLM's pooling runner, ...); what else the packaged table must get
right is ``library_check.py``'s, how names resolve is ``library.py``'s .
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .launch_spec import pooling

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pyproject installs tomli on 3.10
    import tomli as tomllib

#: The packaged table.
PACKAGED = Path(__file__).with_name("library.toml")

QuantClass = Literal["q4", "q8", "fp16"]
CAPABILITIES = ("completion", "tools", "thinking", "vision", "embedding", "insert")
KINDS = ("awq", "gptq-int4", "gptq-int8", "fp8", "w4a16", "unquantized")
_NATIVE = re.compile(r"native-[a-z0-9]+")
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


def _owner_name(v: str) -> str:
    if not _REPO.fullmatch(v):
        raise ValueError(f"repo {v!r} is not owner/name")
    return v


#: A Hugging Face repo id, ``owner/name``.
Repo = Annotated[str, AfterValidator(_owner_name)]
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_FIM_FIELD = re.compile(r"\{(prefix|suffix)\}")


class LibraryError(ValueError):
    """A library file that cannot be read or breaks the schema (the message names the file and row)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Quant(_Strict):
    """What a quantization tag of one class serves."""

    repo: Repo
    kind: str = Field(description="awq | gptq-int4 | gptq-int8 | fp8 | w4a16 | unquantized | native-<fmt>")
    fallback: bool = Field(description="The publisher ships no such quantization: the plain repo is served.")

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in KINDS and not _NATIVE.fullmatch(v):
            raise ValueError(f"kind {v!r} is none of {', '.join(KINDS)}, native-<format>")
        return v


class Fim(_Strict):
    """A fill-in-the-middle prompt format (``[fim.<style>]``): what ``/api/generate``'s ``suffix`` becomes.

    ``template`` has ``{prefix}`` and ``{suffix}``; ``tokens`` are the special tokens a model's
    tokenizer must have for it; ``stop`` ends the middle (sent to vLLM as ``stop_token_ids`` where
    the tokenizer knows them, else as ``stop`` strings).
    """

    template: str
    tokens: list[str] = Field(min_length=1)
    stop: list[str]
    sources: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _fields(self) -> Fim:
        if "{prefix}" not in self.template or "{suffix}" not in self.template:
            raise ValueError("template needs {prefix} and {suffix}")
        return self

    def prompt(self, prefix: str, suffix: str) -> str:
        """The FIM prompt for ``prefix`` (what precedes the cursor) and ``suffix`` (what follows it)."""
        parts = {"prefix": prefix, "suffix": suffix}
        return _FIM_FIELD.sub(lambda m: parts[m.group(1)], self.template)


class Tag(_Strict):
    """One size or variant tag of a name (``[[model.tag]]``); optional fields override the name's (:meth:`Model.served_by`)."""

    tag: str
    aliases: list[str]
    repo: Repo
    revision: str
    parameters: str
    context_length: int = Field(gt=0)
    quant: dict[QuantClass, Quant]
    ollama_quant: str | None = None
    ollama_quants: list[str] = Field(default_factory=list)
    family: str | None = None
    capabilities: list[str] | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    vllm_args: list[str] | None = None
    note: str | None = None
    fim: str | None = None

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if v == "latest" or not _TAG.fullmatch(v):
            raise ValueError(f"bad tag name {v!r} (never 'latest'; letters, digits, '.', '_', '-')")
        return v

    @model_validator(mode="after")
    def _quants(self) -> Tag:
        missing = {"q4", "q8", "fp16"} - set(self.quant)
        if missing:
            raise ValueError(f"quant lacks {', '.join(sorted(missing))}")
        for cls, q in self.quant.items():
            if q.fallback and q.repo != self.repo:
                raise ValueError(f"quant.{cls} is a fallback but names another repo than {self.repo}")
            if not q.fallback and q.kind == "unquantized" and q.repo != self.repo:
                raise ValueError(f"quant.{cls} is unquantized but not the tag's repo {self.repo}")
        if "latest" in self.aliases:
            raise ValueError("'latest' is no alias: it is the name's default_tag")
        return self


@dataclass(frozen=True)
class TagFields:
    """The fields a ``[[model.tag]]`` may override, as one tag serves them (:meth:`Model.served_by`)."""

    family: str
    capabilities: tuple[str, ...]
    tool_call_parser: str
    reasoning_parser: str
    chat_template: str
    vllm_args: tuple[str, ...]
    fim: str


class Model(_Strict):
    """One Ollama library name (``[[model]]``)."""

    name: str
    default_tag: str
    family: str
    capabilities: list[str]
    context_length: int = Field(gt=0)
    tool_call_parser: str
    reasoning_parser: str
    vllm_args: list[str]
    sources: list[str]
    tag: list[Tag] = Field(min_length=1)
    ollama_capabilities: list[str] = Field(default_factory=list)
    chat_template: str = ""
    note: str = ""
    fim: str = ""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError(f"bad name {v!r} (lower case letters, digits, '.', '_', '-')")
        return v

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: list[str]) -> list[str]:
        if not all(s.startswith("https://") for s in v):
            raise ValueError("sources must be https URLs")
        return v

    def served_by(self, t: Tag | None) -> TagFields:
        """The overridable fields as tag ``t`` serves them (``None``: the row's own).

        The one place the rule "a tag's field overrides the row's" is written: a field the
        ``[[model.tag]]`` sets (not ``None``) wins, any other comes from the ``[[model]]``.
        """
        def pick(name: str) -> object:
            own = getattr(t, name) if t is not None else None
            value = own if own is not None else getattr(self, name)
            return tuple(value) if isinstance(value, list) else value

        return TagFields(**{f.name: pick(f.name) for f in fields(TagFields)})  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _consistent(self) -> Model:
        tags: set[str] = set()
        aliases: set[str] = set()
        for t in self.tag:
            if t.tag in tags:
                raise ValueError(f"tag {t.tag!r} twice")
            tags.add(t.tag)
            for a in t.aliases:
                if a in aliases:
                    raise ValueError(f"alias {a!r} twice")
                aliases.add(a)
        if tags & aliases:
            raise ValueError(f"aliases collide with tags: {', '.join(sorted(tags & aliases))}")
        if self.default_tag not in tags:
            raise ValueError(f"default_tag {self.default_tag!r} is not one of its tags")
        for t in self.tag:
            where = f"tag {t.tag}: "
            f = self.served_by(t)
            caps = f.capabilities
            unknown = set(caps) - set(CAPABILITIES)
            if unknown:
                raise ValueError(f"{where}capabilities {sorted(unknown)} are none of {', '.join(CAPABILITIES)}")
            if ("insert" in caps) != bool(f.fim):
                raise ValueError(f"{where}fim must be set if and only if 'insert' is a capability")
            if ("tools" in caps) != bool(f.tool_call_parser):
                raise ValueError(f"{where}tool_call_parser must be set if and only if 'tools' is a capability")
            if ("thinking" in caps) != bool(f.reasoning_parser):
                raise ValueError(f"{where}reasoning_parser must be set if and only if 'thinking' is a capability")
            if "embedding" in caps:
                if set(caps) & {"completion", "tools", "thinking"}:
                    raise ValueError(f"{where}an embedding model is not also completion/tools/thinking")
                if not pooling(f.vllm_args):
                    raise ValueError(f"{where}an embedding model needs --runner pooling in vllm_args")
            elif "completion" not in caps:
                raise ValueError(f"{where}capabilities need 'completion' or 'embedding'")
            elif pooling(f.vllm_args):
                raise ValueError(f"{where}--runner pooling without the 'embedding' capability")
        return self


class QuantClasses(_Strict):
    q4: list[str]
    q8: list[str]
    fp16: list[str]

    @model_validator(mode="after")
    def _disjoint(self) -> QuantClasses:
        seen: set[str] = set()
        for s in (*self.q4, *self.q8, *self.fp16):
            if s.casefold() in seen:
                raise ValueError(f"suffix {s!r} is in two classes")
            seen.add(s.casefold())
        return self


class LibraryFile(_Strict):
    """A whole file: the packaged table, or a user's (which may leave out the top-level keys)."""

    schema_version: Literal[1] | None = None
    ollama_snapshot: str | None = None
    quant_classes: QuantClasses | None = None
    fim: dict[str, Fim] = Field(default_factory=dict)
    model: list[Model] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> LibraryFile:
        seen: set[str] = set()
        for m in self.model:
            if m.name in seen:
                raise ValueError(f"name {m.name!r} twice")
            seen.add(m.name)
        return self


def read_file(path: Path) -> LibraryFile:
    """``path`` parsed and checked against the schema.

    Raises:
        LibraryError: unreadable, not TOML, or not the schema (each problem with its row).
    """
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise LibraryError(f"library file {str(path)!r}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise LibraryError(f"library file {path}: not valid TOML: {e}") from None
    try:
        return LibraryFile.model_validate(raw)
    except ValidationError as e:
        raise LibraryError(f"library file {path}: " + "; ".join(_where(raw, err) for err in e.errors(include_url=False))) from None


def _where(raw: dict, err: dict) -> str:
    """A validation error as ``qwen2.5:7b quant.q4.kind: ...`` (the row's name, not its index)."""
    loc = list(err["loc"])
    parts: list[str] = []
    if loc[:1] == ["model"] and len(loc) > 1 and isinstance(loc[1], int):
        rows = raw.get("model", [])
        row = rows[loc[1]] if loc[1] < len(rows) else {}
        name = str(row.get("name", f"model[{loc[1]}]"))
        loc = loc[2:]
        if loc[:1] == ["tag"] and len(loc) > 1 and isinstance(loc[1], int):
            tags = row.get("tag", [])
            name += ":" + str(tags[loc[1]].get("tag", loc[1]) if loc[1] < len(tags) else loc[1])
            loc = loc[2:]
        parts.append(name)
    if loc:
        parts.append(".".join(str(p) for p in loc))
    msg = err["msg"].removeprefix("Value error, ")
    return f"{' '.join(parts)}: {msg}" if parts else msg


@lru_cache(maxsize=1)
def packaged() -> LibraryFile:
    """The packaged table, read once per process.

    Raises:
        LibraryError: it breaks the schema (a broken release; the tests keep it from shipping).
    """
    return read_file(PACKAGED)
