"""A fleet behind vllm-router (docs/fleet.md): session keys, a node's registration, the fleet's
shared secret, the router a front starts (``Fleet``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator


class Fleet(BaseModel):
    """A fleet behind vllm-router (docs/fleet.md): session keys, registration, the shared secret, --router."""

    session_header: str = Field(
        "X-Session-ID",
        description="Header carrying a conversation's stable key upstream (a hash of the model, system prompt and first "
        "user message; a client's own value goes instead, with --upstream scoped to its API key and hashed, at most 8 "
        "requests in flight under it), read by vllm-router's consistent_hash and sticky_least_loaded policies. Empty: none.",
    )
    session_key: Literal["conversation", "system"] = Field(
        "conversation",
        description="What the session key of --session-header hashes: the model, system prompt and first user message "
        "(conversation: each conversation keeps its engine), or the model and system prompt (system: every conversation "
        "sharing a system prompt keeps one engine, for a router's sticky_least_loaded policy; without a system prompt, "
        "the conversation's key; see --request-sessions).",
    )
    request_sessions: Literal["auto", "on", "off"] = Field(
        "auto",
        description="A request with no key of its own to share (no system prompt under --session-key system, an "
        "/api/generate or /v1 completion without one) goes upstream under a one-request session key, and the front "
        "releases it at the router when the request ends (POST /finish_session), so that vllm-router's "
        "sticky_least_loaded counts the requests in flight per engine and places the next one on the least loaded "
        ". auto: on with --router sticky_least_loaded, or when the --upstream answers a vllm-router's "
        "GET /list_workers (checked once at start); off otherwise. Off even when on, with a warning, where no router reads "
        "the keys: without --upstream (a node) or with --session-header ''.",
    )
    register_with: str | None = Field(
        None,
        description="URL of a vllm-router this node joins: its /add_worker is called with --advertise-url whenever the "
        "node is ready and the router does not list it (after a restart of either), /remove_worker on a clean stop.",
    )
    advertise_url: str | None = Field(
        None,
        description="The URL the router reaches this node at (default: http://<this host's name>:<--port>).",
    )
    register_interval: float = Field(10.0, gt=0, description="Seconds between checks that the router lists this node.")
    fleet_secret: SecretStr | None = Field(
        None,
        description="A fleet's shared secret (give every front and node the same, e.g. VLLAMA_FLEET_SECRET from one "
        "secret): a front (--upstream, --router) sends it upstream as its bearer token (unless --api-key-upstream); a "
        "node (--register-with) requires it on /api/* and /v1/* and takes no other key, so no user reaches a node, "
        "or the router, around the front (vllm-router passes the caller's Authorization on to the node).",
    )
    router: str | None = Field(
        None,
        description="Start vLLM's router (vllm-router, `pip install vllm-router`) with this --policy (e.g. sticky_least_loaded) "
        "as this front's upstream, on --host and --router-port, with no workers: nodes join it with --register-with "
        "http://THIS-HOST:ROUTER-PORT. Restarted when it exits; stopped with vllama. Instead of --upstream.",
    )
    router_port: int = Field(30000, ge=1, le=65535, description="Port of the router --router starts.")
    router_args: str = Field(
        "--health-check-interval-secs 2",
        description="More vllm-router flags for --router, one string (shell words), e.g. '--prometheus-port 29000'.",
    )

    @field_validator("fleet_secret")
    @classmethod
    def _empty_secret(cls, v: SecretStr | None) -> SecretStr | None:
        return v if v is not None and v.get_secret_value() else None  # empty: none
