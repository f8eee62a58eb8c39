"""One request of ``vllama batch`` on its way: the server's URL, the preflight, the POST with its retries."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from vllama_proxy import error_message, ollama_host

from .errors import BatchError
from .items import Item
from .results import output_tokens, result_line

#: Generation endpoints: sent with ``"stream": false``.
_GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"})

#: Statuses worth another attempt (server busy / loading, rate limited).
_RETRY_STATUS = frozenset({429, 503})
BACKOFF_MAX = 60.0  # s, cap of one retry delay


def server_url(value: str | None) -> str:
    """An ``OLLAMA_HOST``-style value -> base URL without a trailing ``/``
    (:func:`vllama_proxy.ollama_host`: the port defaults to 11434, 443 for https; the host to 127.0.0.1).

    Raises:
        BatchError: the value is not a usable URL (bad port or scheme).
    """
    try:
        return ollama_host(value).url()
    except ValueError as e:
        raise BatchError(f"--host: {e}") from None


def _payload(item: Item) -> bytes:
    body = item.body or {}
    if item.url in _GENERATION:
        body = {k: v for k, v in body.items() if k != "stream_options"}
        body["stream"] = False
    return orjson.dumps(body)



def _retry_delay(attempt: int, backoff: float, retry_after: str | None) -> float:
    """Seconds before retry ``attempt`` (0-based): jittered exponential, at least ``Retry-After``."""
    delay = min(BACKOFF_MAX, backoff * 2**attempt) * random.uniform(0.5, 1.0)
    try:
        floor = float(retry_after) if retry_after else 0.0
    except ValueError:
        floor = 0.0  # an HTTP date: not worth parsing, the backoff applies
    return max(delay, min(BACKOFF_MAX, floor) * random.uniform(1.0, 1.2))


@dataclass
class Outcome:
    line: bytes
    ok: bool
    tokens: int
    retries: int


async def send(session: aiohttp.ClientSession, base: str, item: Item, *, retries: int, backoff: float) -> Outcome:
    """POST one valid item, retrying busy answers and connection failures; never raises
    (but ``CancelledError``): every outcome is a result line."""
    data = _payload(item)
    headers = {"Content-Type": "application/json", "X-Request-ID": item.id}
    attempt = 0
    while True:
        retry_after: str | None = None
        try:
            async with session.post(base + item.url, data=data, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError) as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError) and attempt < retries:
                await asyncio.sleep(_retry_delay(attempt, backoff, None))
                attempt += 1
                continue
            kind = "connection_error" if isinstance(e, aiohttp.ConnectionTimeoutError) else "timeout"
            msg = f"no answer: {e or type(e).__name__}" + (f" (after {attempt} retries)" if attempt else "")
            return Outcome(result_line(item, None, None, {"message": msg, "code": kind}), False, 0, attempt)
        except aiohttp.ClientError as e:  # refused, reset, disconnected, bad HTTP
            if attempt < retries:
                await asyncio.sleep(_retry_delay(attempt, backoff, None))
                attempt += 1
                continue
            msg = f"{type(e).__name__}: {e}" + (f" (after {attempt} retries)" if attempt else "")
            return Outcome(result_line(item, None, None, {"message": msg, "code": "connection_error"}), False, 0, attempt)
        if status in _RETRY_STATUS and attempt < retries:
            await asyncio.sleep(_retry_delay(attempt, backoff, retry_after))
            attempt += 1
            continue
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        if 200 <= status < 300:
            if isinstance(body, str):
                err = {"message": "the server's answer is not JSON", "code": "invalid_response"}
                return Outcome(result_line(item, status, body, err), False, 0, attempt)
            return Outcome(result_line(item, status, body, None), True, output_tokens(body), attempt)
        msg = error_message(raw, f"HTTP {status}") + (f" (after {attempt} retries)" if attempt and status in _RETRY_STATUS else "")
        return Outcome(result_line(item, status, body, {"message": msg, "code": "http_error"}), False, 0, attempt)


async def preflight(session: aiohttp.ClientSession, base: str) -> int | None:
    """Fail fast, before any result is written, when the server is unreachable or refuses the key.

    Returns:
        The server's ``max_running`` from ``GET /api/version`` (requests vLLM runs at once,
        vllama's field), or ``None`` when the answer has none (not vllama, or it does not know).

    Raises:
        BatchError: connection refused / timed out, or 401/403 on ``GET /api/version``.
    """
    try:
        async with session.get(base + "/api/version", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise BatchError(f"cannot reach the server at {base}: {e or type(e).__name__} (start `vllama serve`, or give --host)") from None
    if status in (401, 403):
        raise BatchError(f"{base} refused the request ({status}): {error_message(raw, f'HTTP {status}')} (give --api-key or OLLAMA_API_KEY)")
    try:
        running = orjson.loads(raw).get("max_running") if status == 200 else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return running if isinstance(running, int) and not isinstance(running, bool) and running > 0 else None
