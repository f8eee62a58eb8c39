"""``/`` and ``/api/version``: what clients probe before anything else."""

from __future__ import annotations

from aiohttp import web

from vllama_proxy import __version__
from ..app_keys import MAX_RUNNING

#: The Ollama API level emulated. Clients parse it as numbers: VS Code Copilot
#: refuses < 0.6.4, Open WebUI compares ints (``shared/ollama-api.md`` "Routes").
#: 0.12.x is the level whose generate/chat/embed fields (think, tools, logprobs,
#: dimensions) vllama implements.
OLLAMA_API_VERSION = "0.12.0"


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
