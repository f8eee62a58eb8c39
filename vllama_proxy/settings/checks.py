"""The settings' cross-field rules, as pure functions of the values they read.

A rule either refuses (``ValueError`` with the one line ``vllama serve`` prints) or derives a value
the code reads instead of a field (``Settings.upstream_url``, ``upstream_bearer``, ``client_keys``):
no rule writes a field, so what was given stays what was given. ``Settings`` runs the refusals in
one validator (``core.py``); each is tested alone in ``tests/test_settings.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllama_proxy.models.launch_spec import RESERVED_VLLM_ARGS, ModelConfig


def router_url(router_port: int) -> str:
    """The URL of the vllm-router ``--router`` starts: on loopback, at ``router_port``."""
    return f"http://127.0.0.1:{router_port}"


def reserved_vllm_args(model: str | None, vllm_args: Sequence[str]) -> None:
    """Refuse, with ``--model``, an argument after ``--`` that vllama sets itself (vLLM listens on
    loopback only, on the port the supervisor chose: ``RESERVED_VLLM_ARGS``)."""
    if model:
        for arg in vllm_args:
            if arg.split("=", 1)[0] in RESERVED_VLLM_ARGS:
                raise ValueError(f"{arg.split('=', 1)[0]} is set by vllama; use --vllm-port / --served-model-name")


def fleet_node_keys(fleet_secret: str | None, register_with: str | None, api_key_file: object, api_keys: Sequence[str]) -> None:
    """Refuse a node (``--register-with``) with a fleet secret and other keys: the secret is its only key
    (``front/fleet.py``), the keys file belongs to the front."""
    if fleet_secret and register_with and (api_key_file is not None or any(k != fleet_secret for k in api_keys)):
        raise ValueError("--fleet-secret on a node (--register-with) is its only key: give the keys file "
                         "(--api-key, --api-key-file) to the front")


def router_alone(router: str | None, upstream: str | None, router_port: int, model: str | None, models: Sequence[ModelConfig]) -> None:
    """Refuse ``--router`` beside ``--model``/``[[models]]`` (a fleet's front runs no engine) or beside an
    ``--upstream`` other than the router it starts."""
    if not router:
        return
    if upstream is None and (model or models):
        raise ValueError("--router is a fleet's front: its engines are nodes of their own (vllama serve --model M "
                         "--register-with URL); give --router without --model or [[models]]")
    if upstream is not None and upstream != router_url(router_port):
        raise ValueError("--router starts the upstream: give it without --upstream")


def one_source_of_models(model: str | None, models: Sequence[ModelConfig], upstream: str | None, vllm_args: Sequence[str],
                         port: int) -> None:
    """Refuse two sources of models (``--model``, ``[[models]]``, ``--upstream``), arguments after ``--``
    beside ``[[models]]``, and a name or port used twice among ``[[models]]`` (``port``: the proxy's)."""
    if models and model:
        raise ValueError("give either --model or [[models]] in the config file, not both")
    if models and upstream:
        raise ValueError("--upstream proxies a running vLLM; [[models]] are launched by vllama: choose one")
    if model and upstream:  # --model was ignored silently
        raise ValueError("--upstream proxies a running vLLM; --model launches one: choose one (the arguments "
                         "after -- describe the upstream's vLLM)")
    if models and vllm_args:
        raise ValueError("arguments after -- apply to --model; with [[models]] give each model its vllm_args")
    names: dict[str, str] = {}
    ports: set[int] = set()
    for m in models:
        for n in (m.served_name, *m.aliases):
            key = n.removesuffix(":latest").casefold()
            if key in names:
                raise ValueError(f"model name {n!r} is used twice (by {names[key]!r} and {m.served_name!r})")
            names[key] = m.served_name
        if m.port:
            if m.port in ports or m.port == port:
                raise ValueError(f"port {m.port} is used twice")
            ports.add(m.port)


def upstream_url(upstream: str | None, router: str | None, router_port: int) -> str | None:
    """The vLLM (or router) this front proxies: ``--upstream``, else the router ``--router`` starts;
    ``None``: vllama runs its own vLLM."""
    if upstream is not None:
        return upstream
    return router_url(router_port) if router else None


def upstream_bearer(api_key_upstream: str | None, fleet_secret: str | None) -> str | None:
    """The bearer token sent upstream: ``--api-key-upstream``, else the fleet's secret (a front, and a
    node towards its router, send it; ``front/fleet.py``)."""
    return api_key_upstream if api_key_upstream is not None else fleet_secret


def client_keys(api_keys: Sequence[str], fleet_secret: str | None, register_with: str | None) -> list[str]:
    """The keys clients may send (before the keys file): ``--api-key``, or on a node (``--register-with``
    with ``--fleet-secret``) the secret alone (``fleet_node_keys`` refused any other)."""
    if fleet_secret and register_with:
        return [fleet_secret]
    return list(api_keys)


def admin_oidc(issuer: str | None, client_id: str | None, has_secret: bool, redirect_url: str | None) -> None:
    """Refuse an OpenID Connect sign-in to ``/admin`` without its client id or secret, or a redirect URL whose path
    is not the callback's (``api/routes/admin_oidc.py``)."""
    if issuer and not (client_id and has_secret):
        raise ValueError("--admin-oidc-issuer needs --admin-oidc-client-id and a client secret "
                         "(VLLAMA_ADMIN_OIDC_CLIENT_SECRET or --admin-oidc-client-secret-file)")
    if redirect_url and not redirect_url.endswith("/admin/oidc/callback"):
        raise ValueError("--admin-oidc-redirect-url must end in /admin/oidc/callback (the path vllama answers it on)")
