"""Ollama library names (``llama3.2``, ``qwen2.5:7b``, ``qwen2.5:7b-instruct-q4_K_M``) -> what vLLM launches.

The table is data, ``library.toml`` beside this module (its header documents the schema, each row
cites its sources; ``library_schema.py`` reads it, ``library_check.py`` checks it,
``library_advice.py`` words a 404). This module resolves ``name`` and ``name:latest`` to the
``default_tag``, ``name:tag`` to a size or variant tag or one of its aliases, and ``name:tag-QUANT``
/ ``name:QUANT`` to that tag's ``quant.<class>`` (``q4_K_M`` is class q4: the publisher's
AWQ/GPTQ/FP8 repo, or the plain repo with ``fallback`` set), giving an :class:`Entry` and its launch
spec (:meth:`Entry.launch_spec`). A user's file (``--library FILE``, else
``<state_dir>/library.toml``) has the same schema: a packaged name there replaces that row whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from vllama_proxy.errors import ModelNotFound
from vllama_proxy.logs import get_logger
from .launch_spec import ModelConfig, has_flag
from .library_advice import advice, tag_advice
from .library_check import unknown_parsers
from .library_schema import Fim, LibraryError, LibraryFile, Model, Tag, packaged, read_file

log = get_logger("vllama.library")

#: An Ollama-style name: no ``/`` (that is a Hugging Face id), an optional ``:tag``.
_LIBRARY_LIKE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9][A-Za-z0-9._-]*)?")


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

    def launch_spec(self, spec: ModelConfig) -> ModelConfig:
        """``spec`` (which names this entry) made what vLLM launches: the entry's repo, served under
        the name as written (``qwen2.5:7b``; ``x:latest`` as ``x``), with the name's vLLM arguments
        as the spec's fields and ``vllm_args``, so that :meth:`ModelConfig.args`, the one builder
        of launch flags, turns them into flags.

        What the user gave wins and is never doubled: a ``tool_call_parser`` / ``reasoning_parser``
        field or ``--tool-call-parser`` / ``--reasoning-parser`` in ``vllm_args`` replaces the
        library's parser; any other library flag (``--runner``, ``--trust-remote-code``, ...) the
        user's ``vllm_args`` already has is left out. The row's ``chat_template`` is a file in
        vLLM's source tree, which its wheel does not ship; it is left out (the repo's own template
        is used).
        """
        user = spec.vllm_args
        tool = spec.tool_call_parser
        if tool is None and self.tool_call_parser and not has_flag(user, "--tool-call-parser"):
            tool = self.tool_call_parser
        reason = spec.reasoning_parser
        if reason is None and self.reasoning_parser and not has_flag(user, "--reasoning-parser"):
            reason = self.reasoning_parser
        extra = list(self.extra_args)
        if self.revision != "main":
            extra = ["--revision", self.revision, *extra]
        if tool is None and self.tool_call_parser and not has_flag(user, "--enable-auto-tool-choice"):
            extra = ["--enable-auto-tool-choice", *extra]  # the user's own parser, still with tools on
        added = [a for group in _flag_groups(extra) if not has_flag(user, group[0].split("=", 1)[0]) for a in group]
        return ModelConfig.model_validate({
            **spec.model_dump(exclude_unset=True),
            "model": self.repo, "name": spec.name or spec.model.removesuffix(":latest"),
            "tool_call_parser": tool, "reasoning_parser": reason, "vllm_args": [*added, *user],
        })

    def vllm_args(self) -> list[str]:
        """The ``vllm serve`` flags the name brings on its own (``vllama serve --model NAME``, no
        flags of the user's): :meth:`launch_spec`'s, built by :meth:`ModelConfig.args`. Tool calling
        with its parser, the reasoning parser, then the revision when not ``main`` and the row's
        own (``--runner pooling``, ``--trust-remote-code``, Mistral formats, ...)."""
        return self.launch_spec(ModelConfig(model=self.name)).args()


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
            raise ModelNotFound(name, advice(name, self.names))
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
        raise ModelNotFound(name, tag_advice(row))

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
        f = row.served_by(t)
        return Entry(
            name=canonical,
            repo=q.repo if q else t.repo,
            revision=t.revision,
            family=f.family,
            parameters=t.parameters,
            context_length=t.context_length,
            capabilities=f.capabilities,
            tool_call_parser=f.tool_call_parser,
            reasoning_parser=f.reasoning_parser,
            chat_template=f.chat_template,
            extra_args=f.vllm_args,
            quant=cls,
            quant_kind=q.kind if q else None,
            fallback=q.fallback if q else False,
            fim=f.fim,
        )


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
    """``spec`` with a library name replaced by what it launches (:meth:`Entry.launch_spec`), and
    the entry; a spec naming no library name (:func:`library_model`) comes back as it is, with ``None``.

    Raises:
        ModelNotFound: a ``name:tag`` the table does not know (the message says what is close).
    """
    if not library_model(spec.model, lib):
        return spec, None
    entry = lib.resolve(spec.model)
    return entry.launch_spec(spec), entry


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
