"""The output file of ``vllama batch``: what is already answered (resume), and whole result lines appended."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from .errors import BatchError
from .items import Item, Key

SYNC_INTERVAL = 0.5  # s between fsyncs of the output while results arrive


def _result_key(obj: Any) -> Key | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("custom_id"), str):
        return ("c", obj["custom_id"])
    if isinstance(obj.get("id"), str):
        return ("i", obj["id"])
    return None


def _transient(obj: dict[str, Any]) -> bool:
    """A failed result worth sending again: no response, a 5xx or a 429."""
    err = obj.get("error")
    if not err or (isinstance(err, dict) and err.get("code") == "invalid_line"):
        return False
    resp = obj.get("response")
    status = resp.get("status_code") if isinstance(resp, dict) else None
    return not isinstance(status, int) or status >= 500 or status == 429


def scan_output(path: Path, *, retry_failed: bool = False, note: Callable[[str], None] = lambda s: None) -> set[Key]:
    """Keys of the results already in ``path``, after truncating a trailing partial line.

    With ``retry_failed`` the transient failures are removed from the file (rewritten
    through a temporary file and an atomic rename) and not returned, so they are sent again.

    Args:
        path: the output file; missing means nothing is done yet.
        retry_failed: drop transient failures (see ``_transient``).
        note: receives one human-readable line per repair made.

    Raises:
        BatchError: a complete line is not a JSON result, or the file cannot be read/written.
    """
    done: set[Key] = set()
    dropped = 0
    try:
        with path.open("r+b") as f:
            good_end = 0
            for n, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    break  # a partial last line: truncated below
                good_end += len(raw)
                if not raw.strip():
                    continue
                try:
                    obj = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    obj = None
                key = _result_key(obj)
                if key is None:
                    raise BatchError(f"{path}:{n} is not a result line; fix the file, or use --restart to start over")
                if retry_failed and _transient(obj):
                    dropped += 1
                else:
                    done.add(key)
            size = f.seek(0, os.SEEK_END)
            if size > good_end:
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
                note(f"dropped a partial last line of {size - good_end} bytes from {path}")
        if dropped:
            _rewrite_without_transient(path)
            note(f"{dropped} failed result(s) removed from {path}: they are sent again")
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise BatchError(f"cannot use {path}: {e.strerror or e}") from None
    return done


def _rewrite_without_transient(path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with path.open("rb") as src, tmp.open("wb") as dst:
        for raw in src:
            if raw.strip() and _transient(orjson.loads(raw)):
                continue
            dst.write(raw)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class ResultWriter:
    """Appends whole result lines to ``path`` and fsyncs at most every ``SYNC_INTERVAL`` s.

    Every line goes out in one ``os.write`` on an ``O_APPEND`` descriptor (no user-space
    buffer, nothing to flush), so a killed process leaves whole lines only; ``fsync``
    runs on its own thread so a slow disk does not stall the event loop.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._dirty = False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllama-batch-fsync")

    def write(self, line: bytes) -> None:
        """Append ``line`` (ending in ``\\n``). Raises ``OSError`` (disk full...)."""
        view = memoryview(line)
        while view:  # a regular file takes it in one call; loop only on a short write
            view = view[os.write(self._fd, view):]
        self._dirty = True

    async def sync_forever(self) -> None:
        """fsync every ``SYNC_INTERVAL`` s while there is something new (run as a task)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SYNC_INTERVAL)
            if self._dirty:
                self._dirty = False
                await loop.run_in_executor(self._pool, os.fsync, self._fd)

    def close(self) -> None:
        """Wait for a running fsync, sync what is left, close."""
        self._pool.shutdown(wait=True)
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)



def output_tokens(body: Any) -> int:
    """Generated tokens reported in a response body: ``usage.completion_tokens`` or ``eval_count`` (0 if none)."""
    if not isinstance(body, dict):
        return 0
    usage = body.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else body.get("eval_count")
    return n if isinstance(n, int) else 0


def result_line(item: Item, status: int | None, body: Any, error: dict[str, Any] | None) -> bytes:
    """One output line (bytes, ending in ``\\n``); ``status`` ``None`` means no response."""
    response = None if status is None else {"status_code": status, "body": body}
    return orjson.dumps({"id": item.id, "custom_id": item.custom_id, "response": response, "error": error}) + b"\n"
