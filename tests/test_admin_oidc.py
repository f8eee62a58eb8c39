"""Signing in to ``/admin`` through OpenID Connect (``api/routes/admin_oidc.py``), in Debian's Chromium driven by
Playwright (as ``tests/test_admin_page.py``), against a real OpenID Connect provider the test starts in a thread:
``oidc-provider-mock`` (authlib's provider behind Flask: discovery, an authorization form, code exchange, RS256 ID
tokens from its published keys, userinfo).

An admin (``groups`` holds ``vllama-admin``) signs in by the authorization code flow with PKCE, state and nonce, gets
the page's own cookie, mints a key through the page's CSRF-bound form and is named in the audit log by their e-mail
address; someone without the group gets the sign-in form with the reason (403), not a 500; a forged or replayed
callback is refused; the client secret is never in the log.
"""

from __future__ import annotations

import importlib.util
import urllib.parse

import httpx
import pytest

from conftest import start_proxy, stop, write_keys
from test_admin_page import CHROMIUM, CHROMIUM_ARGS, pytestmark as browser_marks

pytestmark = [*browser_marks, pytest.mark.skipif(importlib.util.find_spec("oidc_provider_mock") is None,
                                                 reason="no oidc-provider-mock (pip install 'vllama-proxy[test]')")]
ADMIN = "sk-admin-oidc"
CLIENT_SECRET = "oidc-client-secret-never-logged"


@pytest.fixture
def provider():
    from oidc_provider_mock import User, run_server_in_thread

    users = [User(sub="ana-sub", claims={"email": "ana@example.com", "groups": ["staff", "vllama-admin"]}),
             User(sub="bo-sub", claims={"email": "bo@example.com", "groups": ["staff"]})]
    with run_server_in_thread(user_claims=users, require_nonce=True) as server:
        yield f"http://localhost:{server.server_port}"


def test_an_admin_signs_in_through_openid_connect_and_a_non_admin_is_told_why(fake, tmp_path, provider):
    from playwright import sync_api

    write_keys(tmp_path / "keys.toml", {"name": "ops", "key": ADMIN, "role": "admin"})
    # two workers: the flow keeps no state in a worker (its cookie carries it), the secret reaches each
    p = start_proxy(fake.url, "--api-key-file", str(tmp_path / "keys.toml"), "--workers", "2",
                    env={"VLLAMA_STATE_DIR": str(tmp_path / "state"), "VLLAMA_ADMIN_OIDC_ISSUER": provider,
                         "VLLAMA_ADMIN_OIDC_CLIENT_ID": "vllama", "VLLAMA_ADMIN_OIDC_CLIENT_SECRET": CLIENT_SECRET},
                    log=tmp_path / "vllama.log")
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                # the provider's page links a stylesheet on a CDN: nothing leaves loopback
                page.context.route("**/*", lambda route: route.continue_()
                                   if urllib.parse.urlsplit(route.request.url).hostname in ("127.0.0.1", "localhost")
                                   else route.abort())
                asked: list[str] = []
                page.on("request", lambda r: asked.append(r.url) if "/oauth2/authorize" in r.url else None)
                page.goto(p.url + "/admin")
                page.click("#oidc-sign-in")
                page.wait_for_selector("text=Authorize Client")  # the provider's own page
                page.click("button[name=sub][value=ana-sub]")
                page.wait_for_selector("text=Signed in as")
                assert page.url == p.url + "/admin"
                assert "ana@example.com (OpenID Connect)" in page.inner_text("body")
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(asked[0]).query)
                assert query["code_challenge_method"] == ["S256"] and len(query["code_challenge"][0]) == 43
                assert query["state"][0] and query["nonce"][0] and query["redirect_uri"] == [p.url + "/admin/oidc/callback"]
                cookies = {c["name"]: c for c in page.context.cookies()}
                assert cookies["vllama_admin"]["httpOnly"] and cookies["vllama_admin"]["sameSite"] == "Strict"
                assert "vllama_oidc" not in cookies  # the flow's cookie is gone once used

                # the page acts for the person as for a key's sign-in: CSRF-bound forms, the audit log names them
                form = page.locator("form#new-key")
                form.locator("input[name=name]").fill("dev-oidc")
                form.locator("input[name=trusted_front]").check()  # a minted key can be a trusted front (KeySettings)
                form.locator("input[name=user_max_in_flight]").fill("2")
                form.locator("button[type=submit]").click()
                assert page.inner_text("#secret").strip().startswith("vk-")
                page.goto(p.url + "/admin")
                row = page.locator("h2:text-is('Keys') + table tr", has_text="dev-oidc").inner_text()
                assert "trusted front, per user in flight 2" in row, row
                audit = page.inner_text("h2:has-text('Audit log') + table")
                assert audit.splitlines()[1].split("\t")[1:4] == ["ana@example.com", "create", "dev-oidc"]
                jar = {"vllama_admin": cookies["vllama_admin"]["value"]}
                r = httpx.post(p.url + "/admin/keys", data={"name": "evil"}, cookies=jar)  # the cookie alone: no token
                assert r.status_code == 403 and "token" in r.text

                # a callback that is not this browser's own sign-in: refused with the form, no cookie
                forged = page.request.get(p.url + "/admin/oidc/callback?code=x&state=y")
                assert forged.status == 401 and "sign in again" in forged.text()

                page.click("text=Sign out")
                page.wait_for_selector("#oidc-sign-in")
                assert "vllama_admin" not in {c["name"] for c in page.context.cookies()}
                assert httpx.get(p.url + "/admin", cookies=jar).text.count('name="key"') == 1  # signed out everywhere

                # someone whose groups do not hold vllama-admin: the sign-in form with the reason, 403
                page.click("#oidc-sign-in")
                page.wait_for_selector("text=Authorize Client")
                with page.expect_response(lambda r: r.url.startswith(p.url + "/admin/oidc/callback")) as refused:
                    page.click("button[name=sub][value=bo-sub]")
                assert refused.value.status == 403
                message = page.inner_text("p.msg")
                assert "bo@example.com" in message and "'groups'" in message and "vllama-admin" in message, message
                assert page.is_visible("input[name=key]")
                assert "vllama_admin" not in {c["name"] for c in page.context.cookies()}
            finally:
                browser.close()
    finally:
        stop(p.proc)
    log = (tmp_path / "vllama.log").read_text()
    assert CLIENT_SECRET not in log
    assert "admin_oidc_signed_in" in log and "admin_oidc_refused" in log


def test_openid_connect_settings_are_checked_at_start():
    from vllama_proxy.settings import Settings

    with pytest.raises(ValueError, match="needs --admin-oidc-client-id and a client secret"):
        Settings(admin_oidc_issuer="https://id.example.com", admin_oidc_client_id="vllama")
    with pytest.raises(ValueError, match="must end in /admin/oidc/callback"):
        Settings(admin_oidc_issuer="https://id.example.com", admin_oidc_client_id="v", admin_oidc_client_secret="s",
                 admin_oidc_redirect_url="https://vllama.example.com/elsewhere")
    s = Settings(admin_oidc_issuer="https://id.example.com/", admin_oidc_client_id="v", admin_oidc_client_secret="s")
    assert s.admin_oidc_issuer == "https://id.example.com" and s.admin_oidc_secret() == "s"
    assert "s" not in repr(s.admin_oidc_client_secret)


def test_a_provider_that_does_not_answer_gives_the_sign_in_form_with_the_reason(fake, tmp_path):
    from conftest import free_port

    write_keys(tmp_path / "keys.toml", {"name": "ops", "key": ADMIN, "role": "admin"})
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    p = start_proxy(fake.url, "--api-key-file", str(tmp_path / "keys.toml"), "--workers", "1",
                    env={"VLLAMA_STATE_DIR": str(tmp_path / "state"), "VLLAMA_ADMIN_OIDC_ISSUER": gone,
                         "VLLAMA_ADMIN_OIDC_CLIENT_ID": "vllama", "VLLAMA_ADMIN_OIDC_CLIENT_SECRET": CLIENT_SECRET})
    try:
        r = httpx.get(p.url + "/admin/oidc/login", timeout=60)  # its first sign-in imports authlib: seconds on a busy machine
        assert r.status_code == 502 and "did not answer" in r.text and 'name="key"' in r.text, r.text
        r = httpx.get(p.url + "/admin/oidc/callback?code=x&state=y", timeout=60)  # no flow cookie: refused before any call out
        assert r.status_code == 401 and "sign in again" in r.text
    finally:
        stop(p.proc)
