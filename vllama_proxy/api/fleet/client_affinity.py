"""A client's own router key (its ``X-Session-ID``), scoped to its caller and bounded in flight.

Before a router (``--upstream`` and a ``--session-header``), the front sends each request under a key
of its own (``affinity.py``); a client may send its own value of that header or of ``X-User-ID``
(vllm-router's next: ``src/policies/hash_key.rs``) to keep its requests on one engine. Invariants: the
value is **scoped to its caller** and hashed (:func:`~vllama_proxy.api.fleet.affinity.client_key`; the
caller is the API key's name, ``-`` on an open server), so the router never sees a client's string and
no caller can name another's key; and it is **bounded**: beyond :data:`IN_FLIGHT` requests per
(caller, value) in flight here, one more is placed as if it had sent none. A node and
``--session-header ''`` pass the header as it came. O(1) per request, no lock (one dict per process,
on the event loop). Why: ``docs/decisions.md``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager

from aiohttp import web

from vllama_proxy.logs import get_logger

from . import affinity
from ..policy.keys import key_of

log = get_logger("vllama.fleet")

#: Requests in flight under one client key (per caller and value) at one front process; the next
#: ones are placed as if no key had been sent. vLLM runs up to 256 requests at once per engine by
#: default (``--max-num-seqs``), and ``sticky_least_loaded`` counts a key as one session however many
#: requests it carries: 8 keeps the router's count of an engine within 7 of its requests (3 % of an
#: engine) per client key, while an agent's session, which fans out a handful of parallel requests
#: (tool calls, sub-agents), keeps all of them on its engine. With ``--workers N`` each process counts
#: its own (a client's requests over one connection reach one process).
IN_FLIGHT = 8

#: The headers vllm-router reads a key from, in its order (``src/policies/hash_key.rs``).
ROUTER_HEADERS = ("X-Session-ID", "X-User-ID")


class ClientAffinity:
    """Client keys in flight at this process, per scoped key (one per app: ``app_state.CLIENT_AFFINITY``).

    Args:
        header: ``--session-header`` (``""``: nothing sent, the client's headers forwarded as they came).
        scoped: whether a router may read the key (the front has ``--upstream``): scope, hash and bound
            a client's value; else (a node) its value of ``header`` is kept as it came.
        limit: requests in flight per client key (:data:`IN_FLIGHT`).

    Attributes:
        beyond: requests this process placed as if their client had sent no key (the bound reached).
    """

    def __init__(self, header: str, scoped: bool, limit: int = IN_FLIGHT) -> None:
        self.header = header
        self.scoped = scoped and bool(header)
        self.limit = limit
        self.beyond = 0
        self._names = tuple(dict.fromkeys((header, *ROUTER_HEADERS))) if header else ()
        self._in_flight: dict[str, int] = {}

    @contextmanager
    def hold(self, caller: str, headers: Mapping[str, str]) -> Iterator[str | None]:
        """The client's key to send under ``header`` while the request is in flight (the ``with`` block).

        Scoped: ``affinity.client_key(caller, value)`` of the client's value of ``header`` (else of
        ``X-User-ID``), counted until the block ends; ``None`` when it sent none, or with ``limit``
        requests already in flight under that key. Not scoped: its value of ``header`` as it came, or
        ``None``. ``caller``: the API key's name (``api_keys.key_of(request).name``).
        """
        if not self.scoped:
            yield (headers.get(self.header) or None) if self.header else None
            return
        value = next((v for h in self._names if (v := headers.get(h))), None)
        if value is None:
            yield None
            return
        key = affinity.client_key(caller, value)
        n = self._in_flight.get(key, 0)
        if n >= self.limit:
            self.beyond += 1
            (log.debug if self.beyond > 1 else log.info)(
                "client_session_bounded", caller=caller, limit=self.limit,
                effect="this request and the next ones beyond the bound are placed as if the client had sent no "
                       "session key; logged once per process, then at debug",
            )
            yield None
            return
        self._in_flight[key] = n + 1
        try:
            yield key
        finally:  # others under the key may have come and gone meanwhile: the count now, less one
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]

    def hold_request(self, request: web.Request) -> AbstractContextManager[str | None]:
        """:meth:`hold` for ``request``: its caller is its API key's name (``api/policy/keys.py``'s ``key_of``), as fair
        sharing, rate limits and the usage ledger name it; its headers are the client's."""
        return self.hold(key_of(request).name, request.headers)

    def in_flight(self, key: str) -> int:
        """Requests in flight under the client key ``key`` at this process."""
        return self._in_flight.get(key, 0)
