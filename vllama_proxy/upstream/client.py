"""The client of one vLLM server (or router) at one URL, on a process's shared :class:`~.pool.Pool`:
requests with vLLM's refusals and aiohttp's errors mapped at this boundary (``mapping.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from vllama_proxy import error_message
from vllama_proxy.errors import UpstreamRejected

from .body import BodyWatch, read_json, read_response
from .mapping import mapped_errors
from .pool import CONNECT_CONCURRENCY, Pool

_JSON = {"Content-Type": "application/json"}


class Upstream:
    """Client of one vLLM server at ``base_url`` (``http://127.0.0.1:8000``, no ``/v1``).

    Args:
        base_url: where vLLM listens.
        connect_timeout, read_timeout, api_key, connect_concurrency: the :class:`~.pool.Pool`'s it makes
            when none is given.
        pool: a pool shared with other clients (:meth:`at`); this client then neither starts nor closes it.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        api_key: str | None = None,
        connect_concurrency: int = CONNECT_CONCURRENCY,
        pool: Pool | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._owns_pool = pool is None
        self.pool = pool if pool is not None else Pool(connect_timeout=connect_timeout, read_timeout=read_timeout,
                                                       api_key=api_key, connect_concurrency=connect_concurrency)

    def at(self, base_url: str) -> Upstream:
        """A client of another server (another model's vLLM) on this one's pool: one pool per process,
        however many models (started and closed with this one)."""
        return Upstream(base_url, pool=self.pool)

    async def start(self) -> None:
        """Open the pool's sessions (call once, inside the running loop; a shared pool's owner does)."""
        if self._owns_pool:
            await self.pool.start()

    async def close(self) -> None:
        """Close the pool's sessions and every pooled connection (a shared pool's owner does)."""
        if self._owns_pool:
            await self.pool.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pool's requests' session."""
        return self.pool.session

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        check: bool = True,
        control: bool = False,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send one request and yield the open response (its body not read yet).

        Leaving the block early (client disconnect cancels the handler) closes the
        connection instead of returning it to the pool, which makes vLLM abort the request.
        Leaving it normally before the body's end (a reader that stopped at ``[DONE]``) pools
        the connection once the end arrives, without waiting for it here. ``control``: on the pool's
        few control connections (``pool.CONTROL_CONNECTIONS``), waiting for one while all are busy.

        Raises:
            UpstreamRejected: ``check`` and vLLM answered 4xx/5xx (its message and status).
            UpstreamUnavailable: connection refused, reset or closed.
            UpstreamTimeout: connect or idle-read timeout.
        """
        with mapped_errors(self.base_url):
            resp = await self.pool.send(method, self.base_url + path, control, data=body, headers=headers or _JSON, params=params)
            if check and resp.status >= 400:
                try:
                    raise UpstreamRejected(error_message(await resp.read(), f"vLLM answered HTTP {resp.status}"), resp.status)
                finally:
                    resp.release()
        # Errors raised by the caller's block (e.g. writing to a client that left) are
        # not upstream errors: they pass through unmapped.
        try:
            yield resp
        except BaseException:
            resp.close()  # drop the connection so vLLM sees the disconnect and aborts
            raise
        else:
            if resp.content.is_eof():
                resp.release()
            else:
                self.pool.release_at_end(resp)

    def watch_body(self, resp: aiohttp.ClientResponse) -> BodyWatch:
        """The idle-read timeout of ``resp``'s streamed body, kept by a :class:`~.body.BodyWatch`: use it
        as ``with upstream.watch_body(resp):`` around the loop that reads the body."""
        return BodyWatch(resp, self.pool.read_timeout)

    async def get_json(self, path: str) -> Any:
        """``GET path`` and decode the JSON answer (errors as :meth:`request`)."""
        async with self.request("GET", path) as resp:
            return await read_json(resp)

    async def answer(self, method: str, path: str, params: Mapping[str, str]) -> tuple[int, str]:
        """``(status, the answer's text)`` of ``method path?params``, whatever the status (a router's
        ``/add_worker``, ``/remove_worker``, ``/finish_session``: the caller reads its refusal), on the
        pool's control connections, so that a burst of them neither opens a connection each nor takes
        the requests'.

        Raises:
            UpstreamUnavailable, UpstreamTimeout: as :meth:`request`.
        """
        async with self.request(method, path, params=params, check=False, control=True) as resp:
            return resp.status, (await read_response(resp)).decode("utf-8", "replace")

    async def post_json(self, path: str, payload: Any) -> Any:
        """``POST path`` with a JSON body and decode the JSON answer (errors as :meth:`request`)."""
        async with self.request("POST", path, body=orjson.dumps(payload)) as resp:
            return await read_json(resp)
