"""Disk room for pulls: what a pull in progress holds of the Hugging Face cache's disk, shared by
every worker, so that concurrent pulls cannot all pass the same free-space check (60 pulls
at once all did) and at most ``--max-pulls`` run at once. ``models/hub.py`` pulls; this module only
answers whether the bytes are there and holds them while it does.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants

from vllama_proxy.errors import NotEnoughSpace, TooManyPulls


@dataclass(frozen=True)
class PullLimits:
    """What concurrent pulls may take (60 pulls at once all passed the free-space check).

    Attributes:
        folder: where each pull in progress leaves a reservation file (``<state_dir>/pulls``),
            shared by every worker; a file whose process is gone no longer counts.
        max_pulls: pulls at once over the server (``--max-pulls``); more get 429.
        cache_quota: most bytes the Hugging Face cache may hold after a pull (``--cache-quota``;
            ``None``: the disk's free space is the only bound).
    """

    folder: Path
    max_pulls: int = 2
    cache_quota: int | None = None


@contextmanager
def reserve(model: str, needed: int, limits: PullLimits | None) -> Iterator[None]:
    """Hold ``needed`` bytes of the cache's disk for the pull of ``model`` (its name, for messages) while it downloads.

    Under an ``flock`` shared by every worker: the live reservations (files in ``limits.folder``
    named by process id, holding their bytes) count as used; fewer than ``max_pulls`` may run;
    the disk's free space less what others reserved must hold ``needed``, and with a quota the
    cache's size plus every reservation plus ``needed`` must stay within it. Without ``limits``:
    the free-space check alone.

    Raises:
        TooManyPulls: ``max_pulls`` are running (429).
        NotEnoughSpace: not enough disk space or over the cache quota (507).
    """
    if limits is None:
        _check_free_space(model, needed)
        yield
        return
    import fcntl
    limits.folder.mkdir(parents=True, exist_ok=True)
    mine = limits.folder / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(limits.folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        others = _live_reservations(limits.folder)
        if len(others) >= limits.max_pulls:
            raise TooManyPulls(f"{len(others)} pulls are running, this server's most at once (--max-pulls); "
                               "retry when one has finished")
        reserved = sum(others.values())
        _check_free_space(model, needed + reserved, reserved)
        if limits.cache_quota is not None:
            from huggingface_hub import scan_cache_dir
            from huggingface_hub.errors import CacheNotFound
            try:
                used = scan_cache_dir().size_on_disk
            except CacheNotFound:
                used = 0
            if used + reserved + needed > limits.cache_quota:
                raise NotEnoughSpace(f"the model cache would exceed its quota: '{model}' needs {size_text(needed)}, the cache "
                                     f"holds {size_text(used)} and pulls in progress {size_text(reserved)} of {size_text(limits.cache_quota)} "
                                     "(--cache-quota); delete a model first")
        mine.write_text(str(needed))
    try:
        yield
    finally:
        mine.unlink(missing_ok=True)


def _live_reservations(folder: Path) -> dict[Path, int]:
    """The reservation files of pulls whose process is alive, and their bytes (stale ones removed)."""
    out: dict[Path, int] = {}
    for f in folder.iterdir():
        if f.name.startswith("."):
            continue
        pid = int(f.name.split("-", 1)[0]) if f.name.split("-", 1)[0].isdigit() else 0
        try:
            os.kill(pid, 0) if pid > 0 else None
            alive = pid > 0
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            f.unlink(missing_ok=True)
            continue
        try:
            out[f] = int(f.read_text() or 0)
        except (OSError, ValueError):
            out[f] = 0
    return out


def _check_free_space(model: str, needed: int, reserved: int = 0) -> None:
    """Refuse before downloading what the cache's disk cannot hold."""
    cache = Path(constants.HF_HUB_CACHE)
    where = cache
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed > free:
        held = f" ({size_text(reserved)} of them held for pulls in progress)" if reserved else ""
        raise NotEnoughSpace(
            f"not enough disk space in {cache}: '{model}' needs {size_text(needed - reserved)}, {size_text(free)} are free{held}"
        )


def size_text(n: int) -> str:
    """Bytes in decimal units, as Ollama prints sizes (``1.5 GB``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
