"""Keys without editing a file: ``/api/keys`` (``api/routes/keys.py``, ``api/key_store.py``) and ``vllama keys``.

A server with a keys file (``ops``, an admin; ``alice``, a user) and two workers over the stand-in vLLM, driven by
the real ``ollama`` client: a key minted through the API works in every worker without SIGHUP, its scope and
limits hold, a rotated or revoked secret and an expired key are refused, the keys file's keys are listed
read-only, every mistake is Ollama's ``{"error"}`` with its 4xx, and no secret is in the log, the page or the
database in clear.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import ollama
import pytest

from conftest import ROOT, SERVED, start_proxy, stop, write_keys

ADMIN, ALICE = "sk-ops-keys", "sk-alice-keys"
KEYS = [{"name": "ops", "key": ADMIN, "role": "admin"}, {"name": "alice", "key": ALICE}]


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _status(url: str, key: str) -> int:
    """The status of one small generate with ``key``."""
    return httpx.post(url + "/api/generate", json={"model": SERVED, "prompt": "hi", "stream": False, "options": {"num_predict": 1}},
                      headers=_h(key), timeout=30).status_code


def wait_status(url: str, key: str, want: int, *, timeout: float = 20.0, streak: int = 8) -> float:
    """Seconds until ``streak`` requests in a row (spread over the workers) answer ``want`` with ``key``; fails
    after ``timeout``. Waits on what every worker answers, not on a sleep."""
    start = time.monotonic()
    seen = 0
    while time.monotonic() - start < timeout:
        seen = seen + 1 if _status(url, key) == want else 0
        if seen >= streak:
            return time.monotonic() - start
    pytest.fail(f"{key[:10]}... did not answer {want} {streak} times in a row within {timeout} s")


@pytest.fixture
def server(fake, tmp_path):
    write_keys(tmp_path / "keys.toml", *KEYS)
    p = start_proxy(fake.url, "--api-key-file", str(tmp_path / "keys.toml"), "--workers", "2",
                    env={"VLLAMA_STATE_DIR": str(tmp_path / "state")}, log=tmp_path / "vllama.log")
    yield p
    stop(p.proc)


def test_keys_minted_scoped_rotated_revoked_and_expired_without_a_file(server, tmp_path):
    url = server.url
    # only an admin manages keys; the keys file's are listed read-only
    assert httpx.get(url + "/api/keys").status_code == 401
    r = httpx.get(url + "/api/keys", headers=_h(ALICE))
    assert r.status_code == 403 and "manage keys" in r.json()["error"]
    listed = httpx.get(url + "/api/keys", headers=_h(ADMIN)).json()["keys"]
    assert [(k["name"], k["source"], k["read_only"]) for k in listed] == [("alice", "file", True), ("ops", "file", True)]

    made = httpx.post(url + "/api/keys", headers=_h(ADMIN),
                      json={"name": "bob", "models": [SERVED], "rpm": 600, "expires_in": "1h", "note": "bob's laptop"})
    assert made.status_code == 200, made.text
    bob = made.json()["secret"]
    entry = made.json()["key"]
    assert bob.startswith(f"vk-{entry['prefix']}-") and len(bob) > 40
    assert entry["state"] == "active" and entry["created_by"] == "ops" and entry["rpm"] == 600 and entry["expires_at"]
    wait_status(url, bob, 200)  # every worker knows bob, no SIGHUP
    answer = ollama.Client(host=url, headers=_h(bob)).generate(model=SERVED, prompt="hi", stream=False)
    assert answer.done

    # mistakes: Ollama's shape, the right 4xx
    def err(method: str, path: str, want: int, **kw) -> str:
        r = httpx.request(method, url + path, headers=_h(ADMIN), **kw)
        assert r.status_code == want, r.text
        return r.json()["error"]

    assert "exists already" in err("POST", "/api/keys", 409, json={"name": "bob"})
    assert "keys file" in err("POST", "/api/keys", 409, json={"name": "alice"})
    assert "keys file" in err("PATCH", "/api/keys/alice", 409, json={"rpm": 5})
    assert "no key 'nobody'" in err("POST", "/api/keys/nobody/rotate", 404)
    assert "rpm" in err("POST", "/api/keys", 400, json={"name": "x", "rpm": 0})
    assert "role" in err("POST", "/api/keys", 400, json={"name": "x", "role": "root"})
    assert "expires_in" in err("POST", "/api/keys", 400, json={"name": "x", "expires_in": "soon"})
    assert "in the past" in err("POST", "/api/keys", 400, json={"name": "x", "expires_at": "2001-01-01T00:00:00Z"})
    assert "keeps its name" in err("PATCH", "/api/keys/bob", 400, json={"name": "robert"})
    assert "name" in err("POST", "/api/keys", 400, json={"role": "user"})

    # scope: bob may no longer use the served model, in every worker
    assert httpx.patch(url + "/api/keys/bob", headers=_h(ADMIN), json={"models": ["other-model"]}).json()["key"]["models"] == ["other-model"]
    wait_status(url, bob, 403)
    httpx.patch(url + "/api/keys/bob", headers=_h(ADMIN), json={"models": []}).raise_for_status()
    wait_status(url, bob, 200)

    # rotate: the old secret is refused everywhere, the new one works
    rotated = httpx.post(url + "/api/keys/bob/rotate", headers=_h(ADMIN)).json()
    new_bob = rotated["secret"]
    assert new_bob != bob and rotated["key"]["prefix"] == new_bob.split("-")[1]
    wait_status(url, bob, 401)
    wait_status(url, new_bob, 200)

    # expiry: refused once its time passes, in every worker at once (the clock, not a reload)
    carol = httpx.post(url + "/api/keys", headers=_h(ADMIN), json={"name": "carol", "expires_in": "3s"}).json()["secret"]
    wait_status(url, carol, 200, streak=2)
    wait_status(url, carol, 401)
    states = {k["name"]: k["state"] for k in httpx.get(url + "/api/keys", headers=_h(ADMIN)).json()["keys"]}
    assert states["carol"] == "expired"

    # revoke (DELETE): refused everywhere; the row stays, revoked
    assert httpx.delete(url + "/api/keys/bob", headers=_h(ADMIN)).json()["key"]["state"] == "revoked"
    wait_status(url, new_bob, 401)
    assert "revoked" in err("DELETE", "/api/keys/bob", 404)

    # the audit log: who, what, when
    audit = httpx.get(url + "/api/keys/audit", headers=_h(ADMIN)).json()["audit"]
    assert [(a["who"], a["action"], a["key"]) for a in audit[:3]] == [("ops", "revoke", "bob"), ("ops", "create", "carol"),
                                                                       ("ops", "rotate", "bob")]
    assert all(a["time"].endswith("Z") for a in audit)

    # no secret in clear: not in the log, the page, the database (its hash is)
    page = httpx.get(url + "/admin", headers=_h(ADMIN)).text + httpx.get(url + "/admin/live", headers=_h(ADMIN)).text
    assert "bob" in page and "carol" in page
    stop(server.proc)
    log = (tmp_path / "vllama.log").read_bytes()
    db = b"".join(p.read_bytes() for p in (tmp_path / "state").glob("usage.sqlite3*"))
    assert b"bob's laptop" in db  # the database was read
    for secret in (bob, new_bob, carol):
        for where, text in (("log", log), ("database", db), ("page", page.encode())):
            assert secret.encode() not in text, f"a secret in the {where}"
            assert secret.split("-", 2)[2].encode() not in text, f"a secret's random part in the {where}"


def test_first_key_of_an_open_server_is_an_admin(fake, tmp_path):
    p = start_proxy(fake.url, "--workers", "1", env={"VLLAMA_STATE_DIR": str(tmp_path / "state")})
    try:
        r = httpx.post(p.url + "/api/keys", json={"name": "u"})
        assert r.status_code == 400 and "first key must be an admin" in r.json()["error"]
        root = httpx.post(p.url + "/api/keys", json={"name": "root", "role": "admin"}).json()["secret"]
        assert httpx.get(p.url + "/api/keys").status_code == 401  # no longer open
        assert httpx.get(p.url + "/api/keys", headers=_h(root)).status_code == 200
    finally:
        stop(p.proc)


def test_usage_db_off_says_so(fake, tmp_path):
    p = start_proxy(fake.url, "--workers", "1", "--usage-db", "off", env={"VLLAMA_STATE_DIR": str(tmp_path / "state")})
    try:
        r = httpx.post(p.url + "/api/keys", json={"name": "root", "role": "admin"})
        assert r.status_code == 501 and "--usage-db off" in r.json()["error"]
    finally:
        stop(p.proc)


def test_vllama_keys_cli(server):
    url = server.url

    def cli(key: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "OLLAMA_HOST": url, "OLLAMA_API_KEY": key, "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-m", "vllama_proxy", "keys", *args], env=env, capture_output=True, text=True, timeout=60)
        assert (r.returncode == 0) == ok, r.stderr
        return r

    made = cli(ADMIN, "create", "bob", "--models", f"{SERVED},other*", "--rpm", "600", "--expires-in", "7d", "--note", "bob")
    secret = made.stdout.splitlines()[-1]
    assert secret.startswith("vk-") and "shown this once" in made.stderr
    assert made.stdout.splitlines()[0].split()[:3] == ["NAME", "SOURCE", "STATE"]
    wait_status(url, secret, 200)
    listed = cli(ADMIN, "list").stdout.splitlines()
    bob = next(line.split() for line in listed if line.startswith("bob"))
    assert bob[1:5] == ["api", "active", secret.split("-")[1], "user"] and bob[5] == f"{SERVED},other*" and "rpm=600" in bob
    assert any(line.split()[:3] == ["alice", "file", "active"] for line in listed)
    assert cli(ADMIN, "update", "bob", "--rpm", "60", "--json").stdout.count('"rpm": 60') == 1
    new = cli(ADMIN, "rotate", "bob").stdout.splitlines()[-1]
    assert new.startswith("vk-") and new != secret
    wait_status(url, secret, 401)
    wait_status(url, new, 200)
    cli(ADMIN, "revoke", "bob")
    wait_status(url, new, 401)
    assert "Error: no key 'bob' to revoke" in cli(ADMIN, "revoke", "bob", ok=False).stderr
    assert "may not manage keys" in cli(ALICE, "list", ok=False).stderr
    audit = cli(ADMIN, "audit").stdout.splitlines()
    assert [line.split()[1:4] for line in audit[1:5]] == [["ops", "revoke", "bob"], ["ops", "rotate", "bob"],
                                                          ["ops", "update", "bob"], ["ops", "create", "bob"]]


def test_the_keys_file_and_the_admin_api_take_one_model_of_a_key(tmp_path):
    """``KeySettings`` is the one definition of a key's settable fields: the keys file's entry adds only the secret,
    the API's body only ``expires_in``; so the file takes ``expires_at`` and ``note`` as a minted key does (a TOML
    date-time; one without a zone is UTC) and an expired file key is refused like an expired minted one."""
    from vllama_proxy.api.policy.keys import KeyEntry, KeyRing, KeySettings
    from vllama_proxy.api.routes.keys import KeyFields

    assert set(KeyEntry.model_fields) - {"key", "sha256"} == set(KeySettings.model_fields)
    assert set(KeyFields.model_fields) - {"expires_in"} == set(KeySettings.model_fields)
    f = tmp_path / "keys.toml"
    f.write_text('[[keys]]\nname = "old"\nkey = "sk-old"\nexpires_at = 2001-01-01T00:00:00Z\n\n'
                 '[[keys]]\nname = "new"\nkey = "sk-new"\nexpires_at = 2099-01-01T00:00:00\nnote = "until 2099"\n'
                 'trusted_front = true\nuser_rpm = 5\n')
    ring = KeyRing([], f)
    assert ring.find(b"sk-old") is None
    new = ring.find(b"sk-new")
    assert new is not None and new.expires_at == 4070908800.0 and new.note == "until 2099"
    assert new.trusted_front and new.user_rpm == 5 and new.user_header == "X-OpenWebUI-User-Id"
