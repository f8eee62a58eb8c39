"""The input file of ``vllama batch``: its lines validated, scanned once, then handed out one by one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from .errors import BatchError

#: Accepted ``url`` values.
URLS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/chat", "/api/generate", "/api/embed"})

Key = tuple[str, str]  # ("c", custom_id) or ("i", "batch_req_<n>"): what marks an input line as answered




@dataclass(frozen=True)
class Item:
    """One non-blank input line.

    ``custom_id`` is ``None`` when the line has no usable one (or repeats an earlier
    line's); ``error`` is why the line is not sent (``None``: it is valid).
    """

    line: int  # 1-based line number in the input
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    error: str | None = None

    @property
    def id(self) -> str:
        """The output ``id``: ``batch_req_<line>``."""
        return f"batch_req_{self.line}"

    @property
    def key(self) -> Key:
        """What identifies this line's result in the output (see ``_result_key``)."""
        return ("c", self.custom_id) if self.custom_id is not None else ("i", self.id)


def parse_line(raw: bytes, line: int) -> Item:
    """Validate one input line (everything but ``custom_id`` uniqueness).

    Args:
        raw: the line's bytes, newline included or not.
        line: its 1-based number.

    Returns:
        An ``Item``; invalid lines have ``error`` set (never raises).
    """
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return Item(line, None, error=f"line {line}: invalid JSON: {e}")
    if not isinstance(obj, dict):
        return Item(line, None, error=f"line {line}: not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Item(line, None, error=f"line {line}: custom_id must be a non-empty string")
    url = obj.get("url")
    if url not in URLS:
        return Item(line, cid, error=f"line {line}: unsupported url {url!r}; use one of {', '.join(sorted(URLS))}")
    method = obj.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        return Item(line, cid, error=f"line {line}: method must be POST, not {method!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return Item(line, cid, error=f"line {line}: body must be a JSON object")
    return Item(line, cid, url, body)


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of the non-blank lines of ``path``."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


@dataclass
class InputScan:
    """First pass over the input: what a run has to do."""

    total: int  # non-blank lines
    duplicates: set[int]  # line numbers repeating an earlier line's custom_id
    keys: list[tuple[Key, bool]]  # per non-blank line, in order: its result key, whether it is sent


def scan_input(path: Path) -> InputScan:
    """Read the whole input once: count lines, find repeated ``custom_id`` values.

    Raises:
        BatchError: the input cannot be read.
    """
    seen: set[str] = set()
    dups: set[int] = set()
    keys: list[tuple[Key, bool]] = []
    try:
        for n, raw in _lines(path):
            item = parse_line(raw, n)
            if item.custom_id is not None:
                if item.custom_id in seen:
                    dups.add(n)
                    item = Item(n, None)
                else:
                    seen.add(item.custom_id)
            keys.append((item.key, item.error is None and n not in dups))
    except OSError as e:
        raise BatchError(f"cannot read {path}: {e.strerror or e}") from None
    return InputScan(len(keys), dups, keys)


def iter_items(path: Path, scan: InputScan, done: set[Key]) -> Iterator[Item]:
    """Second pass: the input lines still to answer (not in ``done``), parsed, in order."""
    for n, raw in _lines(path):
        if n in scan.duplicates:
            item = parse_line(raw, n)
            item = Item(n, None, error=f"line {n}: custom_id {item.custom_id!r} repeats an earlier line's")
        else:
            item = parse_line(raw, n)
        if item.key not in done:
            yield item

