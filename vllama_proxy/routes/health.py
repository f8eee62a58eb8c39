"""``/livez`` and ``/readyz`` for systemd, containers and Kubernetes probes.

``/livez`` is 200 while the process serves HTTP. ``/readyz`` is 200 only when vLLM
is healthy and serving the model; otherwise 503 with JSON naming the state, since
when, and the last error (supervised), or the upstream's health (``--upstream``).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from ..state import STATUS, UPSTREAM
from ..supervisor import probes


async def livez(request: web.Request) -> web.Response:
    """Always 200 while the event loop answers."""
    return web.json_response({"status": "alive"})


async def readyz(request: web.Request) -> web.Response:
    """200 when requests can be served now, else 503; JSON body either way."""
    status = request.app.get(STATUS)
    if status is not None:
        body = status.status()
        ready = status.available  # sleeping/unloaded still serves: the next request loads it
    else:
        code = await probes.health(request.app[UPSTREAM])
        ready = code == 200
        body = {"state": "ready" if ready else "unavailable", "upstream_health": code}
    return web.Response(status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json")
