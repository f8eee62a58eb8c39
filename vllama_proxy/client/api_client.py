"""The blocking HTTP client of the Ollama API that the client commands use.

The server is ``--host`` or ``OLLAMA_HOST`` (default ``http://127.0.0.1:11434``; a bare host
gets port 11434, the scheme is optional: :func:`vllama_proxy.ollama_host`), and
``OLLAMA_API_KEY`` is sent as a bearer token, so the commands work against Ollama itself too.
Plain stdlib ``http.client``: every command is a few blocking requests, and Ctrl-C during an
answer simply closes the socket (the server then aborts the generation in vLLM).
"""

from __future__ import annotations

import contextlib
import http.client
import os
from collections.abc import Iterator
from typing import Any, BinaryIO

import orjson

from vllama_proxy import __version__, error_message, ollama_host


class ConnectError(Exception):
    """The server could not be reached at all."""


class ApiError(Exception):
    """The server answered ``{"error": message}`` (``status`` 0: inside a 200 stream);
    ``retry_after``: its ``Retry-After`` header, sent with a 503 that retrying will cure
    (a model loading, a busy server), absent when it will not (a model that failed to load)."""

    def __init__(self, message: str, status: int = 0, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Client:
    """Blocking Ollama API client: one connection per request.

    Args:
        host: an ``OLLAMA_HOST``-style value (None: the ``OLLAMA_HOST`` variable).
        connect_timeout: seconds to connect; once connected, reads wait as long as it takes.

    Raises:
        ValueError: ``host`` is not usable (a bad port, a scheme other than http/https).
    """

    def __init__(self, host: str | None = None, connect_timeout: float = 10.0) -> None:
        where = ollama_host(host if host is not None else os.environ.get("OLLAMA_HOST", ""))
        self.url = where.url()
        self.https = where.scheme == "https"
        self.host, self.port, self.prefix = where.host, where.port, where.path
        self.connect_timeout = connect_timeout
        self.headers = {"User-Agent": f"vllama/{__version__}", "Accept": "application/json, application/x-ndjson"}
        if key := os.environ.get("OLLAMA_API_KEY"):
            self.headers["Authorization"] = f"Bearer {key}"

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.connect_timeout)

    def _open(self, method: str, path: str, body: Any = None, *, data: BinaryIO | None = None,
              headers: dict[str, str] | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connection()
        conn.blocksize = 1 << 20  # a file body (a blob) is sent in 1 MiB reads
        try:
            conn.connect()
        except OSError as e:
            raise ConnectError(self.url) from e
        conn.sock.settimeout(None)  # generation may be slow to start; Ctrl-C is the way out
        headers = {**self.headers, **(headers or {})}
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, self.prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        if not 200 <= resp.status < 300:
            raw = resp.read()
            conn.close()
            raise ApiError(error_message(raw, f"{resp.status} {resp.reason}"), resp.status, resp.getheader("Retry-After"))
        return conn, resp

    def json(self, method: str, path: str, body: Any = None) -> Any:
        """``method path`` with JSON ``body``; the decoded answer. A streamed answer (NDJSON: what
        Ollama's create, pull and generate send unless ``stream: false``) is read line by line to
        its end and its last object returned, as Ollama's Go client reads one (``api/client.go``
        ``stream``): ``/save`` read /api/create's progress lines as one document.

        Raises:
            ConnectError: the server could not be reached.
            ApiError: a non-2xx answer (its error text, status and ``Retry-After``), or an
                ``{"error"}`` line inside a streamed one (status 0).
        """
        conn, resp = self._open(method, path, body)
        try:
            if _is_ndjson(resp):
                last: Any = {}
                for event in _events(resp):
                    last = event
                return last
            return orjson.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def has_blob(self, digest: str) -> bool:
        """Whether the server holds blob ``digest`` (``sha256:<hex>``): ``HEAD /api/blobs/<digest>``.

        Raises:
            ConnectError, ApiError: as :meth:`json` (a 404 is False, not an error).
        """
        try:
            conn, _ = self._open("HEAD", f"/api/blobs/{digest}")
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        conn.close()
        return True

    def create_blob(self, digest: str, data: BinaryIO, size: int) -> None:
        """Upload ``size`` bytes read from ``data`` as blob ``digest``: ``POST /api/blobs/<digest>``,
        as Ollama's ``Client.CreateBlob`` (the server checks the digest: a 400 on a mismatch).

        Raises:
            ConnectError, ApiError: as :meth:`json` (413 too large, 507 no room on the server's disk).
        """
        conn, resp = self._open("POST", f"/api/blobs/{digest}", data=data,
                                headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"})
        try:
            resp.read()
        finally:
            conn.close()

    def probe(self, path: str) -> dict[str, Any]:
        """GET ``path`` and return its JSON object whatever the status (``/readyz`` says why in a
        503); ``{}`` when the body is no JSON object."""
        conn = self._connection()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            raw = conn.getresponse().read()
        finally:
            conn.close()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return {}
        return body if isinstance(body, dict) else {}

    @contextlib.contextmanager
    def stream(self, path: str, body: Any) -> Iterator[Iterator[dict[str, Any]]]:
        """POST ``body`` and yield an iterator over the NDJSON objects; closing the block closes the socket.

        Raises:
            ApiError: also for an ``{"error"}`` line inside the stream (status 0).
        """
        conn, resp = self._open("POST", path, body)
        try:
            yield _events(resp)
        finally:
            resp.close()
            conn.close()


def _is_ndjson(resp: http.client.HTTPResponse) -> bool:
    return (resp.getheader("Content-Type") or "").split(";")[0].strip().lower() == "application/x-ndjson"


def _events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The NDJSON objects of ``resp``, one per non-empty line, as they arrive.

    Raises:
        ApiError: an ``{"error"}`` line (status 0: the stream had begun with a 200).
    """
    for line in resp:
        if line.strip():
            event = orjson.loads(line)
            if isinstance(event, dict) and event.get("error"):
                raise ApiError(str(event["error"]))
            yield event
