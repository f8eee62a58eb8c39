"""``/``, ``/api/version`` and ``/api/status``: what clients probe before anything else."""

from __future__ import annotations

from aiohttp import web

from vllama_proxy import __version__
from vllama_proxy.models.modelfile_v033 import OLLAMA_API_LEVEL
from ..app_state import MAX_RUNNING

#: The Ollama API level emulated (``models/modelfile_v033.py``, where ``REQUIRES`` is checked against it).
#: Clients parse it as numbers: VS Code Copilot refuses < 0.6.4, Open WebUI compares ints
#: (``docs/wire.md`` "Routes"); docs/api.md "Contract" says what of 0.33 is served and what differs.
OLLAMA_API_VERSION = OLLAMA_API_LEVEL


async def root(request: web.Request) -> web.Response:
    """200 ``Ollama is running`` (the Go CLI sends ``HEAD /`` before every command)."""
    return web.Response(text="Ollama is running")


async def version(request: web.Request) -> web.Response:
    """``{"version": "x.y.z", "vllama": "<our version>", "max_running": N}``.

    ``max_running`` (vllama's own field; Ollama clients ignore it) is how many requests vLLM
    runs at once over all models: each model's ``--max-num-seqs`` (vLLM's GPU-dependent default
    when not given) x its data-parallel size, or ``--max-running``. It is absent when vllama
    does not know it (``--upstream`` without ``--max-running`` or ``--max-num-seqs``).
    ``vllama batch`` keeps that many requests (and a quarter more) in flight by default.
    """
    body: dict[str, object] = {"version": OLLAMA_API_VERSION, "vllama": __version__}
    running = request.app.get(MAX_RUNNING)
    if running:
        body["max_running"] = running
    return web.json_response(body)


async def status(request: web.Request) -> web.Response:
    """``GET /api/status`` (Ollama 0.16.2): ``{"cloud": {"disabled": true, "source": "vllama"}}``.

    Ollama answers whether its cloud models (``name:cloud``, run on ollama.com) are available and
    what decided it (``server/routes.go`` StatusHandler: ``api.StatusResponse{Cloud: CloudStatus{Disabled,
    Source}}``); a client such as ``ollama launch`` reads it before offering cloud models. vllama
    serves no Ollama cloud: always disabled, by vllama.
    """
    return web.json_response({"cloud": {"disabled": True, "source": "vllama"}})
