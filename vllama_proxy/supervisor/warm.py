"""What makes a model's next start fast: vLLM's compile cache kept, sleep instead of stop.

Where the home directory is not writable (systemd ``DynamicUser``, a read-only container) vllama points
``VLLM_CACHE_ROOT``, and ``TRITON_CACHE_DIR`` unless set, into its own state directory, so a second start of
the same model and arguments skips the compile. On-demand models and configured ones without ``sleep_mode``
run with ``--enable-sleep-mode`` on a GPU when free host RAM holds their weights with
``--sleep-host-memory-reserve`` to spare (:func:`with_sleep`). Pure deciders: when an idle model is stopped
instead of put to sleep (:func:`why_not_asleep`), when a sleeping one is stopped for real
(:func:`leave_sleep`); ``lifecycle.Supervisor`` acts on them, and sleeps and wakes such a model once before
it serves (``_warm_sleep``). Why, with numbers: ``docs/decisions.md`` "Sleep instead of stop, and one
warm-up sleep at start"; the cache: ``docs/configuration.md`` "vLLM's compile cache".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import psutil

from vllama_proxy.logs import get_logger
from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.models.model_files import read_model_files

from .room import Eviction, SleepOver, SlotWanted

log = get_logger("vllama.supervisor")

#: Where vllama keeps vLLM's cache when vLLM's default is not writable (under the state directory).
STATE_CACHE = "vllm-cache"


def _writable(d: Path) -> bool:
    """Whether ``d`` is (or could be made as) a directory this process can write."""
    for p in (d, *d.parents):
        if p.exists():
            return p.is_dir() and os.access(p, os.W_OK | os.X_OK)
    return False


def compile_cache(state_dir: Path, environ: Mapping[str, str] = os.environ) -> tuple[Path, str, dict[str, str]]:
    """Where vLLM keeps its compile cache for the models vllama launches.

    Args:
        state_dir: vllama's state directory (``--state-dir``).
        environ: the environment vLLM inherits.

    Returns:
        ``(directory, why, environment to add)``: ``VLLM_CACHE_ROOT`` when set (kept); else
        vLLM's own default (``$XDG_CACHE_HOME/vllm`` or ``$HOME/.cache/vllm``) when it is
        writable (nothing added); else ``<state_dir>/vllm-cache``, given to vLLM as
        ``VLLM_CACHE_ROOT``, with ``TRITON_CACHE_DIR=<state_dir>/vllm-cache/triton`` unless set.
    """
    given = environ.get("VLLM_CACHE_ROOT")
    if given:
        return Path(given).expanduser(), "VLLM_CACHE_ROOT", {}
    home = environ.get("HOME") or os.path.expanduser("~")
    default = Path(environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")) / "vllm"
    if _writable(default):
        return default, "vLLM's default (writable)", {}
    ours = state_dir / STATE_CACHE
    env = {"VLLM_CACHE_ROOT": str(ours)}
    if not environ.get("TRITON_CACHE_DIR"):
        env["TRITON_CACHE_DIR"] = str(ours / "triton")
    return ours, f"the state directory ({default} is not writable)", env


def log_compile_cache(state_dir: Path, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """:func:`compile_cache`, logged once (``compile_cache``); returns the environment to add."""
    path, why, env = compile_cache(state_dir, environ)
    log.info("compile_cache", path=str(path), source=why)
    return env


def sleep_choice(weights: int, available: int, reserve: int, gpus: int) -> tuple[bool, str]:
    """Whether an on-demand model should run with vLLM's sleep mode, and why (logged).

    Args:
        weights: bytes of the model's weight files (0: unknown).
        available: host RAM available now, bytes (``psutil.virtual_memory().available``).
        reserve: bytes that must stay free beyond the weights (``--sleep-host-memory-reserve``).
        gpus: GPUs NVML counts (0: vLLM runs without CUDA, where it has no sleep mode).
    """
    if gpus <= 0:
        return False, "no GPU counted (vLLM's sleep mode needs CUDA; vLLM on the CPU has none): it stops instead"
    gib = 1024**3
    if available < weights + reserve:
        return False, (f"host RAM available {available / gib:.1f} GiB < weights {weights / gib:.1f} GiB "
                       f"+ reserve {reserve / gib:.1f} GiB: it stops instead")
    return True, (f"host RAM available {available / gib:.1f} GiB holds the weights {weights / gib:.1f} GiB "
                  f"+ reserve {reserve / gib:.1f} GiB")


def with_sleep(spec: ModelConfig, *, enabled: bool, reserve: int, gpus: int, off: str = "--no-on-demand-sleep",
               event: str = "on_demand_sleep") -> ModelConfig:
    """``spec`` with ``sleep_mode`` on when :func:`sleep_choice` says so (logged as ``event``):
    on-demand models (``--on-demand-sleep``) and, with ``event="sleep_on_stop"``, the models
    configured with ``--model`` or ``[[models]]`` (``--sleep-on-stop``), so that ``vllama stop`` and
    keep_alive's end leave vLLM asleep, back in about a second. A spec that already sleeps or says
    ``sleep_mode = false``, or ``enabled`` false (the setting ``off`` names), is returned as it is.
    Reads the weights' size from disk."""
    if spec.sleeps:
        return spec
    if not enabled or spec.sleep_mode is False:
        log.info(event, model=spec.served_name, sleep=False, reason=off if not enabled else "sleep_mode = false")
        return spec
    weights = read_model_files(spec.model, spec.served_name).size
    on, why = sleep_choice(weights, psutil.virtual_memory().available, reserve, gpus)
    log.info(event, model=spec.served_name, sleep=on, reason=why)
    return spec.model_copy(update={"sleep_mode": True}) if on else spec


#: Why an idle model is stopped rather than put to sleep (:func:`why_not_asleep`).
NO_SLEEP_MODE = "vLLM runs without sleep mode"
SLEEP_FAILED = "its first sleep failed"
HOST_RAM_SHORT = "host RAM is short for its weights"


def why_not_asleep(sleep_mode: bool, sleep_failed: bool, weights: int | None, available: int | None, reserve: int) -> str | None:
    """Why an idle model is stopped rather than put to sleep, ``None`` when it may sleep: vLLM runs
    with sleep mode, its first sleep and wake did not fail (``lifecycle.Supervisor._warm_sleep``), and
    host RAM ``available`` (bytes) holds its ``weights`` (bytes; level 1 copies them to CPU memory)
    with ``reserve`` (``--sleep-host-memory-reserve``) to spare. ``weights``/``available`` are read
    only when the first two allow sleep (``None`` before)."""
    if not sleep_mode:
        return NO_SLEEP_MODE
    if sleep_failed:
        return SLEEP_FAILED
    if weights is None or available is None or available < weights + reserve:
        return HOST_RAM_SHORT
    return None


def leave_sleep(asked: Eviction | None, slot_wanted: bool, unload_after: float, slept: float) -> Eviction | None:
    """Why a sleeping model is stopped for real now, ``None`` while it sleeps on: an eviction ``asked``
    (a neighbour wants its room), its on-demand slot claimed for another model (``slot_wanted``), or
    asleep ``slept`` seconds of ``unload_after`` (``--sleep-unload-after``; negative: never)."""
    if asked is None and slot_wanted:
        asked = SlotWanted()
    if asked is None and 0 <= unload_after <= slept:
        asked = SleepOver(unload_after)
    return asked
