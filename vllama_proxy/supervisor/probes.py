"""What the supervisor asks vLLM: ``/health``, ``/v1/models``, progress in ``/metrics``, and a request of its own.

A hung engine still answers ``/health`` 200 (``docs/wire.md`` "The upstream: what vLLM's server does"),
so liveness of generation is read from Prometheus metrics: requests running or
waiting while ``vllm:generation_tokens_total`` stands still makes the engine a suspect.
The gauges alone are no evidence (``docs/decisions.md``), so a suspect engine is asked
:func:`answers`, vllama's own smallest request, and only one that does not answer it is hung.
"""

from __future__ import annotations

import re

import orjson

from ..errors import UpstreamError
from ..upstream import Upstream, read_json, read_response
from .hang import Load

#: The prompt of :func:`answers`' request (one token of any vocabulary).
PROBE_PROMPT = "Hi"


async def health(upstream: Upstream) -> int | None:
    """``/health`` status code, or ``None`` when vLLM cannot be reached (still starting, or gone)."""
    try:
        async with upstream.request("GET", "/health", check=False) as resp:
            await read_response(resp)
            return resp.status
    except UpstreamError:
        return None


async def router_readiness(upstream: Upstream) -> dict | None:
    """``vllm-router``'s ``GET /readiness`` (``{"status": "ready"|"not_ready", "healthy_workers": n,
    "total_workers": m}``, 200 while some worker is healthy, else 503), or ``None`` when the
    upstream is no router (vLLM has no such route) or cannot be reached."""
    try:
        async with upstream.request("GET", "/readiness", check=False) as resp:
            data = await read_json(resp) if resp.status in (200, 503) else None
    except UpstreamError:
        return None
    return data if isinstance(data, dict) and "healthy_workers" in data else None


async def serves(upstream: Upstream, name: str) -> bool:
    """Whether ``/v1/models`` lists ``name``."""
    try:
        async with upstream.request("GET", "/v1/models") as resp:
            data = await read_json(resp)
    except UpstreamError:
        return False
    return any(isinstance(m, dict) and m.get("id") == name for m in data.get("data", []))


#: The three samples :func:`load` needs, one per line of the text exposition format (one per engine).
_LOAD_LINE = re.compile(rb"^vllm:(num_requests_running|num_requests_waiting|generation_tokens_total)(?:\{.*\})? +(\S+)", re.MULTILINE)


async def load(upstream: Upstream) -> Load | None:
    """Read :class:`Load` from vLLM's ``/metrics`` (``None`` if unreachable or unparsable).

    Only the three samples' lines are read (one regular expression over the text, in C): the
    supervisor runs in worker 0, which also serves requests, and prometheus_client's full parser
    stalled its event loop for every check (``docs/decisions.md``).
    """
    try:
        async with upstream.request("GET", "/metrics") as resp:
            data = await read_response(resp)
    except UpstreamError:
        return None
    pending = tokens = 0.0
    try:
        for m in _LOAD_LINE.finditer(data):
            if m.group(1) == b"generation_tokens_total":
                tokens += float(m.group(2))
            else:
                pending += float(m.group(2))
    except ValueError:
        return None
    return Load(pending, tokens)


async def answers(upstream: Upstream, name: str, *, pooling: bool) -> tuple[bool, str]:
    """``(whether vLLM's engine answered, what came back)`` for vllama's own smallest request: a 1-token
    completion (``/v1/completions``, ``max_tokens`` 1), or for a pooling model (``pooling``) an embedding of
    one word. Waits as long as it takes (the caller bounds it, cancelling it: the connection then closes and
    vLLM aborts the request). A 4xx answer counts as answered (the API server refused the request itself,
    nothing says the engine does not work); a 5xx, a broken connection or no connection do not.
    """
    if pooling:
        path, payload = "/v1/embeddings", {"model": name, "input": PROBE_PROMPT}
    else:
        path, payload = "/v1/completions", {"model": name, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
    try:
        async with upstream.request("POST", path, body=orjson.dumps(payload), check=False) as resp:
            await read_response(resp)
            status = resp.status
    except UpstreamError as e:
        return False, str(e)
    return status < 500, f"{path} answered HTTP {status}"
