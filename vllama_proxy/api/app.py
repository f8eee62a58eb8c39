"""The aiohttp application: routes, the error/log middleware, app-scoped resources.

Request flow: ``app.py`` (middlewares, outermost first: request id + errors ->
the route family's error shape + access log + metrics; CORS, Host guard and API keys from
``access.py``; the readiness gate; the in-flight bound) -> ``routes/<group>.py`` (``routes/body.py``
parses, ``routes/model_use.py`` resolves and holds the model) -> ``ollama/to_openai.py`` (Ollama ->
OpenAI body) -> ``relay.py`` (sends it through ``upstream/``, the shared vLLM client, and streams
the answer back through ``ollama/to_ollama.py``: vLLM chunks -> Ollama NDJSON).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Sequence, AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web

from vllama_proxy.errors import RequestTooLarge, UpstreamError, VllamaError, error_response, shape_of, shaped_body
from vllama_proxy.logs import get_logger
from vllama_proxy.models.boards import SlotBoard
from vllama_proxy.models.aliases import AliasStore
from vllama_proxy.models.vllm_servers import Backend, BackendSpec
from vllama_proxy.models.blobs import BlobStore
from vllama_proxy.models.catalog import Catalog
from vllama_proxy.models.created import CreatedStore
from vllama_proxy.models.state_file import StoreChanges
from vllama_proxy.models.on_demand import OnDemand
from vllama_proxy.models.resolved import ResolvedModels
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.sizing import Plan
from vllama_proxy.models.boards import EngineBoard
from vllama_proxy.upstream import Upstream
from .policy import access, end_users, key_store, keys as api_keys, route_roles
from .request import admission
from .request.call import CALL, Call
from .usage.ledger import Ledger
from .request.settler import Settler
from .usage.store import open_store
from .fleet.client_affinity import ClientAffinity
from .fleet.router_release import RouterRelease
from .policy.fleet_counters import RedisKeyState, redis_client
from .metrics import REQUESTS, UPSTREAM_ERRORS, make_handler, route_of
from .routes import admin, admin_oidc, agents, keys, blobs, chat, create, embed, generate, health, hub, manage, meta, models, openai, usage
from .app_state import (ACCEPTED, ADMISSION, BLOBS, CATALOG, CLIENT_AFFINITY, CLOSE_AFTER, DRAINING, FRONT_END, KEY_STORE, KEYS, LEDGER, MAX_RUNNING,
                        ROUTER_RELEASE, SETTINGS, SETTLER, WORKER)

log = get_logger("vllama.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: A client's X-Request-ID is kept only if it is plain (it lands in every log line).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@web.middleware
async def errors_and_access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bind a ``request_id``, map every error to its route family's shape, log one line per request.

    The shape is ``errors.shape_of`` the path: OpenAI's ``{"error": {"message", "type", "param", "code"}}``
    on ``/v1``, Anthropic's on ``/v1/messages*``, Ollama's ``{"error": "..."}`` elsewhere; whichever
    middleware or handler raised it (the API key, admission, the readiness gate, a route), with its
    status and headers unchanged. A client that disconnects cancels the handler (``handler_cancellation=True``); that
    is logged with Ollama's status for it, 499 ``request canceled``.
    """
    structlog.contextvars.clear_contextvars()
    call = request[CALL] = Call()  # the request's own record: filled on its way, charged once by the settler
    given = request.headers.get("X-Request-ID", "")
    # vllama's own id always; a client's plain X-Request-ID is kept beside it, never instead
    own = os.urandom(8).hex()  # 16 hex digits, as uuid4().hex[:16] was, without building a UUID
    if _REQUEST_ID.fullmatch(given):
        structlog.contextvars.bind_contextvars(request_id=own, client_request_id=given)
    else:
        structlog.contextvars.bind_contextvars(request_id=own)
    request["vllama.request_id"] = own
    start = time.perf_counter()
    request[ACCEPTED] = time.perf_counter_ns()  # stage timings (relay.py) count from here
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except VllamaError as e:
        status = e.status
        call.error = e.message
        if isinstance(e, UpstreamError):
            UPSTREAM_ERRORS.labels(type(e).__name__).inc()
        if status >= 500:
            log.warning("upstream_error", error=e.message, status=status)
        resp = error_response(e, shape_of(request.path))
        if request.get(CLOSE_AFTER):
            resp.force_close()
        return resp
    except web.HTTPException as e:
        status = e.status
        if status == 413:
            limit = request.app[SETTINGS].max_body_size
            return error_response(RequestTooLarge(f"request body too large: the limit is {limit} bytes"), shape_of(request.path))
        if e.empty_body or status < 400:
            raise
        text = "404 page not found" if status == 404 else (e.reason or "").lower()
        return web.Response(status=status, body=shaped_body(shape_of(request.path), status, text), content_type="application/json",
                            headers=_allow(e))
    except asyncio.CancelledError:
        status = 499  # Ollama: client gone -> "request canceled"
        raise
    except Exception as e:
        if isinstance(e, ConnectionResetError) and (request.transport is None or request.transport.is_closing()):
            # A write to a client that left before its cancellation arrived (aiohttp's
            # ClientConnectionResetError "Cannot write to closing transport"; docs/decisions.md).
            # The client is gone: 499 as a cancellation, and aiohttp drops it quietly; leaving the
            # handler closed the upstream request, so vLLM aborts it. A reset with the client still there
            # is an error like any other.
            status = 499
            raise
        log.exception("unhandled_error")
        return web.Response(status=500, body=shaped_body(shape_of(request.path), 500, "internal error; see the vllama log"),
                            content_type="application/json")
    finally:
        route = route_of(request)
        REQUESTS.labels(route, str(status)).inc()
        stream_error = call.stream_error
        if stream_error is not None:
            UPSTREAM_ERRORS.labels(type(stream_error).__name__).inc()
        # every token charged, every place given back, once (settler.py); the ledger's row queued, written off the path
        settler = request.app.get(SETTLER)
        if settler is not None:  # (an app of this middleware alone, in a unit test, charges nothing)
            await settler.settle(request, call, status, time.perf_counter() - start, route)
        if request.app[SETTINGS].access_log:
            extra = {"stream_error": stream_error.message} if stream_error is not None else {}
            if call.end_user is not None:  # a trusted front's end user (end_users.py), hashed where the key asks
                extra["end_user"] = end_users.log_name(call.key, call.end_user)
            log.info("request", method=request.method, path=request.path, status=status, duration_ms=round((time.perf_counter() - start) * 1000, 2),
                     key=api_keys.key_of(request).name, client=request.remote, **extra)


#: Routes that answer while vLLM loads: static facts and the probes.
_UNGATED = frozenset({"/", "/api/version", "/api/status", "/livez", "/readyz", "/metrics", "/health", "/api/usage", "/admin",
                      "/admin/login", "/admin/logout", "/admin/live", "/admin/keys", "/api/keys", "/api/keys/audit",
                      "/admin/oidc/login", "/admin/oidc/callback"})


def ready_gate(boards: Sequence[EngineBoard]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Middleware answering 503 (in the route family's error shape) on the API while no model can serve.

    While vLLM starts the proxy already listens, so clients get a clear "loading"
    error instead of refused connections or hangs. A few attribute reads per request;
    each model is gated again on its own when a request uses it (``routes/model_use.py``).
    """

    def open_(board: EngineBoard) -> bool:
        # A sleeping or unloaded model (keep_alive ended) is loaded on demand by the handler.
        return board.available or board.waking or board.loading

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (request.path not in _UNGATED and not any(open_(b) for b in boards)
                and not request.path.startswith(("/api/keys/", "/admin/"))):
            raise boards[0].unavailable()
        return await handler(request)

    return gate


async def fallback(request: web.Request) -> web.Response:
    """404 ``404 page not found`` for unknown paths, 405 with ``Allow`` for a known path's other methods."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is request.match_info.route.resource:
            continue
        _, methods = await resource.resolve(request)
        allowed |= methods
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, sorted(allowed))
    raise web.HTTPNotFound()


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """``Expect`` handling before the handler runs: ``100-continue`` is honoured, any other
    value is a 417 in the route family's error shape (aiohttp's default one fails on non-UTF-8 values)."""
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue":
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        return None
    return web.Response(status=417, body=shaped_body(shape_of(request.path), 417, f"unsupported Expect: {ascii(expect)}"),
                        content_type="application/json")


def _allow(e: web.HTTPException) -> dict[str, str] | None:
    allow = e.headers.get("Allow")
    return {"Allow": allow} if allow else None


async def usage_ledger(app: web.Application) -> AsyncIterator[None]:
    """The usage ledger's database and flush task for the app's life; the rows left are written at
    the end (after the requests in flight drained). A database that cannot be opened stops the start."""
    ledger = app[LEDGER]
    try:
        await ledger.start()
    except Exception as e:
        log.error("usage_ledger_failed", error=repr(e), hint="--usage-db names where it is kept; --usage-db off runs without it")
        raise
    yield
    await ledger.close()


async def minted_keys(app: web.Application) -> AsyncIterator[None]:
    """The minted keys (``key_store.py``) for the app's life: read before the first request, then followed
    (``key_store.follow``: every change of every worker and front within about a second). A database that
    cannot be opened stops the start, as the ledger's does."""
    settings = app[SETTINGS]
    try:
        store = await asyncio.to_thread(key_store.open_key_store, settings.usage_db, settings.state_dir)
        app[KEYS].set_minted(await asyncio.to_thread(store.rows))
    except Exception as e:
        log.error("key_store_failed", error=repr(e), hint="--usage-db names where it is kept; --usage-db off runs without it")
        raise
    app[KEY_STORE] = store
    task = asyncio.create_task(key_store.follow(store, app[KEYS].set_minted))
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.to_thread(store.close)


def check_config(settings: Settings) -> None:
    """Refuse, before anything is built or started, what ``build_app`` could not serve with: a keys
    file that cannot be read or parsed, ``--state-url`` without the redis package, budgets in the keys
    file with ``--usage-db off``. ``vllama serve`` prints the one line and exits 2 (``cli.py``).

    Raises:
        ValueError: the one line saying what is wrong.
    """
    try:
        ring = api_keys.KeyRing(settings.client_keys, settings.api_key_file, cache_isolation=settings.cache_isolation)
    except (OSError, ValueError) as e:
        raise ValueError(f"--api-key-file: {e}") from None
    if settings.state_url:
        try:
            redis_client()
        except RuntimeError as e:
            raise ValueError(str(e)) from None
    if settings.usage_db == "off" and any(k.budget_tokens is not None for k in ring.keys):
        raise ValueError("--usage-db off: the keys file gives budget_tokens, which need the usage ledger")


def build_app(settings: Settings, resolved: ResolvedModels, backends: list[BackendSpec], *, worker: int = 0, front: Plan,
              bound: admission.AdmissionBound, slots: SlotBoard | None = None, changes: StoreChanges | None = None) -> web.Application:
    """The Ollama-API app proxying the vLLM servers in ``backends``.

    Args:
        settings: the validated settings (``workers`` resolved to a number).
        resolved: the library and the launched models, resolved at start (``models/resolved.py``).
        backends: one per model vllama launches (with its status board), or the one
            ``--upstream`` server.
        worker: this process's index among ``--workers`` (its slot for in-flight counts).
        front: the front end's plan (processes per side), for ``/readyz``.
        bound: the server-wide admission count in shared memory (``admission.py``).
        slots: the on-demand slots (``supervisor/slots.py``), whose backends are the ``slot`` ones of
            ``backends``; ``None``: no model starts on demand.
        changes: the change counts of the state files every process reads (``models/state_file.py``,
            made before the workers spawn); ``None``: those files are stat'ed at every lookup.
    """
    middlewares = [errors_and_access_log, access.cors(settings.origins)]
    if access.is_loopback_bind(settings.host):
        middlewares.append(access.host_guard())
    ring = api_keys.KeyRing(settings.client_keys, settings.api_key_file, cache_isolation=settings.cache_isolation)
    if worker == 0:  # the prefix cache's tenants, decided once (api/policy/cache_salt.py)
        log.info("cache_isolation", mode=settings.cache_isolation if ring.configured else "off",
                 reason=("no API key: one tenant" if not ring.configured else
                         "each key its own cache_salt" if settings.cache_isolation == "key" else "--cache-isolation off"))
    middlewares.append(api_keys.middleware(ring, metrics_open=settings.metrics_open))  # who is asking: api/policy/keys.py
    boards = [b.board for b in backends if b.board is not None]
    configured = [b.board for b in backends if b.board is not None and b.slot is None]
    if configured:  # on-demand models are gated per request (routes/model_use.py), not here
        middlewares.append(ready_gate(configured))
    supervised = all(b.board is not None for b in backends)  # vllama launched each vLLM: with --scheduling-policy priority when fair
    shared = RedisKeyState(settings.state_url, front=bound.front) if settings.state_url else None  # limits across fronts
    middlewares.append(admission.middleware(bound, worker, settings.retry_after, fair=settings.fair(),
                                            priority=settings.fair() and supervised, shared=shared,
                                            max_inputs=settings.max_inputs, max_choices=settings.max_choices))
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_size)
    app.on_response_prepare.append(access.add_cors_headers)
    app.on_response_prepare.append(admission.add_rate_headers)
    pool = Upstream(
        backends[0].url,
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        api_key=settings.upstream_bearer,
        connect_concurrency=front.connects,
    )
    live = [Backend(spec, pool if i == 0 else pool.at(spec.url)) for i, spec in enumerate(backends)]
    on_demand = None
    if slots is not None:
        on_demand = OnDemand(slots, [b for b in live if b.slot is not None], library=resolved.library,
                             allow=settings.on_demand_models, vllm_args=settings.vllm_args, keep_alive=settings.keep_alive,
                             load_timeout=settings.load_timeout, uploaded=settings.state_dir / "models",
                             detect_parsers=settings.detect_parsers, worker=worker)
    aliases = dict(settings.alias)
    for spec in resolved.specs:
        aliases.update({a: spec.served_name for a in spec.aliases})
    app[SETTINGS] = settings
    app[BLOBS] = BlobStore(settings.state_dir / "blobs", settings.max_blob_size)
    app[admin.SIGN_OUTS] = admin.SignOuts(settings.state_dir / "admin-signouts")
    if settings.admin_oidc_issuer:
        app[admin.OIDC] = admin_oidc.OidcSignIn(
            settings.admin_oidc_issuer, settings.admin_oidc_client_id or "", settings.admin_oidc_secret() or "",
            role_claim=settings.admin_oidc_role_claim, admin_value=settings.admin_oidc_admin_value,
            scopes=settings.admin_oidc_scopes, redirect_url=settings.admin_oidc_redirect_url)
    app[KEYS] = ring
    app[WORKER] = worker
    app[FRONT_END] = front
    app[MAX_RUNNING] = bound.running
    if shared is not None:
        app.on_startup.append(lambda _app: shared.start())
        app.on_cleanup.append(lambda _app: shared.close())
    app[DRAINING] = lambda: bound.draining
    app[CATALOG] = Catalog(
        [b for b in live if b.slot is None],
        aliases=aliases,
        vllm_args={"*": settings.vllm_args},
        ttl=settings.models_ttl,
        store=AliasStore(settings.state_dir / "aliases.json", changes.aliases if changes else None),
        library=resolved.library,
        on_demand=on_demand,
        created=CreatedStore(settings.state_dir / "created.json", changes.created if changes else None),
    )

    app[ROUTER_RELEASE] = releases = RouterRelease()
    # a client's own key is scoped and bounded where a router may read it (a front: --upstream)
    app[CLIENT_AFFINITY] = ClientAffinity(settings.session_header, scoped=settings.upstream_url is not None)

    async def upstream_session(app: web.Application) -> AsyncIterator[None]:
        await pool.start()  # the one session and connection pool every backend uses
        yield
        await releases.close()  # the router's releases in flight, on that pool
        await pool.close()

    app.cleanup_ctx.append(upstream_session)
    app[ADMISSION] = bound
    if settings.usage_db != "off":
        app[LEDGER] = Ledger(lambda: open_store(settings.usage_db, settings.state_dir), flush_interval=settings.usage_flush_interval,
                             flush_rows=settings.usage_flush_rows, refresh_interval=settings.usage_refresh_interval,
                             retention_days=settings.usage_retention_days, prunes=worker == 0)
        app.cleanup_ctx.append(usage_ledger)
        app.cleanup_ctx.append(minted_keys)
    app[SETTLER] = Settler(bound, bound.queue if settings.fair() else None, shared, app.get(LEDGER), ring)
    routes = [
        ("GET", "/", meta.root),  # GET routes also answer HEAD
        ("GET", "/api/version", meta.version),
        ("GET", "/api/status", meta.status),  # Ollama 0.16.2: its cloud's status
        ("GET", "/livez", health.livez),
        ("GET", "/readyz", health.readyz),
        ("GET", "/health", health.health),  # vLLM's, for vllm-router (docs/fleet.md)
        ("GET", "/metrics", make_handler(boards)),
        ("GET", "/vllm/metrics", openai.vllm_metrics),
        ("GET", "/api/usage", usage.usage),
        ("GET", "/admin", admin.page),
        ("POST", "/admin/login", admin.login),
        ("POST", "/admin/logout", admin.logout),
        ("GET", "/admin/live", admin.live),
        ("POST", "/admin/keys", admin.key_create),
        ("POST", "/admin/keys/{name}/{action:update|rotate|revoke}", admin.key_action),
        ("GET", "/admin/oidc/login", admin_oidc.login),
        ("GET", "/admin/oidc/callback", admin_oidc.callback),
        ("GET", "/api/keys", keys.list_keys),
        ("POST", "/api/keys", keys.create),
        ("GET", "/api/keys/audit", keys.audit),
        ("PATCH", "/api/keys/{name}", keys.update),
        ("DELETE", "/api/keys/{name}", keys.revoke),
        ("POST", "/api/keys/{name}/rotate", keys.rotate),
        ("POST", "/api/keys/{name}/revoke", keys.revoke),
        ("POST", "/api/generate", generate.generate),
        ("POST", "/api/chat", chat.chat),
        ("POST", "/api/embed", embed.embed),
        ("POST", "/api/embeddings", embed.embeddings),
        ("GET", "/api/tags", models.tags),
        ("POST", "/api/show", models.show),
        ("GET", "/api/ps", models.ps),
        ("POST", "/api/pull", hub.pull),
        ("POST", "/api/push", manage.unsupported),
        ("POST", "/api/create", create.create),
        ("POST", "/api/copy", manage.copy),
        ("DELETE", "/api/delete", hub.delete),
        ("*", "/api/blobs/{digest}", blobs.blob),
        ("POST", "/v1/messages", agents.messages),  # Claude Code (Ollama 0.14)
        ("POST", "/v1/messages/count_tokens", agents.count_tokens),
        ("POST", "/v1/responses", agents.responses),  # Codex (Ollama 0.13.3)
        ("*", "/v1/{tail:.*}", openai.passthrough),
    ]
    for method, path, handler in routes:
        # every route is decided by route_roles.ROUTES (a relayed /v1 route by its own line there)
        if path != "/v1/{tail:.*}" and not route_roles.listed(method, path):
            raise RuntimeError(f"{method} {path} has no line in api/policy/route_roles.py ROUTES: say which roles may reach it")
        if method == "GET":
            app.router.add_get(path, handler, expect_handler=expect_continue)
        else:
            app.router.add_route(method, path, handler, expect_handler=expect_continue)
    # Last: unknown paths and methods land here, not on aiohttp's system routes, so they
    # too get the route family's error shape and our Expect handling.
    app.router.add_route("*", "/{tail:.*}", fallback, expect_handler=expect_continue)
    return app
