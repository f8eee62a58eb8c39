"""Minted keys on two fronts sharing one PostgreSQL (``--usage-db postgresql://...``, ``api/key_store.py``): a key
minted on one front works on the other without SIGHUP, and once revoked or expired it is refused by both, the
revocation within about a second (``key_store.POLL_SECONDS``), the expiry at once. PostgreSQL is started as
``test_usage_postgres.py`` starts it (its ``postgres`` fixture); skipped where that one is.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest import start_proxy, stop, write_keys
from test_keys_api import ADMIN, KEYS, _h, wait_status
from test_usage_postgres import pytestmark, postgres  # noqa: F401  (the fixture, and its skips)


def test_a_revoked_or_expired_key_is_refused_by_every_front(fake, postgres, tmp_path):  # noqa: F811
    write_keys(tmp_path / "keys.toml", *KEYS)
    flags = ("--usage-db", postgres, "--workers", "2", "--api-key-file", str(tmp_path / "keys.toml"))
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda name: start_proxy(fake.url, *flags, env={"VLLAMA_STATE_DIR": str(tmp_path / name)},
                                                 log=tmp_path / f"{name}.log"), ["a", "b"])
    try:
        made = httpx.post(a.url + "/api/keys", headers=_h(ADMIN), json={"name": "dana", "expires_in": "1h"})
        assert made.status_code == 200, made.text
        dana = made.json()["secret"]
        wait_status(b.url, dana, 200)  # front b learned of it from the database
        assert [k["name"] for k in httpx.get(b.url + "/api/keys", headers=_h(ADMIN)).json()["keys"] if k["source"] == "api"] == ["dana"]

        httpx.post(b.url + "/api/keys/dana/revoke", headers=_h(ADMIN)).raise_for_status()
        took = wait_status(a.url, dana, 401)
        assert took < 5, f"front a refused the revoked key only after {took:.1f} s"
        wait_status(b.url, dana, 401)

        eve = httpx.post(a.url + "/api/keys", headers=_h(ADMIN), json={"name": "eve", "expires_in": "4s"}).json()["secret"]
        wait_status(b.url, eve, 200, streak=2)
        wait_status(a.url, eve, 401)
        wait_status(b.url, eve, 401)
        audit = httpx.get(a.url + "/api/keys/audit", headers=_h(ADMIN)).json()["audit"]
        assert [(x["action"], x["key"]) for x in audit] == [("create", "eve"), ("revoke", "dana"), ("create", "dana")]
    finally:
        stop(a.proc)
        stop(b.proc)
    for name in ("a", "b"):
        assert dana.encode() not in (tmp_path / f"{name}.log").read_bytes()
    import psycopg

    with psycopg.connect(postgres) as conn:  # the database holds its hash and prefix, never the secret
        rows = conn.execute("SELECT name, prefix, sha256, spec, note FROM vllama_keys").fetchall()
        text = repr(rows) + repr(conn.execute("SELECT * FROM vllama_keys_audit").fetchall())
    assert {r[0] for r in rows} == {"dana", "eve"}
    for secret in (dana, eve):
        assert secret not in text and secret.split("-", 2)[2] not in text
