"""Which role may reach which route: the one allow-list every request is decided by.

:data:`ROUTES` names every route vllama answers or relays, with the roles that may call it
(``admin``: all; ``user``: inference on its models, listing and showing them; ``metrics``: the
Prometheus routes); :data:`OPEN` routes need no key. Invariant: a route not in it is 404 and never
relayed, whatever the key, so vLLM's routes that change the server (``/v1/load_lora_adapter``,
``/sleep``, ``/collective_rpc``, ``/update_weights``...) are safe because nobody listed them for
users, not because someone remembered to block them (read from vLLM 0.32's ``vllm/entrypoints/``).
A new route joins by one line here beside its registration in ``api/app.py`` (``build_app`` refuses
to start when one is missing); a ``/v1/`` route relayed to vLLM needs only its line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: Role sets. ``OPEN``: no key needed.
OPEN: frozenset[str] = frozenset()
ADMIN = frozenset({"admin"})
USER = frozenset({"admin", "user"})
METRICS = frozenset({"admin", "metrics"})
ANY_KEY = frozenset({"admin", "user", "metrics"})

#: ``(method, path) -> roles``. ``GET`` also allows ``HEAD``. A ``{name}`` segment matches one
#: path segment, ``{name:.+}`` the rest of the path (a model id has a ``/``).
ROUTES: Mapping[tuple[str, str], frozenset[str]] = {
    # probes and static facts: no key (docs/operations.md)
    ("GET", "/"): OPEN,
    ("GET", "/livez"): OPEN,
    ("GET", "/readyz"): OPEN,  # its details only for a key (routes/health.py)
    ("GET", "/health"): OPEN,  # vLLM's, for vllm-router (docs/fleet.md)
    ("GET", "/api/version"): ANY_KEY,
    ("GET", "/api/status"): ANY_KEY,  # Ollama's cloud status: always off here
    # the operator's page: it signs in by itself (an admin key once, then a cookie: routes/admin.py)
    ("GET", "/admin"): OPEN,
    ("POST", "/admin/login"): OPEN,
    ("POST", "/admin/logout"): OPEN,
    ("GET", "/admin/live"): OPEN,
    ("POST", "/admin/keys"): OPEN,
    ("POST", "/admin/keys/{name}/{action:update|rotate|revoke}"): OPEN,
    ("GET", "/admin/oidc/login"): OPEN,  # signing in through OpenID Connect (routes/admin_oidc.py)
    ("GET", "/admin/oidc/callback"): OPEN,
    # minting and managing keys without a file (routes/keys.py): an admin's
    ("GET", "/api/keys"): ADMIN,
    ("POST", "/api/keys"): ADMIN,
    ("GET", "/api/keys/audit"): ADMIN,
    ("PATCH", "/api/keys/{name}"): ADMIN,
    ("DELETE", "/api/keys/{name}"): ADMIN,
    ("POST", "/api/keys/{name}/rotate"): ADMIN,
    ("POST", "/api/keys/{name}/revoke"): ADMIN,
    # the usage ledger: a user's own, an admin's every key's (routes/usage.py)
    ("GET", "/api/usage"): USER,
    # Prometheus: every key's and every model's numbers, so an admin's or a scraper's
    ("GET", "/metrics"): METRICS,
    ("GET", "/vllm/metrics"): METRICS,
    # Ollama's API: inference and what a user may see of its models
    ("POST", "/api/generate"): USER,
    ("POST", "/api/chat"): USER,
    ("POST", "/api/embed"): USER,
    ("POST", "/api/embeddings"): USER,
    ("GET", "/api/tags"): USER,
    ("POST", "/api/show"): USER,
    ("GET", "/api/ps"): USER,
    # Ollama's API: what changes the models on the server
    ("POST", "/api/pull"): ADMIN,
    ("POST", "/api/push"): ADMIN,
    ("POST", "/api/create"): ADMIN,
    ("POST", "/api/copy"): ADMIN,
    ("DELETE", "/api/delete"): ADMIN,
    ("HEAD", "/api/blobs/{digest}"): ADMIN,
    ("POST", "/api/blobs/{digest}"): ADMIN,
    # vLLM's OpenAI-compatible inference, relayed (routes/openai.py); /v1/models answered by vllama
    ("GET", "/v1/models"): USER,
    ("GET", "/v1/models/{model:.*}"): USER,
    ("POST", "/v1/chat/completions"): USER,
    ("POST", "/v1/completions"): USER,
    ("POST", "/v1/embeddings"): USER,
    ("POST", "/v1/audio/transcriptions"): USER,
    ("POST", "/v1/audio/translations"): USER,
    ("POST", "/v1/rerank"): USER,
    ("POST", "/v1/score"): USER,
    ("POST", "/v1/messages"): USER,  # Anthropic's Messages API (routes/agents.py)
    ("POST", "/v1/messages/count_tokens"): USER,
    ("POST", "/v1/responses"): USER,  # OpenAI's Responses API (routes/agents.py)
    # a stored response by id: vllama cannot tell whose it is, so an admin's
    ("GET", "/v1/responses/{response_id}"): ADMIN,
    ("POST", "/v1/responses/{response_id}/cancel"): ADMIN,
    # vLLM's routes that show a prompt as the model would see it, nothing generated
    ("POST", "/v1/chat/completions/render"): ADMIN,
    ("POST", "/v1/completions/render"): ADMIN,
    # vLLM's runtime LoRA routes change what every user is served: an admin's (vllama's own
    # adapters come from /api/create)
    ("POST", "/v1/load_lora_adapter"): ADMIN,
    ("POST", "/v1/unload_lora_adapter"): ADMIN,
}

#: What some admin routes do, for the 403's words.
WHAT = {"/api/pull": "pull models", "/api/delete": "delete models", "/api/copy": "copy models",
        "/api/create": "create models", "/api/push": "push models", "/api/blobs/{digest}": "upload blobs",
        "/metrics": "read the metrics", "/api/keys": "manage keys", "/api/keys/{name}": "manage keys",
        "/api/keys/audit": "read the keys' audit log", "/api/keys/{name}/rotate": "rotate keys", "/api/keys/{name}/revoke": "revoke keys", "/vllm/metrics": "read the metrics"}


def _compile(path: str) -> re.Pattern[str]:
    out = ""
    for part in re.split(r"(\{[^}]+\})", path):
        if part.startswith("{"):
            _, _, pattern = part[1:-1].partition(":")
            out += f"(?:{pattern})" if pattern else "[^/]+"
        else:
            out += re.escape(part)
    return re.compile(out)


_EXACT: dict[tuple[str, str], frozenset[str]] = {k: v for k, v in ROUTES.items() if "{" not in k[1]}
_EXACT_PATHS = frozenset(p for _, p in _EXACT)
_PATTERNS: list[tuple[str, str, re.Pattern[str], frozenset[str]]] = [
    (m, p, _compile(p), roles) for (m, p), roles in ROUTES.items() if "{" in p]


class Route:
    """A request's entry in :data:`ROUTES`: its ``path`` template and ``roles``; ``known_path`` when
    only the method is not listed (the router answers 405 then)."""

    __slots__ = ("path", "roles", "known_path")

    def __init__(self, path: str | None, roles: frozenset[str] | None, known_path: bool) -> None:
        self.path, self.roles, self.known_path = path, roles, known_path


def route_of(method: str, path: str, *, metrics_open: bool = False) -> Route:
    """The entry of ``method path`` (``roles`` ``None``: not listed, never relayed).

    Two dict lookups for a listed fixed path; a path with a parameter is matched against the few
    templates (``/api/blobs/{digest}``, ``/v1/models/{model}``, ``/v1/responses/{id}``)."""
    roles = _EXACT.get((method, path))
    if roles is None and method == "HEAD":
        roles = _EXACT.get(("GET", path))
    if roles is not None:
        if metrics_open and roles is METRICS:
            roles = OPEN
        return Route(path, roles, True)
    known = path in _EXACT_PATHS
    for m, template, pattern, r in _PATTERNS:
        if pattern.fullmatch(path):
            if m == method or (m == "GET" and method == "HEAD"):
                return Route(template, r, True)
            known = True
    return Route(None, None, known)


def listed(method: str, path: str) -> bool:
    """Whether an aiohttp route ``method path`` (as ``build_app`` registers it) has its line in
    :data:`ROUTES` (``*`` routes: some method has one)."""
    if method == "*":
        return any(p == path for _, p in ROUTES)
    return (method, path) in ROUTES


def methods_of(path: str) -> list[str]:
    """The methods :data:`ROUTES` lists for ``path`` (``HEAD`` with ``GET``), for a 405's ``Allow``."""
    found = {m for (m, p) in _EXACT if p == path} | {m for m, _, pattern, _ in _PATTERNS if pattern.fullmatch(path)}
    if "GET" in found:
        found.add("HEAD")
    return sorted(found)
