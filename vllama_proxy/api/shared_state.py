"""Per-key counters shared by every front of a fleet (``--state-url redis://...``).

One front counts its keys' requests in shared memory (``admission.py``: every worker of the
process sees one count). Several fronts (a Kubernetes Deployment with ``replicas: 2``) would each
count their own, so a key would get its ``max_in_flight`` (and ``rpm``/``tpm``) once per front.
With ``--state-url`` each front also counts in Redis, the store LiteLLM's and the Gateway API
inference extension's users already run, and the limit holds across fronts.

:class:`KeyState` is the interface; :class:`RedisKeyState` is its one store-backed implementation.
Without ``--state-url`` nothing here runs: the single-host counts of ``admission.py`` (and the
per-minute windows of ``rate_limits.py``, issue 38) are the other implementation, unchanged.

Counts change at admission and at completion only, never per token: two round trips per request
(``enter`` is one Lua script, atomic in Redis; ``leave`` one ``HINCRBY``).

Data in Redis (``PREFIX`` ``vllama:``):

- ``vllama:holders``: a set of the live counting processes (one per worker of each front);
- ``vllama:inflight:<holder>``: a hash, key name -> that process's requests in flight, which
  expires ``HOLDER_TTL`` s after its process last refreshed it (every ``HOLDER_TTL / 3`` s): a
  front that dies gives its requests back within ``HOLDER_TTL`` s;
- ``vllama:rpm:<key>:<minute>``, ``vllama:tpm:<key>:<minute>``: requests and tokens of a key in a
  wall-clock minute (the fixed window of ``rate_limits.py`` and LiteLLM), expiring after 2 minutes.

A store that cannot be reached leaves each front with its own limits (logged, once a minute):
a Redis outage must not turn every request away.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Protocol

from vllama_proxy.logs import get_logger

log = get_logger("vllama.shared_state")

PREFIX = "vllama:"
#: Seconds a dead process's in-flight counts outlive it.
HOLDER_TTL = 30
#: Seconds in a rate window (``rate_limits.WINDOW``).
WINDOW = 60

# KEYS: holders set, this holder's hash. ARGV: key name, max ('' for none), ttl, holder id, prefix.
# Returns the key's requests in flight over every live holder before this one, or -1 (at its max).
_ENTER = """
local total = 0
for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local hk = ARGV[5] .. 'inflight:' .. h
  if redis.call('EXISTS', hk) == 1 then
    total = total + tonumber(redis.call('HGET', hk, ARGV[1]) or '0')
  else
    redis.call('SREM', KEYS[1], h)
  end
end
if ARGV[2] ~= '' and total >= tonumber(ARGV[2]) then return -1 end
redis.call('SADD', KEYS[1], ARGV[4])
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
return total
"""

# KEYS: the key's rpm and tpm counters of this minute. ARGV: rpm, tpm ('' for none), ttl.
# Returns {refused ('' | 'rpm' | 'tpm'), requests counted (this one included when admitted), tokens spent}.
_RATE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local spent = tonumber(redis.call('GET', KEYS[2]) or '0')
if ARGV[1] ~= '' and used >= tonumber(ARGV[1]) then return {'rpm', used, spent} end
if ARGV[2] ~= '' and spent >= tonumber(ARGV[2]) then return {'tpm', used, spent} end
used = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return {'', used, spent}
"""


class KeyState(Protocol):
    """Per-key counters every front sees.

    ``enter``/``leave`` bracket a request (``key``: the key's name, as in the keys file); ``rate``
    counts a request against the key's minute and ``spend`` its tokens at its end. Units: requests,
    tokens (prompt + output), seconds.
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def enter(self, key: str, max_in_flight: int | None) -> int | None:
        """Count one more request of ``key`` unless it has ``max_in_flight`` over every front.
        Returns its requests in flight before this one, or ``None`` when refused."""

    async def leave(self, key: str) -> None:
        """That request (counted by ``enter``) ended."""

    async def rate(self, key: str, rpm: int | None, tpm: int | None) -> tuple[str | None, int, int, float]:
        """Count one request of ``key`` in this minute unless it reached ``rpm`` or spent ``tpm``.
        Returns ``(refused, requests, tokens, reset)``: ``refused`` ``None``, ``"rpm"`` or ``"tpm"``;
        the minute's requests and tokens so far; seconds to the next minute."""

    async def spend(self, key: str, tokens: int) -> None:
        """Count ``tokens`` of a request of ``key`` that ended."""


class RedisKeyState:
    """:class:`KeyState` in Redis (``redis.asyncio``, the optional extra ``vllama-proxy[redis]``).

    Args:
        url: ``redis://[:password@]host:port/db``, ``rediss://`` (TLS) or ``unix://``.
        holder_ttl: seconds a dead process's counts outlive it (tests shorten it).

    Raises:
        RuntimeError: (on construction) the ``redis`` package is not installed.
    """

    def __init__(self, url: str, holder_ttl: int = HOLDER_TTL, clock: Any = time.time) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError:
            raise RuntimeError("--state-url needs the redis package: pip install 'vllama-proxy[redis]'") from None
        self._redis = aioredis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)
        self.url = url
        self.holder = uuid.uuid4().hex
        self._ttl = holder_ttl
        self._holders = PREFIX + "holders"
        self._mine = f"{PREFIX}inflight:{self.holder}"
        self._enter = self._redis.register_script(_ENTER)
        self._rate = self._redis.register_script(_RATE)
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._warned = 0.0

    async def start(self) -> None:
        """Keep this process's counts alive (every ``holder_ttl / 3`` s) until :meth:`close`."""
        self._task = asyncio.create_task(self._heartbeat(), name="shared-state-heartbeat")

    async def close(self) -> None:
        """Stop the heartbeat and give back whatever this process still counts."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self._redis.delete(self._mine)
            await self._redis.srem(self._holders, self.holder)
        except Exception as e:  # noqa: BLE001 - closing: the TTL gives them back anyway
            self._unreachable(e)
        await self._redis.aclose()

    async def _heartbeat(self) -> None:
        while True:
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    await pipe.sadd(self._holders, self.holder).expire(self._mine, self._ttl).execute()
            except Exception as e:  # noqa: BLE001 - the next beat tries again
                self._unreachable(e)
            await asyncio.sleep(self._ttl / 3)

    async def enter(self, key: str, max_in_flight: int | None) -> int | None:
        try:
            got = await self._enter(keys=[self._holders, self._mine],
                                    args=[key, "" if max_in_flight is None else max_in_flight, self._ttl, self.holder, PREFIX])
        except Exception as e:  # noqa: BLE001 - no store: this front's own limits only
            self._unreachable(e)
            return 0
        return None if int(got) < 0 else int(got)

    async def leave(self, key: str) -> None:
        try:
            await self._redis.hincrby(self._mine, key, -1)
        except Exception as e:  # noqa: BLE001
            self._unreachable(e)

    async def rate(self, key: str, rpm: int | None, tpm: int | None) -> tuple[str | None, int, int, float]:
        now = self._clock()
        minute = int(now // WINDOW)
        reset = max(WINDOW - now % WINDOW, 0.001)
        if rpm is None and tpm is None:
            return None, 0, 0, reset
        try:
            refused, used, spent = await self._rate(
                keys=[f"{PREFIX}rpm:{key}:{minute}", f"{PREFIX}tpm:{key}:{minute}"],
                args=["" if rpm is None else rpm, "" if tpm is None else tpm, 2 * WINDOW])
        except Exception as e:  # noqa: BLE001
            self._unreachable(e)
            return None, 0, 0, reset
        what = refused.decode() if isinstance(refused, bytes) else str(refused)
        return what or None, int(used), int(spent), reset

    async def spend(self, key: str, tokens: int) -> None:
        if tokens <= 0:
            return
        name = f"{PREFIX}tpm:{key}:{int(self._clock() // WINDOW)}"
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                await pipe.incrby(name, tokens).expire(name, 2 * WINDOW).execute()
        except Exception as e:  # noqa: BLE001
            self._unreachable(e)

    def _unreachable(self, e: Exception) -> None:
        now = time.monotonic()
        if now - self._warned >= 60:
            self._warned = now
            log.warning("state_store_unreachable", url=_redacted(self.url), error=repr(e),
                        effect="each front applies its own per-key limits until it answers")


def _redacted(url: str) -> str:
    """``url`` without its password."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
