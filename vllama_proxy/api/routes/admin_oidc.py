"""Signing in to ``/admin`` through an OpenID Connect provider, beside the admin key (``--admin-oidc-issuer``).

The authorization code flow with PKCE (S256), ``state`` and ``nonce``, through authlib (``AsyncOAuth2Client``
for the authorization URL and the code's exchange, ``CodeIDToken`` and joserfc for the ID token's check against
the provider's published keys): ``GET /admin/oidc/login`` sends the browser to the provider, ``GET
/admin/oidc/callback`` checks what comes back and sets ``admin.py``'s sign-in cookie for a person whose role
claim holds ``--admin-oidc-admin-value``; anyone else gets the sign-in form with the reason, never a 500.
Invariants: the client secret is never logged nor put in a page; no state is kept in the workers (the flow's
lives in its cookie), so any worker or front with the same settings finishes a sign-in another began.
Routes, cookies and checks: ``docs/operations.md`` "Signing in with OpenID Connect", "The page's routes and cookies".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
import time
from typing import Any

import orjson
from aiohttp import web

from vllama_proxy.errors import SignInFailed, SignInNotAdmin, SignInProviderFailed, VllamaError
from vllama_proxy.logs import get_logger
from . import admin

log = get_logger("vllama.admin")

#: The flow's cookie (state, nonce, code verifier) between the login and the callback.
FLOW_COOKIE = "vllama_oidc"
#: Seconds a sign-in may take at the provider.
FLOW_AGE = 600
CALLBACK = "/admin/oidc/callback"
#: Seconds the provider's discovery document and keys are kept.
METADATA_AGE = 3600.0


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class OidcSignIn:
    """One front's OpenID Connect client for the admin page (``app[admin.OIDC]``).

    Args:
        issuer: the provider's issuer URL (its ``/.well-known/openid-configuration`` is read).
        client_id, client_secret: vllama's registration at the provider.
        role_claim, admin_value: the claim and the value of it that make an admin.
        scopes: the scopes asked for (space-separated).
        redirect_url: the redirect URI registered at the provider (``None``: the request's origin + :data:`CALLBACK`).

    Raises:
        ValueError: authlib is not installed.
    """

    def __init__(self, issuer: str, client_id: str, client_secret: str, *, role_claim: str = "groups",
                 admin_value: str = "vllama-admin", scopes: str = "openid email profile",
                 redirect_url: str | None = None) -> None:
        try:
            import authlib  # noqa: F401
        except ModuleNotFoundError:
            raise ValueError("--admin-oidc-issuer needs authlib: pip install 'vllama-proxy[oidc]'") from None
        self.issuer = issuer.rstrip("/")
        self.client_id = client_id
        self._secret = client_secret
        self.role_claim = role_claim
        self.admin_value = admin_value
        self.scopes = scopes
        self.redirect_url = redirect_url
        #: signs the flow's cookie and the page's OpenID Connect sign-ins: derived from the client secret, so every
        #: worker and front given the same settings accepts them, and a new secret ends them all
        self.session_key = hmac.new(client_secret.encode(), b"vllama-admin-oidc-session", hashlib.sha256).digest()
        self._metadata: dict[str, Any] | None = None
        self._jwks: dict[str, Any] | None = None
        self._read_at = 0.0

    def __repr__(self) -> str:  # never the secret
        return f"OidcSignIn(issuer={self.issuer!r}, client_id={self.client_id!r})"

    def _client(self, redirect_uri: str) -> Any:
        from authlib.integrations.httpx_client import AsyncOAuth2Client

        return AsyncOAuth2Client(self.client_id, self._secret, scope=self.scopes, redirect_uri=redirect_uri,
                                 code_challenge_method="S256", timeout=15.0)

    async def metadata(self, *, keys: bool = False, force: bool = False) -> dict[str, Any]:
        """The provider's discovery document (with ``keys``: its JWKS, under ``"jwks"``), read at most once an hour.

        Raises:
            SignInProviderFailed: it cannot be read, or names another issuer.
        """
        now = time.monotonic()
        if force or self._metadata is None or now - self._read_at > METADATA_AGE:
            self._metadata, self._jwks, self._read_at = await self._get(self.issuer + "/.well-known/openid-configuration"), None, now
            if self._metadata.get("issuer", "").rstrip("/") != self.issuer:
                found = self._metadata.get("issuer")
                self._metadata = None
                raise SignInProviderFailed(f"the OpenID Connect provider names its issuer {found!r}, not {self.issuer!r} "
                                           "(--admin-oidc-issuer)")
            missing = [k for k in ("authorization_endpoint", "token_endpoint", "jwks_uri") if not self._metadata.get(k)]
            if missing:
                self._metadata = None
                raise SignInProviderFailed(f"the OpenID Connect provider's discovery document lacks {', '.join(missing)}")
        if keys and (self._jwks is None or force):
            self._jwks = await self._get(self._metadata["jwks_uri"])
        return {**self._metadata, "jwks": self._jwks}

    async def _get(self, url: str) -> dict[str, Any]:
        from authlib.integrations.httpx_client import AsyncOAuth2Client

        try:
            async with AsyncOAuth2Client(timeout=15.0) as c:
                r = await c.request("GET", url, withhold_token=True)
                r.raise_for_status()
                body = r.json()
        except Exception as e:  # httpx2's errors, a body that is no JSON
            log.warning("admin_oidc_provider_failed", url=url, error=repr(e))
            raise SignInProviderFailed(f"the OpenID Connect provider did not answer {url}: {e}") from None
        if not isinstance(body, dict):
            raise SignInProviderFailed(f"the OpenID Connect provider answered {url} with no JSON object")
        return body

    def _redirect_uri(self, request: web.Request) -> str:
        return self.redirect_url or f"{request.scheme}://{request.host}{CALLBACK}"

    def _seal(self, payload: dict[str, Any]) -> str:
        body = _b64(orjson.dumps(payload))
        return f"{body}.{hmac.new(self.session_key, body.encode(), hashlib.sha256).hexdigest()}"

    def _unseal(self, value: str, now: float) -> dict[str, Any] | None:
        body, _, sig = value.rpartition(".")
        if not body or not hmac.compare_digest(sig, hmac.new(self.session_key, body.encode(), hashlib.sha256).hexdigest()):
            return None
        try:
            payload = orjson.loads(_unb64(body))
        except ValueError:
            return None
        return payload if isinstance(payload, dict) and payload.get("exp", 0) >= now else None

    async def start(self, request: web.Request) -> web.StreamResponse:
        """The login: the browser to the provider, the flow's secrets in :data:`FLOW_COOKIE`."""
        from authlib.common.security import generate_token

        meta = await self.metadata()
        state, nonce, verifier = generate_token(32), generate_token(32), generate_token(64)
        client = self._client(self._redirect_uri(request))
        async with client:
            url, _ = client.create_authorization_url(meta["authorization_endpoint"], state=state, code_verifier=verifier,
                                                     nonce=nonce)
        resp = web.HTTPFound(url)
        resp.set_cookie(FLOW_COOKIE, self._seal({"s": state, "n": nonce, "v": verifier, "exp": int(time.time()) + FLOW_AGE}),
                        max_age=FLOW_AGE, path="/admin/oidc", httponly=True, samesite="Lax", secure=request.secure)
        return resp

    async def finish(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        """The callback: ``(who, claims)`` of a verified admin.

        Raises:
            SignInFailed: refused at the provider, no or a stale flow cookie, a state that does not match, an ID
                token that does not verify.
            SignInNotAdmin: the role claim does not hold the admin value.
            SignInProviderFailed: the provider cannot be reached.
        """
        q = request.query
        if "error" in q:
            raise SignInFailed(f"the OpenID Connect provider refused the sign-in: {q.get('error')}"
                               + (f" ({q['error_description']})" if q.get("error_description") else ""))
        flow = self._unseal(request.cookies.get(FLOW_COOKIE, ""), time.time())
        if flow is None:
            raise SignInFailed("the sign-in took longer than 10 minutes or began in another browser: sign in again")
        if not hmac.compare_digest(str(q.get("state", "")), flow["s"]) or not q.get("code"):
            raise SignInFailed("the provider's answer does not belong to this sign-in (its state differs): sign in again")
        meta = await self.metadata()
        client = self._client(self._redirect_uri(request))
        try:
            async with client:
                token = await client.fetch_token(meta["token_endpoint"], grant_type="authorization_code", code=q["code"],
                                                 code_verifier=flow["v"])
        except Exception as e:  # authlib's OAuthError (the provider refused the code), httpx2's errors
            raise SignInFailed(f"the OpenID Connect provider did not exchange the code: {e}") from None
        if "id_token" not in token:
            raise SignInFailed("the OpenID Connect provider sent no ID token (is 'openid' among --admin-oidc-scopes?)")
        claims = await self._verify(token, flow["n"], meta)
        if self.role_claim not in claims and meta.get("userinfo_endpoint"):
            claims = {**await self._userinfo(meta["userinfo_endpoint"], token), **claims}
        who = str(claims.get("email") or claims.get("preferred_username") or claims["sub"])[:200]
        if not self._is_admin(claims.get(self.role_claim)):
            log.info("admin_oidc_refused", who=who, claim=self.role_claim)
            raise SignInNotAdmin(f"{who} signed in, but is no admin of this page: its '{self.role_claim}' claim does not "
                                 f"hold '{self.admin_value}' (ask for that group, or sign in with an admin key)")
        log.info("admin_oidc_signed_in", who=who, sub=claims["sub"])
        return who, claims

    async def _verify(self, token: dict[str, Any], nonce: str, meta: dict[str, Any]) -> dict[str, Any]:
        from authlib.oidc.core import CodeIDToken
        from joserfc import jwt
        from joserfc.errors import InvalidKeyIdError
        from joserfc.jwk import KeySet
        from joserfc.jws import JWSRegistry

        algs = meta.get("id_token_signing_alg_values_supported") or ["RS256"]
        registry = JWSRegistry(algorithms=[a for a in algs if a != "none"], strict_check_header=False)
        try:
            try:
                keys = (await self.metadata(keys=True))["jwks"]
                decoded = jwt.decode(token["id_token"], KeySet.import_key_set(keys), registry=registry)
            except InvalidKeyIdError:  # the provider rolled its keys: read them again
                keys = (await self.metadata(keys=True, force=True))["jwks"]
                decoded = jwt.decode(token["id_token"], KeySet.import_key_set(keys), registry=registry)
            claims = CodeIDToken(decoded.claims, decoded.header, {"iss": {"values": [meta["issuer"]]}},
                                 {"nonce": nonce, "client_id": self.client_id, "access_token": token.get("access_token")})
            claims.validate(leeway=120)
        except VllamaError:
            raise
        except Exception as e:  # joserfc's JoseError (signature, claims), a malformed token or key set
            raise SignInFailed(f"the ID token did not verify: {e!r}") from None
        return dict(claims)

    async def _userinfo(self, url: str, token: dict[str, Any]) -> dict[str, Any]:
        from authlib.integrations.httpx_client import AsyncOAuth2Client

        try:
            async with AsyncOAuth2Client(self.client_id, token=token, timeout=15.0) as c:
                r = await c.get(url)
                r.raise_for_status()
                body = r.json()
        except Exception as e:
            raise SignInProviderFailed(f"the OpenID Connect provider's userinfo did not answer: {e}") from None
        return body if isinstance(body, dict) else {}

    def _is_admin(self, value: Any) -> bool:
        if isinstance(value, str):
            return value == self.admin_value or self.admin_value in value.split()
        if isinstance(value, (list, tuple)):
            return self.admin_value in [str(v) for v in value]
        return False


def _of(request: web.Request) -> OidcSignIn | None:
    return request.app.get(admin.OIDC)  # type: ignore[return-value]


async def login(request: web.Request) -> web.StreamResponse:
    """``GET /admin/oidc/login``: to the provider (the sign-in form with the reason when it cannot be reached, or
    404 when no provider is set)."""
    oidc = _of(request)
    if oidc is None:
        return admin.sign_in_form(request, SignInFailed("no OpenID Connect provider is set on this server (--admin-oidc-issuer)"),
                                  status=404)
    try:
        return await oidc.start(request)
    except VllamaError as e:
        return admin.sign_in_form(request, e)


async def callback(request: web.Request) -> web.StreamResponse:
    """``GET /admin/oidc/callback``: the page's sign-in cookie for an admin and on to ``/admin``; the sign-in form
    with the reason for anyone else."""
    oidc = _of(request)
    if oidc is None:
        return admin.sign_in_form(request, SignInFailed("no OpenID Connect provider is set on this server (--admin-oidc-issuer)"),
                                  status=404)
    try:
        who, _ = await oidc.finish(request)
    except VllamaError as e:
        resp = admin.sign_in_form(request, e)
        resp.del_cookie(FLOW_COOKIE, path="/admin/oidc")
        return resp
    # a page that moves on to /admin by itself: the redirect from the provider is a cross-site navigation, which
    # would not carry the SameSite=Strict cookie to /admin; this page's own refresh is same-site and does
    resp = admin.html_page("vllama: signed in", f'<p>Signed in as {html.escape(who)}: <a href="/admin">to the admin page</a></p>',
                           head='<meta http-equiv="refresh" content="0;url=/admin">')
    admin.set_oidc_cookie(resp, oidc, who, request.secure)
    resp.del_cookie(FLOW_COOKIE, path="/admin/oidc")
    return resp
