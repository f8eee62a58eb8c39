"""Fill-in-the-middle: which served models take ``/api/generate``'s ``suffix``, and how.

Ollama fills in the middle for a model whose template renders ``.Suffix`` (its ``insert``
capability, which editors such as Continue look for in ``/api/show``). vLLM's ``/v1/completions`` has
no ``suffix``, so vllama builds the family's FIM prompt itself from ``library.toml``'s ``[fim.<style>]``
formats (template, tokens, stop). A served model's style is its library row's ``fim`` (none: no
``insert``, even where the tokenizer has the tokens) provided its tokenizer has the tokens, else the
first style (more tokens first) whose tokens its tokenizer has all of.
"""

from __future__ import annotations

from dataclasses import dataclass

from .library import Library
from .library_schema import Fim
from .model_files import ModelFiles


@dataclass(frozen=True)
class FimFormat:
    """A served model's FIM format.

    Attributes:
        style: the ``[fim.<style>]`` name.
        fim: the format (template, tokens, stop).
        stop_token_ids: ids of the stop tokens the tokenizer has (vLLM ``stop_token_ids``: a special
            token never shows in the detokenized text a ``stop`` string is matched against).
        stop: the stop texts the tokenizer does not know as tokens (vLLM ``stop`` strings).
    """

    style: str
    fim: Fim
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]

    def prompt(self, prefix: str, suffix: str) -> str:
        """See :meth:`Fim.prompt`."""
        return self.fim.prompt(prefix, suffix)


def fim_format(root: str, files: ModelFiles, library: Library) -> FimFormat | None:
    """The FIM format of the model loaded from ``root`` (a repo id or a path), or ``None``.

    See the module docstring for the rule. Pure: ``files`` were read before.
    """
    tokens = files.special_tokens
    entry = library.by_repo(root) if root.count("/") == 1 else None
    if entry is not None:
        if not entry.fim:
            return None
        fim = library.fim[entry.fim]
        if tokens and not all(t in tokens for t in fim.tokens):
            return None  # the table says so, but these files lack the tokens
        return _format(entry.fim, fim, tokens)
    if not tokens:
        return None
    for style, fim in sorted(library.fim.items(), key=lambda kv: -len(kv[1].tokens)):
        if all(t in tokens for t in fim.tokens):
            return _format(style, fim, tokens)
    return None


def _format(style: str, fim: Fim, tokens: dict[str, int]) -> FimFormat:
    ids = tuple(dict.fromkeys(tokens[s] for s in fim.stop if s in tokens))
    return FimFormat(style, fim, ids, tuple(s for s in fim.stop if s not in tokens))
