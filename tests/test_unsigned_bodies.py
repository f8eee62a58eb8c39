"""What someone without a key can make vllama read, and a sign-out that holds: every body is read through one
bounded reader (``api/request/body_reader.py``), counted as aiohttp inflates it and given up past its route's limit, within
``--body-timeout``; ``/admin/login`` takes a few KB. Before, ``/admin/login`` read its form with ``request.post()``
(three 122 KB gzip bodies inflating to 120 MiB each took the proxy from 91 to 931 MiB), a body trickled there
stayed open past ``--body-timeout``, the small-body routes checked the inflated size only after inflating all of it,
and the admin cookie still opened ``/admin`` after ``POST /admin/logout``.
"""

from __future__ import annotations

import gzip
import socket
import time

import httpx
import psutil
import pytest

from conftest import SERVED, start_proxy, stop

ADMIN = "sk-unsigned-admin"
KEYS = f'[[keys]]\nname = "ops"\nkey = "{ADMIN}"\nrole = "admin"\n'
#: 120 MiB of zeros, gzipped: about 122 KB on the wire.
BOMB = gzip.compress(b"\0" * (120 << 20), compresslevel=9)


@pytest.fixture
def proxy(fake, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    s = start_proxy(fake.url, "--api-key-file", str(keys), "--workers", "1", "--body-timeout", "2",
                    "--max-body-size", str(16 << 20),
                    env={"VLLAMA_STATE_DIR": str(tmp_path / "state")}, log=tmp_path / "vllama.log")
    yield s
    stop(s.proc)


@pytest.mark.parametrize(("path", "auth"), [("/admin/login", False), ("/api/show", True), ("/api/chat", True)])
def test_a_gzip_bomb_is_refused_at_its_routes_limit_without_being_inflated(proxy, path, auth):
    rss = psutil.Process(proxy.proc.pid)
    before = rss.memory_info().rss
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/x-www-form-urlencoded" if not auth else "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {ADMIN}"
    for _ in range(3):
        r = httpx.post(proxy.url + path, content=BOMB, headers=headers, timeout=60)
        assert r.status_code == 413, (r.status_code, r.text[:200])
    assert rss.memory_info().rss - before < 64 << 20  # three bombs of 120 MiB: not one of them held


def test_a_body_trickled_to_the_sign_in_ends_at_the_body_timeout(proxy):
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /admin/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                  b"Content-Length: 1000\r\n\r\nkey=")
        s.settimeout(60)
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer:
            s.sendall(b"a")  # one byte now and then: the whole body never arrives
            try:
                s.settimeout(0.5)
                answer += s.recv(4096)
            except TimeoutError:
                assert time.monotonic() - started < 30, "the trickle was never cut"
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]


def test_a_sign_out_ends_the_sign_in_on_the_server(proxy):
    with httpx.Client(base_url=proxy.url, follow_redirects=False) as browser:
        r = browser.post("/admin/login", data={"key": ADMIN})
        assert r.status_code == 303
        cookie = r.cookies["vllama_admin"]
        assert 'action="/admin/login"' not in browser.get("/admin").text  # signed in: the page, not the form
        assert browser.post("/admin/logout").status_code == 303
    replay = httpx.get(proxy.url + "/admin", cookies={"vllama_admin": cookie})  # the cookie kept, sent again
    assert replay.status_code == 200 and 'action="/admin/login"' in replay.text  # the sign-in form: the cookie is void
    r = httpx.post(proxy.url + "/admin/login", data={"key": "x" * 5000})
    assert r.status_code == 413


def test_the_sign_in_reads_its_form(proxy):
    r = httpx.post(proxy.url + "/admin/login", data={"key": "wrong"}, follow_redirects=False)
    assert r.status_code == 401
    assert httpx.post(proxy.url + "/api/show", json={"model": SERVED}, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
