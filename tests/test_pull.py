"""``/api/pull`` and ``/api/delete`` of Hugging Face models: the real proxy, the real ``ollama`` client,
``huggingface_hub`` downloading from a fake Hub process (``fake_hub.py``) into a temporary ``HF_HOME``."""

from __future__ import annotations

import errno
import hashlib
import os
import time
from pathlib import Path

import httpx
import ollama
import orjson
import pytest
from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import OfflineModeIsEnabled
from ollama import ResponseError

import fake_hub
from conftest import ALIAS, SERVED, free_port, hf_env, start_server, stop
from vllama_proxy.errors import BadRequest
from vllama_proxy.models import hub

WEIGHTS_SHA = hashlib.sha256(fake_hub.weights()).hexdigest()
PULLED = {"config.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"}


@pytest.fixture
def client(hub_proxy) -> ollama.Client:
    return ollama.Client(host=hub_proxy.url)


@pytest.fixture
def hub_requests(fake_hf):
    """Returns a function giving the requests the fake Hub received (``"METHOD path"``) since it was
    last called, or since the test began."""
    httpx.delete(fake_hf.url + "/_fake/requests")

    def since_last_call() -> list[str]:
        sent = httpx.get(fake_hf.url + "/_fake/requests").json()
        httpx.delete(fake_hf.url + "/_fake/requests")
        return sent

    return since_last_call


def cached(home: Path, repo_id: str):
    """The cache's view of ``repo_id`` (``None`` if absent), as ``huggingface_hub.scan_cache_dir`` reports it."""
    return next((r for r in scan_cache_dir(home / "hub").repos if r.repo_id == repo_id), None)


def file_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------- pull


def test_pull_streams_progress_like_ollama(client, hf_home, hub_requests):
    events = list(client.pull("acme/tiny-stream", stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    files = {f.path: f for f in fake_hub.repo_files("acme/tiny-stream")}
    by_digest: dict[str, list] = {}
    for e in events[1:-3]:
        assert e.digest.startswith("sha256:") and e.status == "pulling " + e.digest[7:19]
        by_digest.setdefault(e.digest, []).append(e)
    # One digest per pulled file, the sha256 of its bytes; weights vLLM never reads are not pulled.
    assert set(by_digest) == {"sha256:" + file_sha256(files[p].data) for p in PULLED}
    weights = by_digest["sha256:" + WEIGHTS_SHA]
    assert len(weights) >= 3, weights
    completed = [e.completed for e in weights]
    assert completed[0] == 0 and completed == sorted(set(completed)) and completed[-1] == len(fake_hub.weights())
    assert {e.total for e in weights} == {len(fake_hub.weights())}
    for p in PULLED - {"model.safetensors"}:
        (only,) = by_digest["sha256:" + file_sha256(files[p].data)]
        assert only.completed == only.total == len(files[p].data)
    # The files are really in the cache, under refs/main, byte for byte.
    repo = cached(hf_home, "acme/tiny-stream")
    (revision,) = repo.revisions
    assert revision.commit_hash == fake_hub.commit_of("acme/tiny-stream") and revision.refs == {"main"}
    assert {f.file_name for f in revision.files} == PULLED
    for f in revision.files:
        assert f.file_path.read_bytes() == files[f.file_name].data
    sent = hub_requests()
    assert not [r for r in sent if "pytorch_model.bin" in r or "original/" in r], sent


def test_pull_without_stream_answers_once(hub_proxy, client, hf_home):
    r = httpx.post(hub_proxy.url + "/api/pull", json={"model": "acme/tiny-nostream", "stream": False}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {"status": "success"}
    (revision,) = cached(hf_home, "acme/tiny-nostream").revisions
    assert {f.file_name for f in revision.files} == PULLED
    assert client.pull("acme/tiny-nostream:latest").status == "success"  # already there: no download


def test_pull_ndjson_bytes(hub_proxy, hub_requests):
    def pull_lines(model: str) -> list[dict]:
        with httpx.stream("POST", hub_proxy.url + "/api/pull", json={"model": model, "insecure": True}, timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
            body = r.read()
        assert body.endswith(b"\n") and b"\n\n" not in body and not body.startswith(b"\n")
        return [orjson.loads(line) for line in body.split(b"\n")[:-1]]

    first = pull_lines("hf.co/acme/tiny-raw")
    assert all(set(e) <= {"status", "digest", "total", "completed"} for e in first)
    assert first[-1] == {"status": "success"}
    # Pulled again: every file is announced once, complete; nothing is downloaded.
    hub_requests()
    again = pull_lines("acme/tiny-raw")
    files = [e for e in again if "digest" in e]
    assert len(files) == len(PULLED) and all(e["completed"] == e["total"] for e in files)
    assert [e["status"] for e in again if "digest" not in e] == [
        "pulling manifest", "verifying sha256 digest", "writing manifest", "success"]
    assert not [r for r in hub_requests() if "/resolve/" in r or "/blobs/" in r]


def test_pull_of_a_served_model_needs_no_hub(client, hub_requests):
    assert client.pull(SERVED).status == "success"
    assert [p.status for p in client.pull(ALIAS, stream=True)] == ["success"]
    assert hub_requests() == []


def test_pull_of_a_library_name_pulls_the_repo_it_maps_to(client, hf_home):
    # issue 22: the Ollama name means the repo of vllama's library table, with Ollama's progress
    events = list(client.pull("qwen2.5:0.5b", stream=True))
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    assert any(e.digest == "sha256:" + WEIGHTS_SHA for e in events)
    (revision,) = cached(hf_home, "Qwen/Qwen2.5-0.5B-Instruct").revisions
    assert {f.file_name for f in revision.files} == PULLED
    # a quantization tag: the publisher's AWQ repo
    assert client.pull("qwen2.5:0.5b-instruct-q4_K_M").status == "success"
    assert cached(hf_home, "Qwen/Qwen2.5-0.5B-Instruct-AWQ") is not None
    # and the name deletes what it pulled
    assert client.delete("qwen2.5:0.5b-instruct-q4_K_M").status == "success"
    assert cached(hf_home, "Qwen/Qwen2.5-0.5B-Instruct-AWQ") is None


def test_pull_of_an_unknown_name_says_what_is_close(client):
    with pytest.raises(ResponseError) as e:
        client.pull("lama3.2")
    assert e.value.status_code == 404 and e.value.error.startswith("model 'lama3.2' not found: it is not a name in vllama's library")
    assert "the closest known names are llama3.2" in e.value.error and "org/name" in e.value.error
    with pytest.raises(ResponseError) as e:
        client.pull("qwen2.5:99b")
    assert e.value.status_code == 404 and "knows qwen2.5 with the tags 0.5b, 1.5b" in e.value.error


@pytest.mark.parametrize("stream", [False, True])
def test_pull_unknown_repo_or_revision_is_404(client, fake_hf, stream):
    with pytest.raises(ResponseError) as e:
        result = client.pull("acme/no-such-model", stream=stream)
        list(result) if stream else None
    assert e.value.status_code == 404
    assert e.value.error.startswith("pull model manifest: file does not exist")
    assert "'acme/no-such-model'" in e.value.error and fake_hf.url in e.value.error and "HF_TOKEN" in e.value.error
    with pytest.raises(ResponseError) as e:
        client.pull("acme/tiny-stream:v9")
    assert e.value.status_code == 404 and "no revision 'v9'" in e.value.error


def test_pull_gated_repo_says_to_set_hf_token(client, fake_hf):
    with pytest.raises(ResponseError) as e:
        list(client.pull("acme/gated-model", stream=True))
    assert e.value.status_code == 401
    assert "gated" in e.value.error and "HF_TOKEN" in e.value.error and f"{fake_hf.url}/acme/gated-model" in e.value.error


def test_pull_checks_free_disk_space_first(client, hf_home, hub_requests):
    with pytest.raises(ResponseError) as e:
        client.pull("acme/huge-model")
    assert e.value.status_code == 507
    assert e.value.error.startswith(f"not enough disk space in {hf_home / 'hub'}: 'acme/huge-model' needs 10000.0 TB")
    assert not [r for r in hub_requests() if "/resolve/" in r]


def test_pull_invalid_hub_name_is_400(client):
    with pytest.raises(ResponseError) as e:
        client.pull("acme/bad name")
    assert e.value.status_code == 400 and "invalid model name" in e.value.error


def test_digest_mismatch_ends_the_stream_with_an_error(hub_proxy, hf_home):
    with httpx.stream("POST", hub_proxy.url + "/api/pull", json={"model": "acme/corrupt-model"}, timeout=30) as r:
        assert r.status_code == 200
        lines = [orjson.loads(line) for line in r.iter_lines() if line]
    assert lines[-2] == {"status": "verifying sha256 digest"}
    assert lines[-1]["error"].startswith("digest mismatch, file must be downloaded again: want sha256:")
    files = {f.file_name for r in [cached(hf_home, "acme/corrupt-model")] for rev in r.revisions for f in rev.files}
    assert "model.safetensors" not in files


def test_client_leaving_stops_the_download(hub_proxy, hf_home):
    with httpx.stream("POST", hub_proxy.url + "/api/pull", json={"model": "acme/tiny-leave"}, timeout=30) as r:
        for line in r.iter_lines():
            if line and orjson.loads(line).get("digest") == "sha256:" + WEIGHTS_SHA:
                break  # the weights started: leave
    blob = hf_home / "hub" / "models--acme--tiny-leave" / "blobs" / WEIGHTS_SHA
    time.sleep(1.5)  # the fake hub sends the weights in ~0.5 s; the pull stops at its next report
    assert not blob.exists()
    assert not list(blob.parent.glob("*.incomplete"))


def test_hub_unreachable_is_503(model_dir, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    p = start_server(model_dir, hf_env(dead, tmp_path))
    try:
        r = httpx.post(p.url + "/api/pull", json={"model": "acme/tiny-model"}, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"].startswith(f"cannot reach the Hugging Face Hub at {dead}: ")
    finally:
        stop(p.proc)


def test_offline_mode_pulls_only_what_is_cached(model_dir, fake_hf, client, hf_home, hub_requests):
    assert client.pull("acme/tiny-offline").status == "success"
    p = start_server(model_dir, hf_env(fake_hf.url, hf_home, HF_HUB_OFFLINE="1"))
    try:
        offline = ollama.Client(host=p.url)
        hub_requests()
        assert [e.status for e in offline.pull("acme/tiny-offline", stream=True)] == ["pulling manifest", "success"]
        with pytest.raises(ResponseError) as e:
            offline.pull("acme/tiny-absent")
        assert e.value.status_code == 503 and "HF_HUB_OFFLINE" in e.value.error and "acme/tiny-absent" in e.value.error
        assert hub_requests() == []
    finally:
        stop(p.proc)


# ---------------------------------------------------------------------------- delete


def test_delete_removes_the_model_from_the_cache(client, hf_home):
    assert client.pull("acme/tiny-delete").status == "success"
    assert cached(hf_home, "acme/tiny-delete") is not None
    assert client.delete("acme/tiny-delete").status == "success"
    assert cached(hf_home, "acme/tiny-delete") is None
    assert not (hf_home / "hub" / "models--acme--tiny-delete").exists()
    with pytest.raises(ResponseError) as e:
        client.delete("acme/tiny-delete")
    assert e.value.status_code == 404 and e.value.error == "model 'acme/tiny-delete' not found"


def test_delete_answers_like_ollama(hub_proxy, client):
    client.pull("acme/tiny-del-raw")
    r = httpx.request("DELETE", hub_proxy.url + "/api/delete", json={"name": "acme/tiny-del-raw:latest"})
    assert r.status_code == 200 and r.content == b""
    for name in ("acme/never-pulled", "llama3:8b"):
        r = httpx.request("DELETE", hub_proxy.url + "/api/delete", json={"model": name})
        assert r.status_code == 404 and r.json() == {"error": f"model '{name}' not found"}


@pytest.mark.parametrize("name", [SERVED, SERVED + ":latest", ALIAS])
def test_delete_of_the_served_model_is_refused(hub_proxy, name):
    r = httpx.request("DELETE", hub_proxy.url + "/api/delete", json={"model": name})
    assert r.status_code == 400 and r.json() == {"error": f"model '{name}' is in use: it is being served"}


# ---------------------------------------------------------------------------- units


@pytest.mark.parametrize("name,want", [
    ("Qwen/Qwen2.5-1.5B-Instruct", hub.HubModel("Qwen/Qwen2.5-1.5B-Instruct")),
    ("Qwen/Qwen2.5-1.5B-Instruct:latest", hub.HubModel("Qwen/Qwen2.5-1.5B-Instruct")),
    ("hf.co/acme/m:v1.0", hub.HubModel("acme/m", "v1.0")),
    ("acme/m:0123abc", hub.HubModel("acme/m", "0123abc")),
    ("llama3:8b", None),
    ("fake-model", None),
    ("a/b/c", None),
])
def test_parse_model(name, want):
    assert hub.parse_model(name) == want


@pytest.mark.parametrize("name", ["acme/bad name", "acme/m:..", "acme/--x", "é/ü"])
def test_parse_model_rejects_bad_hub_names(name):
    with pytest.raises(BadRequest):
        hub.parse_model(name)


def test_select_files_skips_weights_vllm_never_reads():
    repo = ["config.json", "model-00001-of-00002.safetensors", "pytorch_model.bin", "tf_model.h5", "flax_model.msgpack",
            "onnx/model.onnx", "original/consolidated.00.pth", "original/params.json", "tokenizer.json", "tokenizer.model"]
    assert hub.select_files(repo) == ["config.json", "model-00001-of-00002.safetensors", "tokenizer.json", "tokenizer.model"]
    assert hub.select_files(["config.json", "pytorch_model.bin"]) == ["config.json", "pytorch_model.bin"]


def test_hub_error_mapping():
    import httpx2

    m = hub.HubModel("acme/m")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    e = hub.hub_error(RuntimeError("wrapped"), m)
    assert e.status == 500 and "acme/m" in e.message
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("download failed") from inner
    except RuntimeError as outer:
        e = hub.hub_error(outer, m)
    assert e.status == 507 and e.message.startswith("not enough disk space in ") and "No space left" in e.message
    assert hub.hub_error(httpx2.ConnectError("[Errno 111] Connection refused"), m).status == 503
    e = hub.hub_error(OfflineModeIsEnabled("offline"), m)
    assert e.status == 503 and "HF_HUB_OFFLINE" in e.message
