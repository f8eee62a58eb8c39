"""Access control: API keys, CORS as Ollama does it, the Host-header guard."""

from __future__ import annotations

import httpx
import openai
import pytest
from ollama import Client, ResponseError

from conftest import SERVED, start_proxy, stop


@pytest.fixture(scope="module")
def keyed(fake, tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "keys"
    keyfile.write_text("# team keys\nfile-key-3\n\n")
    log = tmp_path_factory.mktemp("log") / "proxy.log"
    p = start_proxy(fake.url, "--api-key", "secret-key-1", "--api-key", "secret-key-2", "--api-key-file", str(keyfile), log=log)
    yield p, log
    stop(p.proc)


def test_api_key_required_on_api_and_v1(keyed):
    p, log = keyed
    for path in ("/api/tags", "/api/version", "/v1/models"):
        r = httpx.get(p.url + path)
        err = r.json()["error"]  # Ollama's shape on /api, OpenAI's on /v1
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert "unauthorized" in (err["message"] if path.startswith("/v1/") else err), path
        assert httpx.get(p.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(p.url + path, headers={"Authorization": "Basic secret-key-1"}).status_code == 401
    for key in ("secret-key-1", "secret-key-2", "file-key-3"):
        assert httpx.get(p.url + "/api/tags", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for path in ("/", "/livez", "/readyz"):
        assert httpx.get(p.url + path).status_code == 200, path
    # the real clients, as users configure them
    r = Client(host=p.url, headers={"Authorization": "Bearer secret-key-2"}).generate(model=SERVED, prompt="x", stream=False)
    assert r.done
    with pytest.raises(ResponseError) as e:
        Client(host=p.url).generate(model=SERVED, prompt="x", stream=False)
    assert e.value.status_code == 401
    oai = openai.OpenAI(base_url=p.url + "/v1", api_key="secret-key-1")
    assert oai.completions.create(model=SERVED, prompt="x", max_tokens=2).choices[0].text == "tok0 tok1 "
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=p.url + "/v1", api_key="nope", max_retries=0).models.list()
    text = log.read_text()
    assert "secret-key" not in text and "file-key-3" not in text  # keys are never logged


def test_both_metrics_routes_need_the_key(keyed):
    """Issue 19: /vllm/metrics (model names, token counts) answered 200 without a key while
    /api/* needed one; one rule now covers /metrics and /vllm/metrics."""
    p, _ = keyed
    for path in ("/metrics", "/vllm/metrics"):
        r = httpx.get(p.url + path)
        assert r.status_code == 401 and "unauthorized" in r.json()["error"], path
        r = httpx.get(p.url + path, headers={"Authorization": "Bearer file-key-3"})
        assert r.status_code == 200, path
    assert "vllama_requests_total" in httpx.get(p.url + "/metrics", headers={"Authorization": "Bearer secret-key-1"}).text


def test_metrics_open_lets_a_scraper_in_without_a_key(fake):
    p = start_proxy(fake.url, "--api-key", "k", "--metrics-open")
    try:
        for path in ("/metrics", "/vllm/metrics"):
            assert httpx.get(p.url + path).status_code == 200, path
        assert httpx.get(p.url + "/api/tags").status_code == 401  # the API itself stays closed
    finally:
        stop(p.proc)


def test_cors_preflight_and_origins(fake):
    p = start_proxy(fake.url, env={"OLLAMA_ORIGINS": "https://app.example.com,chrome-extension://*"})
    try:
        pre = httpx.options(p.url + "/api/chat", headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 204
        assert pre.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert "Authorization" in pre.headers["Access-Control-Allow-Headers"] and "POST" in pre.headers["Access-Control-Allow-Methods"]
        for origin in ("https://app.example.com", "chrome-extension://abcdef", "vscode-webview://x", "http://127.0.0.1"):
            r = httpx.get(p.url + "/api/tags", headers={"Origin": origin})
            assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == origin, origin
        r = httpx.post(p.url + "/api/generate", json={"model": SERVED, "prompt": "x"}, headers={"Origin": "http://localhost:8080"})
        assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:8080"  # streamed answers too
        r = httpx.get(p.url + "/api/tags", headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and "not allowed" in r.json()["error"]
        assert "Access-Control-Allow-Origin" not in httpx.get(p.url + "/api/tags").headers  # no Origin, no CORS
    finally:
        stop(p.proc)


@pytest.mark.parametrize("host,allowed", [
    ("localhost:11434", True), ("127.0.0.1:11434", True), ("[::1]:11434", True), ("10.1.2.3", True),
    ("192.168.0.7:11434", True), ("myapp.localhost", True), ("box.local", True), ("svc.internal:80", True),
    ("evil.example", False), ("evil.example:11434", False), ("8.8.8.8", False),
])
def test_host_guard_on_loopback(proxy, host, allowed):
    r = httpx.get(proxy.url + "/api/tags", headers={"Host": host})
    assert (r.status_code != 403) is allowed, (host, r.status_code)
    if not allowed:
        assert "not allowed" in r.json()["error"]


def test_host_guard_off_when_not_loopback(fake):
    p = start_proxy(fake.url, host="0.0.0.0")
    try:
        assert httpx.get(p.url + "/api/tags", headers={"Host": "evil.example"}).status_code == 200
    finally:
        stop(p.proc)
