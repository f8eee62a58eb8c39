"""Uploaded blobs (``/api/blobs/sha256:<hex>``): the files ``/api/create``'s ``files`` and ``adapters`` name.

Ollama's clients upload a model's or an adapter's files one by one (ollama-python
``create_blob``: ``POST /api/blobs/sha256:<hex>`` with the file as the body), then name them by
digest in ``/api/create``. They are kept in ``<state_dir>/blobs/sha256-<hex>`` (Ollama's own
file naming), written under a temporary name, checked against their digest and renamed, so a
blob that exists is always whole. Disk I/O runs in worker threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from vllama_proxy.errors import BadRequest, NotEnoughSpace, RequestTooLarge

_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
#: Bytes that must stay free on the disk after an upload.
DISK_RESERVE = 1024**3
#: Bytes gathered before one write (and hash update) in a worker thread.
_BATCH = 4 * 1024 * 1024


def parse_digest(digest: str) -> str:
    """The 64 hex characters of ``sha256:<hex>`` (or Ollama's file form ``sha256-<hex>``).

    Raises:
        BadRequest: any other form (Ollama: ``invalid digest format``).
    """
    m = _DIGEST.fullmatch(digest.strip())
    if m is None:
        raise BadRequest(f"invalid digest format: {digest[:80]!r} (expected sha256:<64 lowercase hex>)")
    return m.group(1)


class BlobStore:
    """``<state_dir>/blobs``.

    Args:
        root: the directory (made on the first upload).
        max_size: the largest blob accepted, bytes.
    """

    def __init__(self, root: Path, max_size: int) -> None:
        self.root = root
        self.max_size = max_size

    def path(self, digest: str) -> Path:
        """Where the blob of ``digest`` lives (whether or not it exists)."""
        return self.root / f"sha256-{parse_digest(digest)}"

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    async def write(self, digest: str, chunks: AsyncIterator[bytes], length: int | None) -> bool:
        """Store the body ``chunks`` as the blob ``digest``; ``False`` when it was there already.

        Raises:
            BadRequest: the body's sha256 is not ``digest`` (nothing is kept).
            RequestTooLarge: ``length`` or the bytes read exceed ``max_size``.
            NotEnoughSpace: less than ``length`` + 1 GiB free on the disk.
        """
        target = self.path(digest)
        if target.is_file():
            async for _ in chunks:  # the client sends it anyway: read it, keep nothing
                pass
            return False
        if length is not None and length > self.max_size:
            raise RequestTooLarge(f"blob of {length} bytes is over the limit of {self.max_size} (--max-blob-size)")
        await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)
        free = (await asyncio.to_thread(shutil.disk_usage, self.root)).free
        if (length or 0) + DISK_RESERVE > free:
            raise NotEnoughSpace(f"not enough disk space for the blob in {self.root}: {free} bytes free, "
                                 f"{length or 0} needed and {DISK_RESERVE} kept free")
        tmp = self.root / f".partial-{parse_digest(digest)}-{os.getpid()}-{id(chunks)}"
        h = hashlib.sha256()
        size = 0
        try:
            with await asyncio.to_thread(open, tmp, "wb") as f:
                batch: list[bytes] = []
                pending = 0
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_size:
                        raise RequestTooLarge(f"blob is over the limit of {self.max_size} bytes (--max-blob-size)")
                    batch.append(chunk)
                    pending += len(chunk)
                    if pending >= _BATCH:
                        await asyncio.to_thread(_write, f, h, b"".join(batch))
                        batch, pending = [], 0
                await asyncio.to_thread(_write, f, h, b"".join(batch))
                await asyncio.to_thread(os.fsync, f.fileno())
            if h.hexdigest() != parse_digest(digest):
                raise BadRequest(f"digest mismatch: the body's is sha256:{h.hexdigest()}, not {digest}")
            await asyncio.to_thread(os.replace, tmp, target)
        finally:
            await asyncio.to_thread(tmp.unlink, missing_ok=True)
        return True


def _write(f, h, data: bytes) -> None:  # noqa: ANN001 - a file and a hash object
    h.update(data)
    f.write(data)
