"""Stand-in ``pynvml`` for tests: GPUs whose memory the test chooses, no driver needed.

Put this directory first on ``PYTHONPATH`` of a ``vllama serve`` process (or insert it into
``sys.path``) and set ``FAKE_NVML_GPUS`` to ``TOTAL_GIB:FREE_GIB`` per GPU, comma-separated
(``80:18.3,80:80``). Without the variable NVML is "not found", as on a machine with no driver.
GPU ``i``'s UUID is ``GPU-fake-i`` (as ``CUDA_VISIBLE_DEVICES`` may name it).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

GiB = 1 << 30


class NVMLError(Exception):
    pass


def _gpus() -> list[tuple[int, int]]:
    spec = os.environ.get("FAKE_NVML_GPUS", "")
    out = []
    for item in filter(None, spec.split(",")):
        total, free = (float(x) for x in item.split(":"))
        out.append((int(total * GiB), int(free * GiB)))
    return out


def nvmlInit() -> None:
    if not os.environ.get("FAKE_NVML_GPUS"):
        raise NVMLError("Driver Not Loaded (fake)")


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    if not 0 <= i < len(_gpus()):
        raise NVMLError("Invalid Argument")
    return i


def nvmlDeviceGetHandleByUUID(uuid: str) -> int:
    prefix = "GPU-fake-"
    if uuid.startswith(prefix) and uuid[len(prefix):].isdigit() and int(uuid[len(prefix):]) < len(_gpus()):
        return int(uuid[len(prefix):])
    raise NVMLError("Not Found")


def nvmlDeviceGetMemoryInfo(h: int) -> SimpleNamespace:
    total, free = _gpus()[h]
    return SimpleNamespace(total=total, free=free, used=total - free)


def nvmlDeviceGetName(h: int) -> str:
    return "Fake GPU"


def nvmlDeviceGetComputeRunningProcesses(h: int) -> list:
    return []


def nvmlDeviceGetMinorNumber(h: int) -> int:
    return h
