"""No tenant reads another's prompts through vLLM's prefix cache (``--cache-isolation``, api/policy/cache_salt.py).

vLLM shares cached KV blocks between any requests whose prompts begin alike, so a key timing its own
requests would learn what another key sent. With a keys file every request made with a key reaches vLLM
with that key's ``cache_salt`` (vLLM mixes it into a prompt's first block: different salts share no
block), on every route that generates or embeds; a client's own salt is combined with its key's.

``vllama serve --upstream`` over the stand-in vLLM (``tests/fake_vllm.py``, whose prefix cache honours
``cache_salt`` as vLLM's does and whose ``/_fake/requests`` shows each body received), a keys file with
an admin and two users.
"""

from __future__ import annotations

import hashlib
import re

import httpx
import pytest

from conftest import SERVED, log_events, metric, start_proxy, stop, write_keys
from vllama_proxy.api.policy import cache_salt

KEYS = [
    {"name": "root", "key": "sk-root", "role": "admin"},
    {"name": "alice", "key": "sk-alice"},
    {"name": "bob", "sha256": hashlib.sha256(b"sk-bob").hexdigest()},
]
#: Each key's salt as vllama must derive it: from its name, keyed with the SHA-256 of its secret.
SALTS = {k: cache_salt.of_key(k, hashlib.sha256(f"sk-{k}".encode()).hexdigest()) for k in ("root", "alice", "bob")}
CHAT = {"model": SERVED, "max_tokens": 2, "messages": [{"role": "user", "content": "hello there"}]}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{key}"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("keys") / "keys.toml"
    write_keys(p, *KEYS)
    return p


@pytest.fixture(scope="module")
def isolated(fake, keys_file):
    """vllama with the keys file and the default ``--cache-isolation`` over the stand-in vLLM."""
    s = start_proxy(fake.url, "--api-key-file", str(keys_file))
    yield s
    stop(s.proc)


def _salts(received, path: str) -> list:
    return [r["body"].get("cache_salt") for r in received(path)]


def test_each_keys_requests_reach_vllm_with_a_salt_of_its_own_on_every_generating_route(isolated, upstream_requests):
    """The same key gets the same salt on every route and request, another key another; an admin key is salted
    like any (its prompts are no more another tenant's to probe). The salt is the one vllama derives from the
    key's name and secret: the same on every worker, front and restart that read the same keys file."""
    s = isolated
    for key in ("alice", "bob", "root", "alice"):
        h = _auth(key)
        for path, body in (("/api/chat", {"model": SERVED, "stream": False, "messages": [{"role": "user", "content": "hi"}]}),
                           ("/api/generate", {"model": SERVED, "stream": False, "prompt": "hi"}),
                           ("/api/generate", {"model": SERVED, "stream": False, "prompt": "hi", "raw": True}),
                           ("/v1/chat/completions", CHAT),
                           ("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 2, "stream": True}),
                           ("/v1/responses", {"model": SERVED, "input": "hi"}),
                           ("/v1/messages", {"model": SERVED, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(s.url + path, json=body, headers=h, timeout=30)
            assert r.status_code == 200, (path, r.text)
    got = {p: _salts(upstream_requests, p) for p in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")}
    by_key = [SALTS[k] for k in ("alice", "bob", "root", "alice")]
    assert got["/v1/responses"] == got["/v1/messages"] == by_key, got
    # /api/chat, /api/generate (templated), /v1/chat/completions; /api/generate (raw), /v1/completions
    assert got["/v1/chat/completions"] == [s for s in by_key for _ in range(3)], got
    assert got["/v1/completions"] == [s for s in by_key for _ in range(2)], got
    assert len(set(SALTS.values())) == 3 and all(re.fullmatch(r"[0-9a-f]{64}", v) for v in SALTS.values())
    # nothing of the salt is the name or the secret, and knowing a name is not enough to compute it
    assert SALTS["bob"] != cache_salt.of_key("bob", hashlib.sha256(b"bob").hexdigest())


def test_a_clients_own_salt_is_combined_with_its_keys_and_a_bad_one_is_vllms_400(isolated, upstream_requests):
    """A client may split its own cache further (its salt, hashed with its key's) but can neither pick
    another key's salt nor step out of its key's: the same value from another key, or another key's own
    salt sent as its own, gives another salt. A salt vLLM would refuse is refused, never hidden in a hash."""
    s = isolated

    def sent(key: str, salt: object, path: str = "/v1/chat/completions", body: dict = CHAT) -> str:
        r = httpx.post(s.url + path, json={**body, "cache_salt": salt}, headers=_auth(key), timeout=30)
        assert r.status_code == 200, r.text
        return _salts(upstream_requests, path)[-1]

    mine = sent("alice", "project-x")
    assert mine == sent("alice", "project-x") and re.fullmatch(r"[0-9a-f]{64}", mine)
    others = {sent("bob", "project-x"), sent("root", "project-x"), sent("alice", "project-y"), sent("alice", SALTS["bob"]),
              sent("alice", SALTS["alice"]), SALTS["alice"], SALTS["bob"], SALTS["root"], "project-x"}
    assert mine not in others and len(others) == 9
    assert sent("alice", "project-x", "/v1/responses", {"model": SERVED, "input": "hi"}) == mine  # the same on every route
    assert sent("alice", None) == SALTS["alice"]  # null: none of its own
    def asked() -> int:  # requests of clients' that reached vLLM (not vllama's own GETs: /v1/models, /health)
        return sum(r["method"] == "POST" for r in upstream_requests())

    before = asked()
    for bad in ("", "a/b", "a@b", "x" * 129, 7, ["a"]):
        r = httpx.post(s.url + "/v1/chat/completions", json={**CHAT, "cache_salt": bad}, headers=_auth("alice"))
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)  # OpenAI's shape
        assert "invalid cache_salt" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/messages", json={"model": SERVED, "max_tokens": 5, "cache_salt": bad,
                                                      "messages": [{"role": "user", "content": "hi"}]}, headers=_auth("alice"))
        assert r.status_code == 400 and r.json()["type"] == "error", (bad, r.text)  # Anthropic's shape
        assert "invalid cache_salt" in r.json()["error"]["message"]
    assert asked() == before  # none reached vLLM


def test_one_keys_prompt_is_no_cache_hit_for_another_key(isolated, fake):
    """The side channel itself, counted as vLLM counts it (``vllm:prefix_cache_hits``): alice's prompt is a hit
    when alice sends it again, none when bob sends the same one (his time to first token says nothing of hers)."""
    s = isolated
    prompt = " ".join(f"secret{i}" for i in range(64))  # 4 of the stand-in's 16-word blocks

    def hits_after(key: str) -> float:
        before = metric(httpx.get(fake.url + "/metrics").text, "vllm:prefix_cache_hits_total")
        r = httpx.post(s.url + "/v1/completions", json={"model": SERVED, "prompt": prompt, "max_tokens": 1}, headers=_auth(key))
        assert r.status_code == 200, r.text
        return metric(httpx.get(fake.url + "/metrics").text, "vllm:prefix_cache_hits_total") - before

    assert hits_after("alice") == 0
    assert hits_after("bob") == 0  # on main: 64, the whole prompt alice sent
    assert hits_after("root") == 0
    assert hits_after("alice") == 64 and hits_after("bob") == 64  # each key's own cache still works


def test_off_and_a_server_without_keys_send_no_salt_and_a_clients_own_as_it_came(fake, keys_file, proxy, upstream_requests,
                                                                                   tmp_path):
    """``--cache-isolation off``: one cache for every key, a client's ``cache_salt`` relayed as sent (keys that
    trust each other), as the start's log says. A server without keys has one tenant: no salt either."""
    off = start_proxy(fake.url, "--api-key-file", str(keys_file), "--cache-isolation", "off", log=tmp_path / "vllama.log")
    try:
        (said,) = [e for e in log_events(tmp_path / "vllama.log") if e.get("event") == "cache_isolation"]
        assert said["mode"] == "off" and said["reason"] == "--cache-isolation off"
        for url, h in ((off.url, _auth("alice")), (off.url, _auth("root")), (proxy.url, {})):
            assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=h).status_code == 200
            assert httpx.post(url + "/api/chat", json={"model": SERVED, "stream": False, "messages": [{"role": "user", "content": "hi"}]},
                              headers=h).status_code == 200
            assert httpx.post(url + "/v1/chat/completions", json={**CHAT, "cache_salt": "mine"}, headers=h).status_code == 200
        assert _salts(upstream_requests, "/v1/chat/completions") == [None, None, "mine"] * 3
    finally:
        stop(off.proc)


def test_embeddings_carry_the_keys_salt(embed_fake, keys_file, embed_requests):
    """A pooling model with causal attention and last-token pooling uses the prefix cache too (vLLM 0.32
    ``ModelConfig.is_prefix_caching_supported``), and vLLM's embedding requests take ``cache_salt``."""
    s = start_proxy(embed_fake.url, "--api-key-file", str(keys_file), vllm_args=["--runner", "pooling"])
    try:
        for key in ("alice", "bob"):
            h = _auth(key)
            assert httpx.post(s.url + "/api/embed", json={"model": SERVED, "input": ["a", "b"]}, headers=h).status_code == 200
            assert httpx.post(s.url + "/api/embeddings", json={"model": SERVED, "prompt": "a"}, headers=h).status_code == 200
            assert httpx.post(s.url + "/v1/embeddings", json={"model": SERVED, "input": "a"}, headers=h).status_code == 200
        assert _salts(embed_requests, "/v1/embeddings") == [SALTS["alice"]] * 3 + [SALTS["bob"]] * 3
    finally:
        stop(s.proc)


def test_a_media_items_uuid_names_it_within_its_key_only(isolated, upstream_requests):
    """vLLM keys its multimodal processor and encoder caches by each media item's ``uuid`` when the client gives
    one (vLLM "Multimodal Inputs", "Stable UUIDs for Caching"; ``multimodal/processing/inputs.py``: the uuid *is*
    the item's hash, and ``cache_salt`` enters neither cache), and a part may send the uuid alone (``image_url``
    null) to reuse the cached item. So a key naming another key's uuid would get that key's image into its own
    prompt, or plant its own under a uuid another key will send. Each key's uuids reach vLLM as its own: the
    same uuid from one key names one item every time, from another key another; a salt-less server sends
    them as they came."""
    s = isolated
    image = "data:image/png;base64,iVBORw0KGgo="

    def sent(key: str, path: str = "/v1/chat/completions", **extra) -> list:
        parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": image}, "uuid": "photo-1"},
                 {"type": "image_url", "image_url": None, "uuid": "photo-2"}]
        body = {"model": SERVED, "max_tokens": 2, "messages": [{"role": "user", "content": parts}], **extra}
        r = httpx.post(s.url + path, json=body, headers=_auth(key), timeout=30)
        assert r.status_code == 200, r.text
        got = upstream_requests(path)[-1]["body"]["messages"][0]["content"]
        assert got[1]["image_url"] == {"url": image} and got[0] == parts[0]  # the rest as sent
        return [p["uuid"] for p in got[1:]]

    alice = sent("alice")
    assert alice == sent("alice") and len(set(alice)) == 2  # one key: the same items every time
    assert not {"photo-1", "photo-2"} & set(alice)
    bob, root = sent("bob"), sent("root")
    assert not set(alice) & set(bob) and not set(alice) & set(root) and not set(bob) & set(root)
    assert sent("alice", cache_salt="project-x") == alice  # a uuid is the key's, whatever its salt
    # the same field, its name escaped in the JSON (orjson reads "uuid")
    raw = (b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image_url", '
           b'"image_url": null, "\\u0075uid": "photo-1"}]}]}' % SERVED.encode())
    r = httpx.post(s.url + "/v1/chat/completions", content=raw, headers={**_auth("alice"), "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert upstream_requests("/v1/chat/completions")[-1]["body"]["messages"][0]["content"][0]["uuid"] == alice[0]


def test_a_media_uuid_is_the_keys_wherever_vllm_reads_a_content_part():
    """vLLM reads a part's ``uuid`` in a chat message's content, a tool result's content within it, a batch
    of conversations, and a score or rerank list that mixes texts and ``{"content": [parts]}`` items
    (``ScoreInput``: ``str | ScoreMultiModalParam``); each is the key's own, and nothing else is touched."""
    part = {"type": "image_url", "image_url": None, "uuid": "photo"}
    own = cache_salt.own_media({"input": [part]}, SALTS["alice"])
    body = {"messages": [{"role": "user", "content": [dict(part)]},
                         {"role": "user", "content": [{"type": "tool_result", "content": [dict(part)]}]}],
            "documents": ["a text", {"content": [dict(part)]}], "query": "q", "uuid": "top", "metadata": {"uuid": "m"}}
    cache_salt.own_media(body, SALTS["alice"])
    mine = body["messages"][0]["content"][0]["uuid"]
    assert mine != "photo" and re.fullmatch(r"[0-9a-f]{64}", mine) and own is None
    assert body["messages"][1]["content"][0]["content"][0]["uuid"] == body["documents"][1]["content"][0]["uuid"] == mine
    assert body["uuid"] == "top" and body["metadata"] == {"uuid": "m"} and body["documents"][0] == "a text"
    batch = {"messages": [[{"role": "user", "content": [dict(part)]}]]}
    cache_salt.own_media(batch, SALTS["bob"])
    assert batch["messages"][0][0]["content"][0]["uuid"] not in ("photo", mine)


def test_a_form_reaches_only_the_audio_routes(isolated, upstream_requests):
    """A ``multipart/form-data`` body is read for its ``model`` only (audio files): on a JSON route it would pass the
    key's field allow-list, its salt and its bounds unread. Only the audio routes take one (an allow-list); elsewhere a
    415 before vLLM (main relayed it, and vLLM 0.32's answer was all that stood in the way)."""
    s = isolated
    form = {"model": SERVED, "prompt": "hi", "cache_salt": "bob's", "kv_transfer_params": "{}"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        r = httpx.post(s.url + path, data=form, files={"f": ("x.txt", b"x")}, headers={"Authorization": "Bearer sk-alice"})
        assert r.status_code == 415 and "multipart/form-data" in r.text, (path, r.status_code, r.text)
        assert not upstream_requests(path), path
    r = httpx.post(s.url + "/v1/audio/transcriptions", data={"model": SERVED}, files={"file": ("a.wav", b"RIFF....")},
                   headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code != 415, r.text  # the audio route takes its form (the stand-in answers it as it can)
