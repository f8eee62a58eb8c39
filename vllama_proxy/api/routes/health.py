"""``/livez`` and ``/readyz`` for systemd, containers and Kubernetes probes.

``/livez`` is 200 while the process serves HTTP. ``/readyz`` is 200 only when every
model can serve (ready, or asleep/unloaded and loaded on demand) and the server is not
draining (``{"state": "draining"}``, 503); otherwise 503 with
JSON naming the state, since when, and the last error (supervised), or the
upstream's health (``--upstream``). ``/health`` is vLLM's shape of the same answer (200 or 503,
empty body), so that a node can stand where ``vllm-router`` expects a vLLM (``docs/fleet.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from aiohttp import web

from vllama_proxy.supervisor import probes
from ..policy.keys import KEY
from ..app_state import CATALOG, DRAINING, FRONT_END, KEYS


async def livez(request: web.Request) -> web.Response:
    """Always 200 while the event loop answers."""
    return web.json_response({"status": "alive"})


async def health(request: web.Request) -> web.Response:
    """vLLM's ``/health``: 200 (empty) when :func:`readyz` would be 200, else 503.

    ``vllm-router`` checks each worker's ``/health`` before ``/add_worker`` adds it and then
    every ``--health-check-interval-secs`` (its ``--health-check-endpoint`` does not apply to
    the first check), so a vllama node answers it as a vLLM would.
    """
    ready, _ = await _readiness(request)
    return web.Response(status=200 if ready else 503)


async def readyz(request: web.Request) -> web.Response:
    """200 when requests can be served now, else 503; JSON body either way.

    One model: its status (``state``, ``since``, ``restarts``, ``last_error``...). Several:
    ``{"state": "ready"|"unavailable", "models": [status, ...]}``, 503 until every model is
    past its first start, then 200 whenever some model is ready, asleep, unloaded or loading
    for a request. A model restarting or failed shows in the body only. ``front_end`` says
    how many processes vllama and each vLLM serve with, and why (``supervisor/sizing.py``).
    When API keys are configured, a caller without a valid key gets ``{"state"}`` only, and a
    key of another role than ``admin`` the models its patterns allow, without vLLM's pids, its output
    lines or the front end's plan (:func:`_for_tenant`): one tenant learns nothing of another's models.
    """
    ready, body = await _readiness(request)
    key = request.get(KEY)
    if not request.app[KEYS].configured or (key is not None and key.admin):
        body["front_end"] = request.app[FRONT_END].as_dict()
    elif key is None:
        body = {"state": "ready" if ready else "unavailable"}  # models, PIDs, errors: for key holders only
    else:
        body = _for_tenant(body, key.may_use)
    return web.Response(status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json")


#: What of a model's status (``StatusBoard.status``) only the operator sees: the process, vLLM's own output.
_OPERATORS = ("pid", "last_output")


def _for_tenant(body: dict, may_use: Callable[[str], bool]) -> dict:
    """``body`` as a key of role ``user`` sees it: the models it may use (``may_use`` of the served
    name), each without :data:`_OPERATORS`; of one model it may not use, the state alone."""
    if "models" in body:
        return {**body, "models": [{k: v for k, v in m.items() if k not in _OPERATORS}
                                   for m in body["models"] if may_use(m["model"])]}
    if "model" in body:
        return ({k: v for k, v in body.items() if k not in _OPERATORS} if may_use(body["model"])
                else {"state": body["state"]})
    return body


async def _readiness(request: web.Request) -> tuple[bool, dict]:
    if request.app[DRAINING]():  # stopping: out of every load balancer's and router's rotation
        return False, {"state": "draining"}
    catalog = request.app[CATALOG]
    boards = [b.board for b in catalog.backends if b.board is not None]
    on_demand = catalog.on_demand
    held = [b.board for b in on_demand.backends if b.board is not None and b.board.served_name] if on_demand else []
    if len(boards) == 1 and not held:
        body = boards[0].status()
        ready = boards[0].available  # sleeping/unloaded still serves: the next request loads it
    elif boards or held:
        # Ready once every model is past its first start (as systemd's READY=1), then whenever
        # some model can serve: one model restarting or failed must not take the others out
        # of a load balancer; it is reported in the body. On-demand models count once they are
        # wanted (a server with none configured is ready to start them).
        ready = all(b.settled for b in boards) and (not boards or any(b.available or b.loading for b in boards))
        body = {"state": "ready" if ready else "unavailable", "models": [b.status() for b in boards + held]}
    elif on_demand is not None:  # no model configured: local models start when requests name them
        ready, body = True, {"state": "ready", "models": []}
    else:
        upstream = catalog.backends[0].upstream
        code = await probes.health(upstream)
        ready = code == 200
        body = {"state": "ready" if ready else "unavailable", "upstream_health": code}
        if code == 503:
            # vllm-router answers /health 503 when any one worker fails; its /readiness says
            # whether some worker is healthy, which is all a stateless front needs to serve
            router = await probes.router_readiness(upstream)
            if router is not None:
                ready = bool(router.get("healthy_workers"))
                body = {"state": "ready" if ready else "unavailable", "upstream_health": code, "router": router}
    return ready, body
