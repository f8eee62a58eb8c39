"""Tenancy: who may call (``Access``), what one key's request may ask (``TenantLimits``), how keys
share vLLM (``FairShare``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator


class Access(BaseModel):
    """Who may call: API keys, the shared limits' store, metrics access, CORS origins."""

    api_key: list[SecretStr] = Field(
        default_factory=list,
        description="API key clients must send as `Authorization: Bearer` on /api/*, /v1/* and the metrics routes "
        "(repeatable; none: open).",
    )
    api_key_file: Path | None = Field(
        None,
        description="File of API keys: one per line (# comments, each an admin key), or TOML [[keys]] with name, key or "
        "sha256, role (admin|user), models, max_in_flight, priority; added to --api-key; read again on SIGHUP.",
    )
    state_url: str | None = Field(
        None,
        description="Redis every front of a fleet shares (redis://HOST:6379/0; pip install 'vllama-proxy[redis]'): a key's "
        "max_in_flight, rpm and tpm then hold over all fronts, not per front, and its fair share counts what it got on "
        "every front. Without it, or while it does not answer, each front applies its own (docs/fleet.md).",
    )
    metrics_open: bool = Field(
        False,
        description="Serve /metrics and /vllm/metrics without an API key (for a scraper that sends none); by default "
        "both need an admin key or a metrics-role key whenever keys are set (/, /livez and /readyz are always open).",
    )
    origins: list[str] = Field(
        default_factory=list,
        description="CORS origins allowed besides Ollama's defaults (repeatable, * wildcards); OLLAMA_ORIGINS is honoured too.",
    )

    @field_validator("state_url")
    @classmethod
    def _state_url(cls, v: str | None) -> str | None:
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("--state-url must be a redis://, rediss:// or unix:// URL")
        return v or None

    @field_validator("origins")
    @classmethod
    def _ollama_origins(cls, v: list[str]) -> list[str]:
        # Ollama's OLLAMA_ORIGINS adds to ours, as Ollama's defaults do
        origins = os.environ.get("OLLAMA_ORIGINS")
        return [*v, *(o.strip() for o in origins.split(",") if o.strip())] if origins else v


class TenantLimits(BaseModel):
    """What one key's request may ask: cache isolation, pulls, sequences, inputs, cache quota."""

    cache_isolation: Literal["key", "off"] = Field(
        "key",
        description="key: each API key's requests get a prefix-cache share of their own (vLLM's cache_salt, from the "
        "key's name and secret; a client's own cache_salt is combined with it, never sent instead), so no key learns "
        "from its time to first token what another sent (the default: no tenant reads another's prompts). Costs the "
        "cache hits keys would share: a system prompt every key sends is computed and cached once per key. off: one "
        "cache for all, a client's cache_salt sent as it came (keys that trust each other). Without keys: no salt.",
    )
    max_pulls: int = Field(2, ge=1, description="Pulls at once over the server; more get 429.")
    max_choices: int = Field(
        16, ge=1,
        description="Most sequences one /v1/chat/completions or /v1/completions request of a non-admin key may start "
        "in vLLM: its n (beam width with use_beam_search) times its prompts; more get 400 (each counts as one "
        "request in the admission bound and the key's share).",
    )
    max_inputs: int = Field(
        2048, ge=1,
        description="Most inputs one embeddings, rerank or score request of a non-admin key may send vLLM: /v1/embeddings' "
        "input list, /v1/rerank's documents, /v1/score's pairs (OpenAI's embeddings API takes at most 2,048); each is a "
        "sequence of its own in vLLM; more get 400. /api/embed takes any number, as Ollama does, and sends them in parts "
        "of this many, one after another. The fair share charges each input.",
    )
    cache_quota: int | None = Field(
        None, gt=0, description="Most bytes the Hugging Face cache may hold after a pull (507 beyond it; default: the disk).",
    )


class FairShare(BaseModel):
    """Sharing vLLM between keys (weighted fair queueing)."""

    fair_share: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Share vLLM between keys: at most vLLM's running capacity (--max-running) goes upstream, the rest "
        "waits in vllama, one queue per key, served in weighted fair order (VTC: each key's output tokens, + "
        "--fair-prompt-weight x its prompt tokens, over its weight; priority first); each key's share of the admission bound; "
        "each request's vLLM priority "
        "(vLLM runs with --scheduling-policy priority) (auto: on with --api-key-file).",
    )
    fair_reserve: int | None = Field(
        None, ge=0,
        description="With fair sharing, the last places of vLLM's running capacity, which keys above their share leave "
        "free while another key is active, so that a light key never waits for a heavy key's request to end (default: "
        "1/32 of the capacity, at least 1; 0: strictly work-conserving). A key alone uses every place.",
    )
    fair_light_running: int | None = Field(
        None, ge=0,
        description="With fair sharing, while a light key is active (one asking less than its share, or that asked in "
        "the last 10 s), the most requests the keys above their share run together: fewer sequences in vLLM make its "
        "steps, and so the light key's time to first token, shorter (default: half of the running capacity; 0: no "
        "such cap, only --fair-reserve).",
    )
    fair_prompt_weight: float = Field(
        0.0, ge=0,
        description="With fair sharing, what a prompt token costs a key, in output tokens (0: keys share the output tokens by "
        "weight, as they share vLLM's running slots; 0.5: VTC's prompt + 2 x output).",
    )

    def fair_reserve_for(self, running: int) -> int:
        """The fair queue's reserve for a running capacity of ``running`` (``fair_reserve``, else 1/32 of it,
        at least 1 where there are two places: with 0 a light key waits for a heavy key's request to end)."""
        if self.fair_reserve is not None:
            return self.fair_reserve
        return max(1, running // 32) if running > 1 else 0

    def fair_light_running_for(self, running: int) -> int:
        """The fair queue's cap on the heavy keys' requests upstream while a light key is active, for a
        running capacity of ``running`` (``fair_light_running``, else half of it; 0: none). Half: on the
        H100 (``--max-num-seqs 256``, one key's 1,000 streams) 128 running gave the other key's first
        token after 39 ms instead of 57 (alone: 18), and the flooding key 1.11x the tok/s it had with fair
        share off (``benchmarks/RESULTS.md``)."""
        if self.fair_light_running is not None:
            return self.fair_light_running
        return running // 2 if running > 1 else 0


class AdminSignIn(BaseModel):
    """Signing in to ``/admin`` through an OpenID Connect provider (``api/routes/admin_oidc.py``;
    ``docs/operations.md``), beside the admin key."""

    admin_oidc_issuer: str | None = Field(
        None,
        description="An OpenID Connect provider's issuer URL (https://id.example.com/realms/main; its "
        "/.well-known/openid-configuration is read): /admin then offers 'Sign in with OpenID Connect' beside the "
        "admin key (authorization code flow with PKCE; pip install 'vllama-proxy[oidc]'). Needs a keys file or "
        "--api-key (an open server has no sign-in), --admin-oidc-client-id and a client secret.",
    )
    admin_oidc_client_id: str | None = Field(None, description="The client id vllama is registered with at the provider.")
    admin_oidc_client_secret: SecretStr | None = Field(
        None,
        description="The client's secret (better VLLAMA_ADMIN_OIDC_CLIENT_SECRET or --admin-oidc-client-secret-file than "
        "a flag others can read in ps); never logged. It also signs the page's OpenID Connect sign-ins, so every "
        "worker and front given the same secret accepts them.",
    )
    admin_oidc_client_secret_file: Path | None = Field(
        None, description="A file holding the client's secret (its first line), instead of --admin-oidc-client-secret.",
    )
    admin_oidc_role_claim: str = Field(
        "groups",
        description="The ID token's (else the userinfo's) claim that says who is an admin: a list or a string holding "
        "--admin-oidc-admin-value. Anyone else signed in is shown the sign-in form with the reason.",
    )
    admin_oidc_admin_value: str = Field(
        "vllama-admin", description="The value of --admin-oidc-role-claim that makes its holder an admin of the page.",
    )
    admin_oidc_scopes: str = Field(
        "openid email profile",
        description="The scopes asked for (space-separated; add the one your provider puts groups under, e.g. 'groups').",
    )
    admin_oidc_redirect_url: str | None = Field(
        None,
        description="The redirect URI registered at the provider, ending in the path /admin/oidc/callback (default: "
        "this server's origin as the browser reached it, + /admin/oidc/callback; give "
        "https://PUBLIC-HOST/admin/oidc/callback behind a TLS proxy).",
    )

    @field_validator("admin_oidc_issuer", "admin_oidc_redirect_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v and not v.startswith(("https://", "http://")):
            raise ValueError("must be an http:// or https:// URL")
        return v.rstrip("/") or None if v else None

    @field_validator("admin_oidc_client_secret")
    @classmethod
    def _empty_secret(cls, v: SecretStr | None) -> SecretStr | None:
        return v if v is not None and v.get_secret_value() else None

    def admin_oidc_secret(self) -> str | None:
        """The client secret: ``--admin-oidc-client-secret``, else ``--admin-oidc-client-secret-file``'s first line.

        Raises:
            OSError: the file cannot be read.
        """
        if self.admin_oidc_client_secret is not None:
            return self.admin_oidc_client_secret.get_secret_value()
        if self.admin_oidc_client_secret_file is not None:
            lines = self.admin_oidc_client_secret_file.read_text().splitlines()
            return lines[0].strip() if lines and lines[0].strip() else None
        return None
