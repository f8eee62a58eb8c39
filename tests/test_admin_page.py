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
                text = page.inner_text("body")
                tokens = answer.prompt_eval_count + answer.eval_count
                # the keys table: alice's tokens today and this month, and her budget
                assert f"alice\tuser\t0\t{tokens}\t{tokens}\t" in text and f"{tokens} / 1000 per month" in text
                assert f"alice\t{SERVED}\t2\t1\t" in text  # today: 2 requests, 1 failed
                errors = page.inner_text("h2:has-text('Recent errors') + table")
                assert "alice" in errors and "/api/generate" in errors and "400" in errors
                assert "hello admin" not in page.content()  # never a prompt
                page.click("text=Sign out")
                page.wait_for_selector("input[name=key]")
                assert page.context.cookies() == []
            finally:
                browser.close()
    finally:
        stop(p.proc)
