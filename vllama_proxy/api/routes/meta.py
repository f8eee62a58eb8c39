"""``/`` and ``/api/version``: what clients probe before anything else."""

from __future__ import annotations

from aiohttp import web

from vllama_proxy import __version__

#: The Ollama API level emulated. Clients parse it as numbers: VS Code Copilot
#: refuses < 0.6.4, Open WebUI compares ints (``shared/ollama-api.md`` "Routes").
#: 0.12.x is the level whose generate/chat/embed fields (think, tools, logprobs,
#: dimensions) vllama implements.
OLLAMA_API_VERSION = "0.12.0"


async def root(request: web.Request) -> web.Response:
    """200 ``Ollama is running`` (the Go CLI sends ``HEAD /`` before every command)."""
    return web.Response(text="Ollama is running")


async def version(request: web.Request) -> web.Response:
    """``{"version": "x.y.z", "vllama": "<our version>"}``."""
    return web.json_response({"version": OLLAMA_API_VERSION, "vllama": __version__})
