"""What a 404 says about a name the library table does not know: the closest known names, a
name's tags, and how to name a Hugging Face model instead (beside ``library.py``). The
words reach clients as Ollama's ``{"error": "model 'x' not found: ..."}``
(``ModelNotFound``), from :meth:`library.Library.resolve` and the catalog's 404.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from .library_schema import Model


def closest(name: str, names: Sequence[str], also: Sequence[str] = (), n: int = 3) -> list[str]:
    """The known names closest to ``name``, compared without tags: ``names`` are the library's
    (``qwen2.5``); ``also`` (the served names) are given whole and win over a library name of the
    same base (``qwen2.5:0.5b`` over ``qwen2.5``). At most ``n``, closest first (difflib, cutoff 0.6)."""
    base = name.partition(":")[0].casefold()
    pool = {c.casefold(): c for c in names}
    pool.update({c.partition(":")[0].casefold(): c for c in also})
    return [pool[c] for c in difflib.get_close_matches(base, list(pool), n=n, cutoff=0.6)]


def advice(name: str, names: Sequence[str], served: Sequence[str] = ()) -> str:
    """Why ``name`` is not a library name (the table holds ``names``), what is close, and how to
    name a Hugging Face model."""
    close = closest(name, names, served)
    hint = f"the closest known names are {', '.join(close)}; " if close else ""
    return (f"it is not a name in vllama's library ({len(names)} Ollama names, see docs/library.md); "
            f"{hint}a Hugging Face model is named by its id, org/name (e.g. Qwen/Qwen2.5-7B-Instruct)")


def tag_advice(row: Model) -> str:
    """The tags ``row`` knows, for a tag that is not one of them."""
    tags = ", ".join(t.tag for t in row.tag)
    return (f"vllama's library knows {row.name} with the tags {tags} and latest (= {row.default_tag}), "
            "each also with a quantization suffix such as -q4_K_M, -q8_0 or -fp16")
