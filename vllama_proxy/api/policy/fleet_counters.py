"""Per-key counters shared by every front of a fleet (``--state-url redis://...``).

Without it each front counts alone (``admission.py``, ``rate_limits.py``, ``fair_queue.py``), so a key
gets its limits once per front. With it :class:`RedisKeyState` also counts in Redis, one Lua script at
admission (:meth:`KeyState.admit`: the minute, then the requests in flight) and one at the end
(:meth:`KeyState.finish`: place back, tokens, VTC service, the other fronts' service read), never per
token. Keys under ``PREFIX``: ``holders``, ``inflight:<holder>`` (``HOLDER_TTL`` after the last
heartbeat), ``rpm|tpm:<key>:<minute>``, ``served:<key>`` (``SERVED_TTL``), ``budget_holders`` /
``budget:<holder>`` (``budgets.py``'s reservations). Invariant: an unreachable store fails open to the
front's own counts (kept all along), is asked again after ``RETRY_AFTER_FAILURE`` s, and gets back a
place given back meanwhile. Behaviour and numbers: ``docs/fleet.md`` "Limits that hold across fronts".
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, NamedTuple, Protocol

from vllama_proxy.logs import get_logger

from ..metrics import STATE_STORE_ERRORS

log = get_logger("vllama.fleet_counters")

PREFIX = "vllama:"
#: Seconds a dead process's in-flight counts outlive it.
HOLDER_TTL = 30
#: Seconds in a rate window (``rate_limits.WINDOW``).
WINDOW = 60
#: Seconds a key's service counts are kept after its last request on any front.
SERVED_TTL = 600
#: Seconds to connect to and to wait for the store.
TIMEOUT = 2.0
#: Seconds the store is left alone after a call to it failed (each front on its own limits meanwhile).
RETRY_AFTER_FAILURE = 5.0

# KEYS: the key's rpm and tpm counters of this minute, the holders set, this holder's hash.
# ARGV: key name, rpm, tpm ('' for none), rate ttl, max ('' for none), holder ttl, holder id, prefix,
# rate ('1': count the request in the minute), count ('1': count it in flight), reserve (tokens reserved in the
# minute for an admitted request of a key with tpm: its worst case, settled by _FINISH).
# Returns {refused ('' | 'rpm' | 'tpm' | 'max_in_flight'), requests this minute (this one included
# when counted), tokens this minute, the key's requests in flight over every live holder before it}.
_ADMIT = """
local used, spent = 0, 0
if ARGV[9] ~= '' then
  used = tonumber(redis.call('GET', KEYS[1]) or '0')
  spent = tonumber(redis.call('GET', KEYS[2]) or '0')
  if ARGV[2] ~= '' and used >= tonumber(ARGV[2]) then return {'rpm', used, spent, 0} end
  if ARGV[3] ~= '' and spent >= tonumber(ARGV[3]) then return {'tpm', used, spent, 0} end
  used = redis.call('INCR', KEYS[1])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
  if ARGV[3] ~= '' and tonumber(ARGV[11]) > 0 then
    redis.call('INCRBY', KEYS[2], ARGV[11])
    redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
  end
end
if ARGV[10] == '' then return {'', used, spent, 0} end
local total = 0
for _, h in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local hk = ARGV[8] .. 'inflight:' .. h
  if redis.call('EXISTS', hk) == 1 then
    total = total + tonumber(redis.call('HGET', hk, ARGV[1]) or '0')
  else
    redis.call('SREM', KEYS[3], h)
  end
end
if ARGV[5] ~= '' and total >= tonumber(ARGV[5]) then return {'max_in_flight', used, spent, total} end
redis.call('SADD', KEYS[3], ARGV[7])
redis.call('HINCRBY', KEYS[4], ARGV[1], 1)
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[6]))
return {'', used, spent, total}
"""

# KEYS: this holder's in-flight hash, the key's tpm counter of this minute, the key's served hash.
# ARGV: key name, places to give back, tokens (a reservation's settling may be negative), tpm ttl, service,
# front ('' for none), served ttl.
# Returns the served hash (front, service, ...) when a front is given, else {}.
_FINISH = """
local back = tonumber(ARGV[2])
if back > 0 then
  if redis.call('HINCRBY', KEYS[1], ARGV[1], -back) <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
end
if tonumber(ARGV[3]) ~= 0 then
  if redis.call('INCRBY', KEYS[2], ARGV[3]) < 0 then redis.call('SET', KEYS[2], 0) end
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
end
if ARGV[6] == '' then return {} end
redis.call('HINCRBYFLOAT', KEYS[3], ARGV[6], ARGV[5])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[7]))
return redis.call('HGETALL', KEYS[3])
"""

# KEYS: the set of processes holding budget reservations, this process's hash of them.
# ARGV: key name, tokens (negative: given back), holder ttl, holder id, prefix.
# Returns the tokens every live holder had reserved for the key before this change.
_RESERVE = """
local total = 0
for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local hk = ARGV[5] .. 'budget:' .. h
  if redis.call('EXISTS', hk) == 1 then
    total = total + tonumber(redis.call('HGET', hk, ARGV[1]) or '0')
  else
    redis.call('SREM', KEYS[1], h)
  end
end
if redis.call('HINCRBY', KEYS[2], ARGV[1], ARGV[2]) <= 0 then redis.call('HDEL', KEYS[2], ARGV[1]) end
redis.call('SADD', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
return total
"""


class Admission(NamedTuple):
    """A request of a key over every front, as :meth:`KeyState.admit` counted it."""

    refused: str | None  # None, "rpm", "tpm" or "max_in_flight"
    used: int  # requests this minute (this one included unless refused for rpm or tpm)
    spent: int  # tokens this minute
    reset: float  # seconds to the next minute
    before: int  # the key's requests in flight over every front before this one (when counted)


class KeyState(Protocol):
    """Per-key counters every front sees (``key``: the key's name, as in the keys file).

    ``admit`` and ``finish`` bracket a request. Units: requests, tokens (prompt + output), seconds,
    and the fair queue's service (VTC cost / weight). Every method answers ``None`` when the store
    does not: the caller then applies this front's own limits.
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def admit(self, key: str, rpm: int | None, tpm: int | None, max_in_flight: int | None,
                    count: bool, reserve: int = 0) -> Admission | None:
        """Count one request of ``key`` in this minute, unless it reached ``rpm`` or spent ``tpm``
        (both ``None``: not counted there), and reserve its ``reserve`` tokens in the minute (with ``tpm``);
        then, with ``count``, count it in flight, unless it has ``max_in_flight`` over every front. One round
        trip, atomic in the store. ``None`` when the store did not answer (nothing counted there)."""

    async def finish(self, key: str, *, leave: bool = False, tokens: int = 0, served: float | None = None,
                     reserved: int = 0, minute: int | None = None) -> float | None:
        """A request of ``key`` ended: give back its place (``leave``: ``admit`` counted it), replace the
        ``reserved`` tokens it reserved in ``minute`` with the ``tokens`` it used (in a later minute they count
        there) and, with ``served``, add its service to this front's share of the key's.

        Returns the key's service on every other front (``served`` given and the store answered), else ``None``.
        """

    async def reserve_budget(self, key: str, tokens: int) -> int | None:
        """Reserve ``tokens`` of ``key``'s budget (negative: give them back); returns what every front's requests
        in flight had reserved before, ``None`` when the store did not answer (nothing reserved there)."""


def redis_client() -> Any:
    """``redis.asyncio``, the client ``--state-url`` needs.

    Raises:
        RuntimeError: the redis package is not installed (the line ``vllama serve`` prints).
    """
    try:
        import redis.asyncio as aioredis
    except ImportError:
        raise RuntimeError("--state-url needs the redis package: pip install 'vllama-proxy[redis]'") from None
    return aioredis


class RedisKeyState:
    """:class:`KeyState` in Redis (``redis.asyncio``, the optional extra ``vllama-proxy[redis]``).

    Args:
        url: ``redis://[:password@]host:port/db``, ``rediss://`` (TLS) or ``unix://``.
        front: this front's name in the store, the same in each of its workers
            (``AdmissionBound.front``): its service to a key is told apart from the other fronts'.
        holder_ttl: seconds a dead process's counts outlive it (tests shorten it).
        clock: seconds since the epoch, for the minute (tests pass their own).

    Raises:
        RuntimeError: (on construction) the ``redis`` package is not installed.
    """

    def __init__(self, url: str, front: str = "", holder_ttl: int = HOLDER_TTL, clock: Any = time.time) -> None:
        self._redis = redis_client().from_url(url, socket_connect_timeout=TIMEOUT, socket_timeout=TIMEOUT)
        self.url = url
        self.front = front or uuid.uuid4().hex
        self.holder = uuid.uuid4().hex
        self._ttl = holder_ttl
        self._holders = PREFIX + "holders"
        self._mine = f"{PREFIX}inflight:{self.holder}"
        self._budget_holders = PREFIX + "budget_holders"
        self._budgets = f"{PREFIX}budget:{self.holder}"
        self._reserve = self._redis.register_script(_RESERVE)
        self._admit = self._redis.register_script(_ADMIT)
        self._finish = self._redis.register_script(_FINISH)
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._warned = float("-inf")
        self._down_until = 0.0
        self._owed: dict[str, int] = {}  # places counted in the store, given back while it was down
        self._owed_budget: dict[str, int] = {}  # budget reservations given back while it was down

    async def start(self) -> None:
        """Keep this process's counts alive (every ``holder_ttl / 3`` s) until :meth:`close`."""
        self._task = asyncio.create_task(self._heartbeat(), name="shared-state-heartbeat")

    async def close(self) -> None:
        """Stop the heartbeat and give back whatever this process still counts."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self._redis.delete(self._mine, self._budgets)
            await self._redis.srem(self._holders, self.holder)
            await self._redis.srem(self._budget_holders, self.holder)
        except Exception as e:  # noqa: BLE001 - closing: the TTL gives them back anyway
            self._unreachable(e)
        await self._redis.aclose()

    async def _heartbeat(self) -> None:
        while True:
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    await pipe.sadd(self._holders, self.holder).expire(self._mine, self._ttl).expire(self._budgets, self._ttl).execute()
                for key, n in list(self._owed.items()):  # places given back while the store was down
                    await self._finish(keys=[self._mine, "-", "-"], args=[key, n, 0, 0, 0, "", 0])
                    self._owed.pop(key, None)
                for key, n in list(self._owed_budget.items()):
                    await self._reserve(keys=[self._budget_holders, self._budgets], args=[key, -n, self._ttl, self.holder, PREFIX])
                    self._owed_budget.pop(key, None)
            except Exception as e:  # noqa: BLE001 - the next beat tries again
                self._unreachable(e)
            await asyncio.sleep(self._ttl / 3)

    def _up(self) -> bool:
        if time.monotonic() < self._down_until:
            STATE_STORE_ERRORS.inc()
            return False
        return True

    async def admit(self, key: str, rpm: int | None, tpm: int | None, max_in_flight: int | None,
                    count: bool, reserve: int = 0) -> Admission | None:
        now = self._clock()
        reset = max(WINDOW - now % WINDOW, 0.001)
        rate = rpm is not None or tpm is not None
        if not rate and not count:
            return Admission(None, 0, 0, reset, 0)
        if not self._up():
            return None
        minute = int(now // WINDOW)
        try:
            refused, used, spent, before = await self._admit(
                keys=[f"{PREFIX}rpm:{key}:{minute}", f"{PREFIX}tpm:{key}:{minute}", self._holders, self._mine],
                args=[key, _arg(rpm), _arg(tpm), 2 * WINDOW, _arg(max_in_flight), self._ttl, self.holder, PREFIX,
                      "1" if rate else "", "1" if count else "", max(int(reserve), 0)])
        except Exception as e:  # noqa: BLE001 - no store: this front's own limits
            self._unreachable(e)
            return None
        what = refused.decode() if isinstance(refused, bytes) else str(refused)
        return Admission(what or None, int(used), int(spent), reset, int(before))

    async def finish(self, key: str, *, leave: bool = False, tokens: int = 0, served: float | None = None,
                     reserved: int = 0, minute: int | None = None) -> float | None:
        now_minute = int(self._clock() // WINDOW)
        tokens = max(tokens, 0)
        if reserved and (minute is None or minute == now_minute):
            tokens -= reserved  # the reservation becomes the use (it went with its minute otherwise)
        if not leave and not tokens and served is None:
            return None
        if not self._up():
            if leave:
                self._owed[key] = self._owed.get(key, 0) + 1
            return None
        tpm = f"{PREFIX}tpm:{key}:{now_minute}"
        try:
            got = await self._finish(keys=[self._mine, tpm, f"{PREFIX}served:{key}"],
                                     args=[key, int(leave), tokens, 2 * WINDOW, repr(float(served or 0.0)),
                                           "" if served is None else self.front, SERVED_TTL])
        except Exception as e:  # noqa: BLE001 - given back by the heartbeat once the store answers
            self._unreachable(e)
            if leave:
                self._owed[key] = self._owed.get(key, 0) + 1
            return None
        if served is None:
            return None
        pairs = iter(got)
        return sum(float(v) for f, v in zip(pairs, pairs) if (f.decode() if isinstance(f, bytes) else f) != self.front)

    async def reserve_budget(self, key: str, tokens: int) -> int | None:
        if not tokens:
            return None
        if not self._up():
            if tokens < 0:
                self._owed_budget[key] = self._owed_budget.get(key, 0) - tokens
            return None
        try:
            before = await self._reserve(keys=[self._budget_holders, self._budgets],
                                         args=[key, int(tokens), self._ttl, self.holder, PREFIX])
        except Exception as e:  # noqa: BLE001 - no store: this front's own reservations; given back by the heartbeat
            self._unreachable(e)
            if tokens < 0:
                self._owed_budget[key] = self._owed_budget.get(key, 0) - tokens
            return None
        return int(before)

    def _unreachable(self, e: Exception) -> None:
        STATE_STORE_ERRORS.inc()
        now = time.monotonic()
        self._down_until = now + RETRY_AFTER_FAILURE
        if now - self._warned >= 60:
            self._warned = now
            log.warning("state_store_unreachable", url=_redacted(self.url), error=repr(e),
                        effect="each front applies its own per-key limits (in flight, rpm/tpm, fair share) until it answers; "
                        f"asked again in {RETRY_AFTER_FAILURE:g} s")


def _arg(limit: int | None) -> int | str:
    return "" if limit is None else limit


def _redacted(url: str) -> str:
    """``url`` without its password."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
