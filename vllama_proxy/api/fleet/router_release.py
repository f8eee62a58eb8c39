"""One-request sessions released at the router (``--request-sessions``).

vllm-router's ``sticky_least_loaded`` places a new session key on the worker with the fewest live keys
and counts it until ``POST /finish_session?session_id=KEY`` (vllm-project/router 0.1.17,
``src/policies/sticky_least_loaded.rs``, ``src/server.rs``) or until it idles out. A request sent under
a key of its own (``affinity.placement``) is released here when it ends, however it ends, so the
router's count per worker is its requests in flight: join the shortest queue. Invariants: off the
per-token path (a task after the answer, on the upstream's kept-alive control connections,
``Upstream.answer``), bounded by :data:`RELEASE_TIMEOUT_S` and :data:`MAX_PENDING` per process (beyond,
or after :meth:`RouterRelease.close`, not sent); a failure never reaches the client (the key then
expires at the router), logged at warning once. Why the bounds: ``docs/decisions.md``.
"""

from __future__ import annotations

import asyncio

from vllama_proxy.errors import UpstreamError
from vllama_proxy.logs import get_logger
from vllama_proxy.upstream import Upstream

log = get_logger("vllama.fleet")

#: Seconds one release may take (connect included) before it is given up.
RELEASE_TIMEOUT_S = 5.0

#: Releases in flight per process at most; one more is not sent (its key expires at the router).
#: A router answers one in about a millisecond: this many pending means it is not answering.
MAX_PENDING = 1024


class RouterRelease:
    """Releases one-request session keys at the router, each in a task of its own.

    One per app (``app_state.ROUTER_RELEASE``); :meth:`close` waits for the releases in flight
    (at most :data:`RELEASE_TIMEOUT_S`) before the upstream session closes. ``released`` and
    ``failed`` count this process's releases that the router answered 2xx, and the others
    (unsent ones included: beyond ``limit`` in flight, or after :meth:`close`).

    Args:
        limit: releases in flight at most (:data:`MAX_PENDING`).
    """

    def __init__(self, limit: int = MAX_PENDING) -> None:
        self._pending: set[asyncio.Task[None]] = set()
        self._limit = limit
        self._closed = False
        self._warned = False
        self.released = 0
        self.failed = 0

    def release(self, upstream: Upstream, key: str) -> None:
        """Start ``POST /finish_session?session_id=key`` at ``upstream`` (the router); returns at once.
        Sends nothing (counted in ``failed``, logged) with :data:`MAX_PENDING` releases in flight or
        once :meth:`close` began: the upstream session is closing."""
        if self._closed or len(self._pending) >= self._limit:
            self._failure(upstream, "the upstream session is closed" if self._closed else
                          f"{len(self._pending)} releases already in flight: the router is not answering them")
            return
        task = asyncio.ensure_future(self._finish(upstream, key))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _finish(self, upstream: Upstream, key: str) -> None:
        try:
            status, text = await asyncio.wait_for(upstream.answer("POST", "/finish_session", {"session_id": key}),
                                                  RELEASE_TIMEOUT_S)
        except (UpstreamError, asyncio.TimeoutError) as e:
            self._failure(upstream, str(e) or type(e).__name__)
            return
        if status >= 400:
            self._failure(upstream, f"HTTP {status}: {text[:200]}")
            return
        self.released += 1

    def _failure(self, upstream: Upstream, error: str) -> None:
        self.failed += 1
        (log.debug if self._warned else log.warning)(
            "router_session_release_failed", router=upstream.base_url, error=error,
            effect="the router counts the request's key until it expires (VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S); "
                   "further failures are logged at debug",
        )
        self._warned = True

    async def close(self) -> None:
        """Let the releases in flight end (each bounded by its timeout); none is started after."""
        self._closed = True
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
