"""What the supervisor asks vLLM: ``/health``, ``/v1/models``, and progress in ``/metrics``.

A hung engine still answers ``/health`` 200 (``shared/ollama-api.md`` "vLLM side"),
so liveness of generation is read from Prometheus metrics: requests running or
waiting while ``vllm:generation_tokens_total`` stands still means the engine is stuck.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from ..errors import UpstreamError
from ..upstream import Upstream, read_json, read_response


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


@dataclass(frozen=True)
class Load:
    """Engine load from ``/metrics``: requests running + waiting, generated tokens so far."""

    pending: float
    generation_tokens: float


async def load(upstream: Upstream) -> Load | None:
    """Read :class:`Load` from vLLM's ``/metrics`` (``None`` if unreachable or unparsable)."""
    try:
        async with upstream.request("GET", "/metrics") as resp:
            text = (await read_response(resp)).decode("utf-8", "replace")
    except UpstreamError:
        return None
    pending = tokens = 0.0
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                    pending += s.value
                elif s.name == "vllm:generation_tokens_total":
                    tokens += s.value
    except ValueError:
        return None
    return Load(pending, tokens)
