"""``/admin`` in a real browser (issue 39): Playwright driving Debian's Chromium, as
``tests/test_open_webui.py`` does (the driver from pip, never ``playwright install``; the browser
from ``apt-get install chromium``; ``.ci/run`` installs both).

``vllama serve --upstream`` over the stand-in vLLM with a keys file: the sign-in form refuses a
user key, takes an admin key (an HttpOnly, SameSite=Strict cookie, no key in any URL), and the
page shows the requests made during the test: the key's tokens, today's table, the failed request.
"""

from __future__ import annotations

import importlib.util
import os

import httpx
import ollama
import pytest

from conftest import SERVED, start_proxy, stop, write_keys

CHROMIUM = os.environ.get("VLLAMA_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
pytestmark = [
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="no playwright in this venv (pip install playwright; the browser is Debian's chromium)"),
]
ADMIN, ALICE = "sk-admin-page", "sk-alice-page"
KEYS = [
    {"name": "ops", "key": ADMIN, "role": "admin"},
    {"name": "alice", "key": ALICE, "budget_tokens": 1000},
]


def test_the_admin_page_in_a_browser(fake, tmp_path):
    from playwright import sync_api

    write_keys(tmp_path / "keys.toml", *KEYS)
    p = start_proxy(fake.url, "--api-key-file", str(tmp_path / "keys.toml"), "--workers", "1",
                    env={"VLLAMA_STATE_DIR": str(tmp_path / "state")}, log=tmp_path / "vllama.log")
    try:
        alice = ollama.Client(host=p.url, headers={"Authorization": f"Bearer {ALICE}"})
        answer = alice.generate(model=SERVED, prompt="hello admin", stream=False)
        with pytest.raises(ollama.ResponseError):
            alice.generate(model=SERVED, prompt="[[fault:http400]]", stream=False)
        # scripts send the key as a bearer token; a user's is refused, and so is a sign-in posted from another site
        assert httpx.get(p.url + "/admin", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 403
        assert httpx.get(p.url + "/admin", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        cross = httpx.post(p.url + "/admin/login", data={"key": ADMIN}, headers={"Origin": "http://evil.example"})
        assert cross.status_code == 403 and "set-cookie" not in cross.headers

        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(p.url + "/admin")
                page.fill("input[name=key]", ALICE)  # a user key: refused
                with page.expect_response(p.url + "/admin/login") as refused:
                    page.click("button[type=submit]")
                assert refused.value.status == 403
                assert "may not open the admin page" in page.content()
                assert page.context.cookies() == []

                page.goto(p.url + "/admin")
                page.fill("input[name=key]", ADMIN)
                page.click("button[type=submit]")
                page.wait_for_selector("text=Signed in as")
                assert page.url == p.url + "/admin"  # no key in any URL
                (cookie,) = page.context.cookies()
                assert cookie["name"] == "vllama_admin" and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
                assert ADMIN not in cookie["value"]
                live = page.frame_locator("iframe[title='live data']")  # the data, refreshed in its frame
                text = live.locator("body").inner_text()
                tokens = answer.prompt_eval_count + answer.eval_count
                # the keys table: alice's tokens today and this month, and her budget
                assert f"alice\tuser\t0\t{tokens}\t{tokens}\t" in text and f"{tokens} / 1000 per month" in text
                assert f"alice\t{SERVED}\t2\t1\t" in text  # today: 2 requests, 1 failed
                errors = live.locator("h2:has-text('Recent errors') + table").inner_text()
                assert "alice" in errors and "/api/generate" in errors and "400" in errors
                assert "hello admin" not in page.content()  # never a prompt
                page.click("text=Sign out")
                page.wait_for_selector("input[name=key]")
                assert page.context.cookies() == []
            finally:
                browser.close()
    finally:
        stop(p.proc)


def test_the_admin_page_manages_keys(fake, tmp_path):
    """The page acts: a key created (its secret shown once), scoped, given an expiry, rotated and revoked, each
    destructive action behind a confirmation, each form bound to the sign-in (CSRF), every action in the audit
    log the page shows. The sign-in form does not reload itself (a half-typed key stays: only the live data's
    frame refreshes) and a wrong key answers the form with the reason, not bare JSON."""
    from playwright import sync_api

    write_keys(tmp_path / "keys.toml", *KEYS)
    p = start_proxy(fake.url, "--api-key-file", str(tmp_path / "keys.toml"), "--workers", "1",
                    env={"VLLAMA_STATE_DIR": str(tmp_path / "state")}, log=tmp_path / "vllama.log")
    try:
        sign_in = httpx.get(p.url + "/admin")
        assert 'name="key"' in sign_in.text and "refresh" not in sign_in.text
        live = httpx.get(p.url + "/admin/live", headers={"Authorization": f"Bearer {ADMIN}"})
        assert 'http-equiv="refresh"' in live.text and "frame-ancestors 'self'" in live.headers["Content-Security-Policy"]
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(p.url + "/admin")
                page.fill("input[name=key]", "sk-wrong")
                with page.expect_response(p.url + "/admin/login") as wrong:
                    page.click("button[type=submit]")
                assert wrong.value.status == 401
                assert page.inner_text("p.msg") == "unknown key: sign in with an admin key"
                assert page.is_visible("input[name=key]") and "{" not in page.inner_text("body")

                page.fill("input[name=key]", ADMIN)
                page.click("button[type=submit]")
                page.wait_for_selector("text=Signed in as")
                cookies = {c["name"]: c["value"] for c in page.context.cookies()}

                # create: the secret shown once, and it works
                form = page.locator("form#new-key")
                form.locator("input[name=name]").fill("dev1")
                form.locator("input[name=models]").fill(SERVED)
                form.locator("input[name=rpm]").fill("120")
                form.locator("input[name=note]").fill("first day")
                form.locator("button[type=submit]").click()
                secret = page.inner_text("#secret").strip()
                assert secret.startswith("vk-")
                client = ollama.Client(host=p.url, headers={"Authorization": f"Bearer {secret}"})
                assert client.generate(model=SERVED, prompt="hi", stream=False).done
                page.goto(p.url + "/admin")
                assert secret not in page.content()  # shown once only
                row = page.locator("h2:text-is('Keys') + table tr", has_text="dev1")
                assert "rpm 120" in row.inner_text() and "first day" in row.inner_text()

                # scope and expiry: models changed, an expiry set
                row.locator("input[name=models]").fill("other-model")
                row.locator("input[name=expires_at]").fill("2099-01-01T00:00:00Z")
                row.locator("button[value=update]").click()
                page.wait_for_selector("text=Audit log")
                row = page.locator("h2:text-is('Keys') + table tr", has_text="dev1")
                assert "other-model" in row.inner_text() and "2099-01-01T00:00:00Z" in row.inner_text()
                with pytest.raises(ollama.ResponseError) as refused:
                    client.generate(model=SERVED, prompt="hi", stream=False)
                assert refused.value.status_code == 403

                # rotate: confirmation first (the browser will not send the form unticked), then a new secret
                row.locator("form[action$='/rotate'] button").click()
                assert page.locator("form[action$='/rotate'] input[name=confirm]").evaluate("e => !e.validity.valid")
                row.locator("form[action$='/rotate'] input[name=confirm]").check()
                row.locator("form[action$='/rotate'] button").click()
                rotated = page.inner_text("#secret").strip()
                assert rotated.startswith("vk-") and rotated != secret
                with pytest.raises(ollama.ResponseError) as refused:
                    client.generate(model=SERVED, prompt="hi", stream=False)
                assert refused.value.status_code == 401

                # revoke, confirmed
                page.goto(p.url + "/admin")
                row = page.locator("h2:text-is('Keys') + table tr", has_text="dev1")
                row.locator("form[action$='/revoke'] input[name=confirm]").check()
                row.locator("form[action$='/revoke'] button").click()
                page.wait_for_selector("text=Audit log")
                assert "revoked" in page.locator("h2:text-is('Keys') + table tr", has_text="dev1").inner_text()
                audit = page.inner_text("h2:has-text('Audit log') + table")
                lines = [line.split("\t")[1:4] for line in audit.splitlines()[1:]]
                assert lines == [["ops", "revoke", "dev1"], ["ops", "rotate", "dev1"], ["ops", "update", "dev1"], ["ops", "create", "dev1"]]
                for s in (secret, rotated):
                    assert s not in page.content()
            finally:
                browser.close()

        # CSRF: the cookie alone does not act; nor does a post from another site; unconfirmed revokes are refused
        jar = {"vllama_admin": cookies["vllama_admin"]}
        r = httpx.post(p.url + "/admin/keys", data={"name": "evil", "role": "admin"}, cookies=jar)
        assert r.status_code == 403 and "token" in r.text
        r = httpx.post(p.url + "/admin/keys", data={"name": "evil"}, cookies=jar, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        token = httpx.get(p.url + "/admin", cookies=jar).text.split('name="csrf" value="')[1].split('"')[0]
        r = httpx.post(p.url + "/admin/keys", data={"name": "ok1", "csrf": token}, cookies=jar)
        assert r.status_code == 200 and "shown this once" in r.text
        r = httpx.post(p.url + "/admin/keys/ok1/revoke", data={"csrf": token}, cookies=jar)
        assert r.status_code == 400 and "tick" in r.text
        names = [k["name"] for k in httpx.get(p.url + "/api/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()["keys"]]
        assert "evil" not in names
    finally:
        stop(p.proc)
    log = (tmp_path / "vllama.log").read_bytes()
    assert secret.encode() not in log and rotated.encode() not in log
