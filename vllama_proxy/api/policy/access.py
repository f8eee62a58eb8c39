"""Who may talk to the proxy: CORS, the Host-header guard, API keys.

All three follow Ollama (``docs/wire.md`` "Serving environment"; ``server/routes.go``
``allowedHostsMiddleware`` and its gin CORS config). **CORS**: Ollama's default origins (localhost,
``app://``, ``file://``, ``tauri://``, ``vscode-webview://``...) plus ``OLLAMA_ORIGINS`` (``*``
wildcards, in the port too, which ``aiohttp-cors`` does not match); preflights answered here, another
origin 403. **Host guard** (DNS rebinding): bound to loopback, a Host that is not loopback, private,
this machine's, ``localhost``, ``*.localhost``, ``*.local``, ``*.internal`` or the hostname is 403.
**API keys** are ``api/policy/keys.py``'s (``Authorization: Bearer``); ``/``, ``/livez`` and
``/readyz`` stay open for probes.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable

import psutil
from aiohttp import web

from vllama_proxy.errors import Forbidden

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

DEFAULT_ORIGINS = (
    "http://localhost", "https://localhost", "http://localhost:*", "https://localhost:*",
    "http://127.0.0.1", "https://127.0.0.1", "http://127.0.0.1:*", "https://127.0.0.1:*",
    "http://0.0.0.0", "https://0.0.0.0", "http://0.0.0.0:*", "https://0.0.0.0:*",
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)
ALLOW_HEADERS = (
    "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, OpenAI-Beta, "
    "x-stainless-arch, x-stainless-async, x-stainless-custom-poll-interval, x-stainless-helper-method, "
    "x-stainless-lang, x-stainless-os, x-stainless-package-version, x-stainless-poll-helper, "
    "x-stainless-retry-count, x-stainless-runtime, x-stainless-runtime-version, x-stainless-timeout"
)
ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
#: Request key: the CORS headers :func:`add_cors_headers` adds to the response (``None``: no ``Origin`` sent).
CORS = "vllama.cors"


def cors(extra_origins: Iterable[str]) -> Middleware:
    """CORS as Ollama answers it: allowed origins echoed back, preflights answered with 204."""
    patterns = tuple(DEFAULT_ORIGINS) + tuple(o.strip() for o in extra_origins if o.strip())
    allow_all = "*" in patterns
    cache: dict[str, bool] = {}

    def allowed(origin: str) -> bool:
        ok = cache.get(origin)
        if ok is None:
            ok = allow_all or any(fnmatch.fnmatchcase(origin, p) for p in patterns)
            if len(cache) < 1024:
                cache[origin] = ok
        return ok

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is None:
            request[CORS] = None  # read by add_cors_headers as the response starts: a hit, not a KeyError
            return await handler(request)
        if not allowed(origin):
            raise Forbidden(f"origin {origin!r} is not allowed (set OLLAMA_ORIGINS)")
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            headers.update({
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": ALLOW_HEADERS,
                "Access-Control-Max-Age": "43200",
            })
            return web.Response(status=204, headers=headers)
        request[CORS] = headers  # added to the response before it is sent
        return await handler(request)

    return middleware


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: CORS headers also on streamed and error responses."""
    headers = request.get(CORS)
    if headers:
        response.headers.update(headers)


def _local_addresses() -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            try:
                out.add(ipaddress.ip_address(a.address.split("%")[0]))
            except ValueError:
                continue
    return frozenset(out)


def is_loopback_bind(host: str) -> bool:
    """Whether the listen address is loopback (the guard applies only then, as in Ollama)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_guard() -> Middleware:
    """Ollama's DNS-rebinding guard: 403 for a Host that is not local (use only when bound to loopback)."""
    local = _local_addresses()
    hostname = socket.gethostname().lower()
    cache: dict[str, bool] = {}

    def allowed(host_header: str) -> bool:
        host = host_header.lower()
        if host.startswith("["):  # [v6]:port
            host = host[1 : host.find("]")] if "]" in host else host
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        if host in ("", "localhost", hostname) or host.endswith((".localhost", ".local", ".internal")):
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return ip.is_loopback or ip.is_private or ip.is_unspecified or ip in local

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host", "")
        ok = cache.get(host)
        if ok is None:
            ok = allowed(host)
            if len(cache) < 1024:
                cache[host] = ok
        if not ok:
            raise Forbidden(f"host {host!r} is not allowed: vllama is bound to loopback")
        return await handler(request)

    return middleware
