"""Ollama library names (``llama3.2``, ``qwen2.5:7b``, ``qwen2.5:7b-instruct-q4_K_M``) -> Hugging Face repos.

The table is data, ``library.toml`` beside this module (its header documents the schema, each
row cites its sources); this module loads it, checks it and resolves names (issue 22):

    name            -> the name's ``default_tag`` (what Ollama's ``latest`` points at)
    name:latest     -> the same
    name:tag        -> a size or variant tag, or one of its aliases (``7b-instruct``)
    name:tag-QUANT  -> ``tag``'s ``quant.<class>`` for an Ollama quantization suffix
                       (``q4_K_M`` is class q4): the publisher's AWQ/GPTQ/FP8 repo, or the
                       plain repo with ``fallback`` set when the publisher ships none
    name:QUANT      -> the default tag's, likewise

A user's own file (``--library FILE``, else ``<state_dir>/library.toml``) has the same schema;
a ``[[model]]`` there with a packaged name replaces that row whole, a new name is added.

    python -m vllama_proxy.models.library [FILE ...]

checks files as the loader does (the packaged table strictly: every row sourced, every
parser one vLLM registers) and prints what it found.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllama_proxy.errors import ModelNotFound
from vllama_proxy.logs import get_logger
from .launch_spec import ModelConfig, has_flag

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pyproject installs tomli on 3.10
    import tomli as tomllib

log = get_logger("vllama.library")

#: The packaged table.
PACKAGED = Path(__file__).with_name("library.toml")

QuantClass = Literal["q4", "q8", "fp16"]
CAPABILITIES = ("completion", "tools", "thinking", "vision", "embedding", "insert")
KINDS = ("awq", "gptq-int4", "gptq-int8", "fp8", "w4a16", "unquantized")
_NATIVE = re.compile(r"native-[a-z0-9]+")
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_FIM_FIELD = re.compile(r"\{(prefix|suffix)\}")
#: An Ollama-style name: no ``/`` (that is a Hugging Face id), an optional ``:tag``.
_LIBRARY_LIKE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9][A-Za-z0-9._-]*)?")

# The parsers vLLM registers (vllm/tool_parsers/__init__.py, vllm/reasoning/__init__.py, vLLM
# main of August 2026). The packaged table must use these; a user's file may name others (a
# newer vLLM), which is logged, not refused: vLLM itself rejects a parser it lacks.
TOOL_PARSERS = frozenset({
    "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "cohere_command3", "cohere_command4",
    "ernie45", "glm45", "glm47", "granite-20b-fc", "granite", "granite4", "hermes", "poolside_v1",
    "hunyuan_a13b", "hy_v3", "internlm", "jamba", "lfm2", "kimi_k2", "kimi_k3", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "mimo", "minimax_m2", "minimax_m3", "minicpm5",
    "mistral", "olmo3", "openai", "phi4_mini_json", "pythonic", "qwen3_coder", "qwen3_xml",
    "seed_oss", "step3", "step3p5", "inkling", "xlam", "gigachat3", "functiongemma", "gemma4",
    "apertus", "solar_open2",
})
REASONING_PARSERS = frozenset({
    "deepseek_r1", "deepseek_v3", "deepseek_v4", "poolside_v1", "cohere_command3", "cohere_command4",
    "ernie45", "gemma4", "glm45", "glm47", "openai_gptoss", "granite", "holo2", "hunyuan_a13b", "hy_v3",
    "kimi_k2", "kimi_k3", "mimo", "minimax_m2", "minimax_m2_append_think", "minimax_m3", "mistral",
    "nemotron_v3", "olmo3", "qwen3", "seed_oss", "step3", "step3p5", "inkling", "solar_open2",
})


class LibraryError(ValueError):
    """A library file that cannot be read or breaks the schema (the message names the file and row)."""


# ------------------------------------------------------------------------------ the schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Quant(_Strict):
    """What a quantization tag of one class serves."""

    repo: str
    kind: str = Field(description="awq | gptq-int4 | gptq-int8 | fp8 | w4a16 | unquantized | native-<fmt>")
    fallback: bool = Field(description="The publisher ships no such quantization: the plain repo is served.")

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in KINDS and not _NATIVE.fullmatch(v):
            raise ValueError(f"kind {v!r} is none of {', '.join(KINDS)}, native-<format>")
        return v

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not _REPO.fullmatch(v):
            raise ValueError(f"repo {v!r} is not owner/name")
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
    """One size or variant tag of a name (``[[model.tag]]``); optional fields override the name's."""

    tag: str
    aliases: list[str]
    repo: str
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

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not _REPO.fullmatch(v):
            raise ValueError(f"repo {v!r} is not owner/name")
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
            caps = t.capabilities if t.capabilities is not None else self.capabilities
            unknown = set(caps) - set(CAPABILITIES)
            if unknown:
                raise ValueError(f"{where}capabilities {sorted(unknown)} are none of {', '.join(CAPABILITIES)}")
            tool = t.tool_call_parser if t.tool_call_parser is not None else self.tool_call_parser
            reason = t.reasoning_parser if t.reasoning_parser is not None else self.reasoning_parser
            args = t.vllm_args if t.vllm_args is not None else self.vllm_args
            fim = t.fim if t.fim is not None else self.fim
            if ("insert" in caps) != bool(fim):
                raise ValueError(f"{where}fim must be set if and only if 'insert' is a capability")
            if ("tools" in caps) != bool(tool):
                raise ValueError(f"{where}tool_call_parser must be set if and only if 'tools' is a capability")
            if ("thinking" in caps) != bool(reason):
                raise ValueError(f"{where}reasoning_parser must be set if and only if 'thinking' is a capability")
            if "embedding" in caps:
                if set(caps) & {"completion", "tools", "thinking"}:
                    raise ValueError(f"{where}an embedding model is not also completion/tools/thinking")
                if not pooling(args):
                    raise ValueError(f"{where}an embedding model needs --runner pooling in vllm_args")
            elif "completion" not in caps:
                raise ValueError(f"{where}capabilities need 'completion' or 'embedding'")
            elif pooling(args):
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


def pooling(args: list[str] | tuple[str, ...]) -> bool:
    """Whether ``args`` run vLLM's pooling runner (``--runner pooling``, or the older ``--task embed``)."""
    for i, a in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) else ""
        if (a == "--runner" and nxt == "pooling") or a == "--runner=pooling":
            return True
        if (a == "--task" and nxt in ("embed", "embedding")) or a in ("--task=embed", "--task=embedding"):
            return True
        if (a == "--convert" and nxt == "embed") or a == "--convert=embed":
            return True
    return False


def strict_problems(doc: LibraryFile) -> tuple[list[str], list[str]]:
    """What the packaged table must also get right, beyond the schema: ``(errors, warnings)``.

    Errors: the top-level keys missing; a row without Ollama's library page among its
    sources; a parser vLLM does not register. Warnings: a tag's model card not among the sources.
    """
    errors: list[str] = []
    warnings: list[str] = []
    if doc.schema_version != 1 or doc.quant_classes is None:
        errors.append("top: schema_version = 1 and [quant_classes] are required")
    for m in doc.model:
        if f"https://ollama.com/library/{m.name}" not in m.sources:
            errors.append(f"{m.name}: sources lack https://ollama.com/library/{m.name}")
        errors += [f"{m.name}: {p}" for p in unknown_parsers(m)]
        for t in m.tag:
            if f"https://huggingface.co/{t.repo}" not in m.sources:
                warnings.append(f"{m.name}:{t.tag}: the model card https://huggingface.co/{t.repo} is not among the sources")
    return errors, warnings


def unknown_parsers(m: Model) -> list[str]:
    """The parsers ``m`` names that vLLM (as of the table's making) does not register."""
    out = []
    for t in (None, *m.tag):
        tool = (t.tool_call_parser if t and t.tool_call_parser is not None else m.tool_call_parser)
        reason = (t.reasoning_parser if t and t.reasoning_parser is not None else m.reasoning_parser)
        if tool and tool not in TOOL_PARSERS:
            out.append(f"unknown tool_call_parser {tool!r}")
        if reason and reason not in REASONING_PARSERS:
            out.append(f"unknown reasoning_parser {reason!r}")
    return sorted(set(out))


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


# ------------------------------------------------------------------------------ resolution


@dataclass(frozen=True)
class Entry:
    """What a library name resolves to: the repo to serve and how vLLM should serve it.

    Attributes:
        name: the canonical ``name:tag`` (``qwen2.5:7b``; a quantization tag keeps its suffix).
        repo, revision: the Hugging Face repo to load (the quantized one for a quantization tag).
        quant: the quantization class asked for (``q4``/``q8``/``fp16``), ``None`` for a plain tag.
        quant_kind: what ``repo`` holds: ``awq``, ``gptq-int8``, ``unquantized``, ... (``None``: as published).
        fallback: a quantization was asked for that the publisher does not ship: ``repo`` is the plain one.
    """

    name: str
    repo: str
    revision: str
    family: str
    parameters: str
    context_length: int
    capabilities: tuple[str, ...]
    tool_call_parser: str
    reasoning_parser: str
    chat_template: str
    extra_args: tuple[str, ...]
    quant: str | None = None
    quant_kind: str | None = None
    fallback: bool = False
    fim: str = ""

    def vllm_args(self) -> list[str]:
        """The ``vllm serve`` arguments the name's capabilities need: tool calling with its parser,
        the reasoning parser, the revision when not ``main``, then the row's own (``--runner
        pooling``, ``--trust-remote-code``, Mistral formats, ...).

        The row's ``chat_template`` is a file in vLLM's source tree, which its wheel does not
        ship; it is left out (the repo's own template is used).
        """
        out: list[str] = []
        if self.tool_call_parser:
            out += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser:
            out += ["--reasoning-parser", self.reasoning_parser]
        if self.revision != "main":
            out += ["--revision", self.revision]
        return out + list(self.extra_args)


class Library:
    """The packaged table, extended or overridden by a user's file.

    Args:
        packaged: the packaged file, parsed.
        user: a user's file, parsed: its rows replace packaged rows of the same name (whole,
            all tags), new names are added; its ``[quant_classes]``, when given, replace the packaged ones.
    """

    def __init__(self, packaged: LibraryFile, user: LibraryFile | None = None, *, user_path: Path | None = None) -> None:
        rows = {m.name: m for m in packaged.model}
        self.replaced: list[str] = []
        self.added: list[str] = []
        for m in (user.model if user else []):
            (self.replaced if m.name in rows else self.added).append(m.name)
            rows[m.name] = m
        self._rows = rows
        #: parsers of the user's rows that vLLM did not register when the table was made
        self.warnings = [f"{m.name}: {p}" for m in (user.model if user else []) for p in unknown_parsers(m)]
        classes = (user.quant_classes if user and user.quant_classes else None) or packaged.quant_classes
        assert classes is not None  # the packaged file has them (strict_problems)
        self._suffixes: list[tuple[str, str]] = sorted(
            ((s.casefold(), cls) for cls in ("q4", "q8", "fp16") for s in getattr(classes, cls)),
            key=lambda p: -len(p[0]),
        )
        self.user_path = user_path
        #: fill-in-the-middle formats by style: the packaged ones, then the user's (same style replaces)
        self.fim: dict[str, Fim] = {**packaged.fim, **(user.fim if user else {})}
        unknown = {f"{m.name}: fim style {f!r}" for m in rows.values() for f in [m.fim, *(t.fim for t in m.tag)]
                   if f and f not in self.fim}
        if unknown:
            raise LibraryError(f"unknown fill-in-the-middle styles (no [fim.<style>] table): {', '.join(sorted(unknown))}")
        self._by_repo: dict[str, tuple[Model, Tag]] = {}
        for m in rows.values():
            for t in m.tag:
                self._by_repo.setdefault(t.repo.casefold(), (m, t))

    # -- lookups -------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Every library name (``qwen2.5``), in file order."""
        return list(self._rows)

    def model(self, name: str) -> Model | None:
        """The row of a name (without tag), any case."""
        return self._rows.get(name.casefold())

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` (``x`` or ``x:tag``) is a name of the table (its tag may still be unknown)."""
        return isinstance(name, str) and looks_like_library_name(name) and self.model(name.partition(":")[0]) is not None

    def resolve(self, name: str) -> Entry:
        """The entry ``name`` (``qwen2.5``, ``qwen2.5:latest``, ``qwen2.5:7b-instruct-q4_K_M``) means.

        Raises:
            ModelNotFound: the name or its tag is not in the table; the message names the closest
                names (or the name's tags) and how to name a Hugging Face model instead.
        """
        base, _, tag = name.strip().partition(":")
        row = self.model(base) if looks_like_library_name(name.strip()) else None
        if row is None:
            raise ModelNotFound(name, self.advice(name))
        tag_cf = tag.casefold()
        if tag_cf in ("", "latest"):
            return self._entry(row, self._tag(row, row.default_tag), None, f"{row.name}:{row.default_tag}")
        t = self._tag(row, tag_cf)
        if t is not None:
            return self._entry(row, t, None, f"{row.name}:{t.tag}")
        for suffix, cls in self._suffixes:
            if tag_cf == suffix:
                stem = row.default_tag
            elif tag_cf.endswith("-" + suffix):
                stem = tag_cf[: -len(suffix) - 1]
            else:
                continue
            t = self._tag(row, stem)
            if t is not None:
                return self._entry(row, t, cls, f"{row.name}:{t.tag}-{tag[len(tag) - len(suffix):]}")
        raise ModelNotFound(name, self.tag_advice(row))

    def by_repo(self, repo: str) -> Entry | None:
        """The entry whose plain tag serves Hugging Face repo ``repo`` (any case), else ``None``."""
        found = self._by_repo.get(repo.casefold())
        if found is None:
            return None
        row, t = found
        return self._entry(row, t, None, f"{row.name}:{t.tag}")

    def _tag(self, row: Model, tag: str) -> Tag | None:
        tag = tag.casefold()
        return next((t for t in row.tag if t.tag.casefold() == tag or tag in (a.casefold() for a in t.aliases)), None)

    def _entry(self, row: Model, t: Tag | None, cls: str | None, canonical: str) -> Entry:
        assert t is not None  # default_tag is one of the tags (the schema)
        q = t.quant[cls] if cls else None  # type: ignore[index]
        return Entry(
            name=canonical,
            repo=q.repo if q else t.repo,
            revision=t.revision,
            family=t.family or row.family,
            parameters=t.parameters,
            context_length=t.context_length,
            capabilities=tuple(t.capabilities if t.capabilities is not None else row.capabilities),
            tool_call_parser=t.tool_call_parser if t.tool_call_parser is not None else row.tool_call_parser,
            reasoning_parser=t.reasoning_parser if t.reasoning_parser is not None else row.reasoning_parser,
            chat_template=t.chat_template if t.chat_template is not None else row.chat_template,
            extra_args=tuple(t.vllm_args if t.vllm_args is not None else row.vllm_args),
            quant=cls,
            quant_kind=q.kind if q else None,
            fallback=q.fallback if q else False,
            fim=(t.fim if t.fim is not None else row.fim) or "",
        )

    # -- advice --------------------------------------------------------------------
    def closest(self, name: str, also: list[str] | tuple[str, ...] = (), n: int = 3) -> list[str]:
        """The known names closest to ``name``, compared without tags; ``also`` (the served names)
        are given whole and win over a library name of the same base (``qwen2.5:0.5b`` over ``qwen2.5``)."""
        base = name.partition(":")[0].casefold()
        pool = {c.casefold(): c for c in self._rows}
        pool.update({c.partition(":")[0].casefold(): c for c in also})
        return [pool[c] for c in difflib.get_close_matches(base, list(pool), n=n, cutoff=0.6)]

    def advice(self, name: str, served: list[str] | tuple[str, ...] = ()) -> str:
        """Why ``name`` is not a library name, what is close, and how to name a Hugging Face model."""
        close = self.closest(name, served)
        hint = f"the closest known names are {', '.join(close)}; " if close else ""
        return (f"it is not a name in vllama's library ({len(self._rows)} Ollama names, see docs/library.md); "
                f"{hint}a Hugging Face model is named by its id, org/name (e.g. Qwen/Qwen2.5-7B-Instruct)")

    def tag_advice(self, row: Model) -> str:
        """The tags ``row`` knows, for a tag that is not one of them."""
        tags = ", ".join(t.tag for t in row.tag)
        return (f"vllama's library knows {row.name} with the tags {tags} and latest (= {row.default_tag}), "
                "each also with a quantization suffix such as -q4_K_M, -q8_0 or -fp16")


def library_model(model: str, lib: Library) -> bool:
    """Whether ``model`` (a ``--model`` or ``[[models]] model =`` value) is to be read as a library
    name: it has the form (no ``/``), is no existing local path, and is a name of the table, or has
    a tag (``x:y`` is neither a Hugging Face id nor a directory vLLM could load, so an unknown one
    is an error). An unknown plain ``x`` is left to vLLM as today (a local name, or a legacy Hub id
    such as ``gpt2``)."""
    if not looks_like_library_name(model) or Path(model).expanduser().exists():
        return False
    return ":" in model or model in lib


def resolve_spec(spec: ModelConfig, lib: Library) -> tuple[ModelConfig, Entry | None]:
    """``spec`` with a library name replaced by its repo, served under the name as written
    (``qwen2.5:7b``; ``x:latest`` as ``x``), with the name's vLLM arguments; and the entry.

    What the user gave wins and is never doubled: a ``tool_call_parser`` / ``reasoning_parser``
    field or ``--tool-call-parser`` / ``--reasoning-parser`` in ``vllm_args`` replaces the
    library's parser; any other library flag (``--runner``, ``--trust-remote-code``, ...) the
    user's ``vllm_args`` already has is left out. A spec naming no library name comes back as it is.

    Raises:
        ModelNotFound: a ``name:tag`` the table does not know (the message says what is close).
    """
    if not library_model(spec.model, lib):
        return spec, None
    entry = lib.resolve(spec.model)
    user = spec.vllm_args
    tool = spec.tool_call_parser
    if tool is None and entry.tool_call_parser and not has_flag(user, "--tool-call-parser"):
        tool = entry.tool_call_parser
    reason = spec.reasoning_parser
    if reason is None and entry.reasoning_parser and not has_flag(user, "--reasoning-parser"):
        reason = entry.reasoning_parser
    extra = list(entry.extra_args)
    if entry.revision != "main":
        extra = ["--revision", entry.revision, *extra]
    if tool is None and entry.tool_call_parser and not has_flag(user, "--enable-auto-tool-choice"):
        extra = ["--enable-auto-tool-choice", *extra]  # the user's own parser, still with tools on
    added = [a for group in _flag_groups(extra) if not has_flag(user, group[0].split("=", 1)[0]) for a in group]
    name = spec.name or spec.model.removesuffix(":latest")
    resolved = ModelConfig.model_validate({
        **spec.model_dump(exclude_unset=True),
        "model": entry.repo, "name": name, "tool_call_parser": tool, "reasoning_parser": reason,
        "vllm_args": [*added, *user],
    })
    return resolved, entry


def _flag_groups(args: list[str]) -> list[list[str]]:
    """``["--runner", "pooling", "--trust-remote-code"]`` -> ``[["--runner", "pooling"], ["--trust-remote-code"]]``."""
    groups: list[list[str]] = []
    for a in args:
        if a.startswith("-") or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    return groups


def looks_like_library_name(name: str) -> bool:
    """Whether ``name`` has the form of an Ollama library name (``x`` or ``x:tag``): no ``/``, so
    neither a Hugging Face id nor a path. Whether the table knows it is :meth:`Library.resolve`'s."""
    return bool(_LIBRARY_LIKE.fullmatch(name))


@lru_cache(maxsize=1)
def packaged() -> LibraryFile:
    """The packaged table, read once per process.

    Raises:
        LibraryError: it breaks the schema (a broken release; the tests keep it from shipping).
    """
    return read_file(PACKAGED)


def load(user_file: Path | None = None) -> Library:
    """The packaged table extended by ``user_file`` (see :class:`Library`).

    Raises:
        LibraryError: a file is unreadable or breaks the schema.
    """
    user = read_file(user_file) if user_file is not None else None
    return Library(packaged(), user, user_path=user_file)


def log_user_file(lib: Library) -> None:
    """One line on what a user's file changed (and a warning per parser vLLM may lack); nothing without one."""
    if lib.user_path is None:
        return
    log.info("library", file=str(lib.user_path), added=lib.added, replaced=lib.replaced, names=len(lib.names))
    for problem in lib.warnings:
        log.warning("library_parser_unknown", file=str(lib.user_path), problem=problem)


def main(argv: list[str]) -> int:
    """Check library files (default: the packaged one, strictly); print one summary line per file."""
    status = 0
    for arg in argv or [str(PACKAGED)]:
        path = Path(arg)
        try:
            doc = read_file(path)
        except LibraryError as e:
            print(f"error: {e}")
            status = 1
            continue
        errors, warnings = strict_problems(doc) if path.resolve() == PACKAGED.resolve() else ([], [])
        for w in warnings:
            print(f"warning: {path}: {w}")
        for e in errors:
            print(f"error: {path}: {e}")
        tags = sum(len(m.tag) for m in doc.model)
        print(f"{path}: {len(doc.model)} names, {tags} tags, {len(errors)} errors, {len(warnings)} warnings")
        status |= bool(errors)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
