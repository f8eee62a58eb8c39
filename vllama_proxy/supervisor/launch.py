"""What ``vllm serve`` is launched with: its command line and its environment, built in one place
(these were steps of ``lifecycle.py``, which owns the child's life, not its launch).

The model's own flags come from its launch spec (``models/launch_spec.py``: ``ModelConfig.args``);
this module adds what vllama decides around them: loopback on a private port, the served name,
media fetching limited, the LoRA plan of created adapters and its mode (``models/adapters.py``:
launch-declared with vLLM's API servers kept, or loaded at run time with one), and the
environment (GPU numbering, vLLM's compile cache, its sleep routes, runtime LoRA loading).
"""

from __future__ import annotations

import os

from vllama_proxy.models.adapters import AdapterMode, LoraPlan, adapter_mode
from vllama_proxy.models.launch_spec import ModelConfig, has_flag
from ..settings import Settings
from .child import find_executable
from .warm import compile_cache


#: A host that can never resolve (RFC 6761 ``.invalid``): vLLM's domain allow-list with only
#: this in it lets no media URL through.
NO_MEDIA_DOMAIN = "media-fetching-is-off.invalid"


def media_args(allowed: list[str], vllm_args: list[str]) -> list[str]:
    """vLLM flags limiting which hosts it fetches media URLs from (``/v1/*`` requests can name
    ``image_url``s; vLLM's ``MediaConnector`` fetches them server-side, a request-forgery hole
    on a shared server). ``allowed`` empty: none (the allow-list holds one unresolvable host);
    ``["*"]``: any (no flag, vLLM's default). Left to the user's own ``--allowed-media-domains``
    after ``--`` when given. Local files stay off as in vLLM (no ``--allowed-local-media-path``).
    Redirects are turned off in :func:`vllm_env`."""
    if "*" in allowed or has_flag(vllm_args, "--allowed-media-domains"):
        return []
    return ["--allowed-media-domains", *(allowed or [NO_MEDIA_DOMAIN])]


def lora_mode(settings: Settings, spec: ModelConfig) -> AdapterMode:
    """How created adapters reach ``spec``'s vLLM (``--adapters``; ``auto`` decides from the API
    servers it runs: :func:`~vllama_proxy.models.adapters.adapter_mode`)."""
    return adapter_mode(settings.adapters, spec.args())


def vllm_argv(settings: Settings, spec: ModelConfig, port: int, lora: LoraPlan) -> list[str]:
    """``vllm serve``'s command line (no shell): vLLM bound to loopback on the private ``port``, media
    fetching limited (:func:`media_args`); with LoRA adapters or a draft of created models, their arguments
    (``LoraPlan.args``: ``--speculative-config`` for a ``DRAFT``), and with adapters
    in ``runtime`` mode (:func:`lora_mode`) one API server (vLLM refuses runtime adapter loading with
    several); in ``launch`` mode the API servers stay as chosen."""
    args = spec.args()
    lora_args = lora.args()
    if lora.modules and lora_mode(settings, spec).mode == "runtime":
        args = [a for i, a in enumerate(args) if a != "--api-server-count" and (i == 0 or args[i - 1] != "--api-server-count")
                and not a.startswith("--api-server-count=")] + ["--api-server-count", "1"]
    return [
        find_executable(settings.vllm_executable) or settings.vllm_executable, "serve", spec.model,
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", spec.served_name,
        *media_args(settings.allowed_media_domains, args),
        *args,
        *lora_args,
    ]


#: ``VLLM_MAX_STOP_STRINGS`` for every vLLM vllama launches: the bound vllama checks itself on every route
#: (``api/ollama/types.py``'s ``MAX_STOPS``, the same number; a test holds them equal).
MAX_STOP_STRINGS = 64


def vllm_env(settings: Settings, spec: ModelConfig, *, sleep_mode: bool, lora: LoraPlan) -> dict[str, str]:
    """``vllm serve``'s environment: this process's, the model's own (``ModelConfig.env``), and what
    vllama sets around them (each line says why)."""
    # nvidia-smi's GPU numbering for every child (the pool counts GPUs by it), unless set
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **os.environ, **spec.env()}
    # an allowed media host must not redirect vLLM to one that is not (vLLM follows redirects by default)
    env.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    # as many stop strings as vllama lets through (it refuses more, before anything is loaded): vLLM 0.32
    # refuses a fifth with its own validation error, where Ollama takes any number and its clients send
    # five or more (a FIM template's, a Modelfile's PARAMETER stop lines)
    env.setdefault("VLLM_MAX_STOP_STRINGS", str(MAX_STOP_STRINGS))
    # vllama's own metrics directory (--workers) is not vLLM's: with several API servers vLLM
    # makes its own, and given ours it would mix its series into vllama's /metrics and back.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    # vLLM's compile cache where it survives a restart (the state directory when home is read-only)
    env.update(compile_cache(settings.state_dir, env)[2])
    if sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM serves /sleep and /wake_up only then (on loopback)
    if lora.modules and lora_mode(settings, spec).mode == "runtime":
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # adapters created later load without a restart
    return env
