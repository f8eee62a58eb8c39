"""NVIDIA GPU facts through NVML (nvidia-ml-py): preflight, memory of a process tree, release.

All calls block (they go to the driver): the supervisor runs them in worker threads.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import psutil
import pynvml


class GpuUnavailable(RuntimeError):
    """No NVIDIA GPU or driver: the one-line message says how to proxy a remote vLLM instead."""


@dataclass(frozen=True)
class GpuProcess:
    gpu: int | str
    pid: int
    name: str
    used_bytes: int


def _init() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise GpuUnavailable(
            f"no NVIDIA GPU or driver found (NVML: {e}); to proxy a vLLM server running elsewhere, "
            "use: vllama serve --upstream http://HOST:PORT"
        ) from None


def preflight(gpu_memory_utilization: float, needed: Mapping[str, Collection[int]] | None = None,
              gpus: Sequence[int | str] | None = None) -> list[str]:
    """Check that GPUs exist and have room for vLLM's share of memory.

    Args:
        gpu_memory_utilization: vLLM's ``--gpu-memory-utilization`` (fraction of each GPU).
        needed: model name -> the GPU indices its config names (``gpus``), checked to exist.
        gpus: the GPUs whose memory is checked, as NVML indices or UUIDs (``sizing.served_gpus``:
            the models' own, e.g. the one ``CUDA_VISIBLE_DEVICES`` gives a fleet's node); ``None``:
            every GPU NVML sees. A node of a fleet warned of its neighbours' vLLMs otherwise.

    Returns:
        Warnings, one per GPU whose memory already in use leaves less than that share,
        naming the processes holding it.

    Raises:
        GpuUnavailable: NVML cannot start, sees no GPU, or not a GPU a model names.
    """
    _init()
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            raise GpuUnavailable("NVML sees no NVIDIA GPU; to proxy a vLLM server running elsewhere, use: vllama serve --upstream http://HOST:PORT")
        for name, ids in (needed or {}).items():
            missing = sorted(i for i in ids if i >= count)
            if missing:
                raise GpuUnavailable(f"model '{name}' names GPU {', '.join(map(str, missing))}, but NVML sees {count} GPU(s): 0-{count - 1}")
        warnings = []
        for i in (range(count) if gpus is None else gpus):
            h = _handle(i)
            if h is None:  # a UUID NVML does not know (a MIG instance's old form): vLLM will say
                continue
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            free_share = mem.free / mem.total if mem.total else 0.0
            if free_share < gpu_memory_utilization:
                try:
                    found = _processes(i, h)
                except pynvml.NVMLError:  # a MIG instance's handle (a UUID) may not list them: a warning, not a failed start
                    found = []
                procs = ", ".join(f"{p.name}[{p.pid}] {p.used_bytes / 2**30:.1f} GiB" for p in found) or "unknown processes"
                warnings.append(
                    f"GPU {i}: {mem.used / 2**30:.1f} of {mem.total / 2**30:.1f} GiB already in use by {procs}; "
                    f"vLLM asks for {gpu_memory_utilization:.0%} and may fail to start"
                )
        return warnings
    finally:
        pynvml.nvmlShutdown()


def _processes(index: int | str, handle) -> list[GpuProcess]:
    out = []
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        try:
            name = psutil.Process(p.pid).name()
        except psutil.Error:
            name = "?"
        out.append(GpuProcess(index, p.pid, name, int(p.usedGpuMemory or 0)))
    return out


def processes() -> list[GpuProcess]:
    """Every compute process on every GPU (empty if NVML is unavailable)."""
    try:
        _init()
    except GpuUnavailable:
        return []
    try:
        return [p for i in range(pynvml.nvmlDeviceGetCount()) for p in _processes(i, pynvml.nvmlDeviceGetHandleByIndex(i))]
    finally:
        pynvml.nvmlShutdown()


def memory_of(pids: Collection[int]) -> int:
    """Bytes of GPU memory held by the processes ``pids`` (0 without NVML)."""
    return sum(p.used_bytes for p in processes() if p.pid in pids)


def wait_released(pids: Collection[int], timeout: float, interval: float = 0.5) -> bool:
    """Block until no process of ``pids`` holds GPU memory; False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if not any(p.pid in pids for p in processes()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def count() -> int:
    """How many GPUs NVML sees (0 without NVML)."""
    try:
        _init()
    except GpuUnavailable:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def _handle(g: int | str):
    """NVML's handle of a GPU given as an NVML index (nvidia-smi order) or a UUID; None if NVML has none."""
    try:
        return pynvml.nvmlDeviceGetHandleByIndex(g) if isinstance(g, int) else pynvml.nvmlDeviceGetHandleByUUID(g)
    except pynvml.NVMLError:
        return None


def memory(gpus: Collection[int | str]) -> dict[int | str, tuple[int, int]] | None:
    """``{gpu: (free bytes, total bytes)}`` of the GPUs ``gpus`` (NVML indices, nvidia-smi order, or
    UUIDs as in ``CUDA_VISIBLE_DEVICES``: ``sizing.model_gpus``) that NVML sees, or ``None`` without
    NVML: the fit check's numbers (``models/fit.py``)."""
    try:
        _init()
    except GpuUnavailable:
        return None
    try:
        out = {}
        for g in gpus:
            h = _handle(g)
            if h is not None:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                out[g] = (int(mem.free), int(mem.total))
        return out
    finally:
        pynvml.nvmlShutdown()


def smallest(gpus: Collection[int | str]) -> tuple[int, str] | None:
    """``(total bytes, name)`` of the GPU with the least memory among ``gpus`` (NVML indices,
    nvidia-smi order, or UUIDs: ``sizing.served_gpus``), or ``None`` without NVML: what vLLM's
    defaults that depend on the GPU see."""
    try:
        _init()
    except GpuUnavailable:
        return None
    try:
        found = []
        for i in gpus:
            h = _handle(i)
            if h is not None:
                name = pynvml.nvmlDeviceGetName(h)
                found.append((int(pynvml.nvmlDeviceGetMemoryInfo(h).total), name.decode() if isinstance(name, bytes) else name))
        return min(found) if found else None
    finally:
        pynvml.nvmlShutdown()


def host_numbers(gpus: Sequence[int | str]) -> list[int | None]:
    """Host-wide numbers of GPUs (the N of ``/dev/nvidiaN``, NVML's minor number), for GPUs given
    as NVML indices (nvidia-smi order) or UUIDs (``GPU-…``, as in ``CUDA_VISIBLE_DEVICES``).

    Inside a container that sees one GPU as index 0 the minor number is still the host's, so
    instances on one host that each drive their own GPUs get different numbers without talking
    to each other. ``None`` for a GPU NVML cannot name (no driver, a MIG instance, a bad id).
    """
    try:
        _init()
    except GpuUnavailable:
        return [None] * len(gpus)
    try:
        out: list[int | None] = []
        for g in gpus:
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(g) if isinstance(g, int) else pynvml.nvmlDeviceGetHandleByUUID(g)
                out.append(int(pynvml.nvmlDeviceGetMinorNumber(h)))
            except pynvml.NVMLError:
                out.append(None)
        return out
    finally:
        pynvml.nvmlShutdown()
