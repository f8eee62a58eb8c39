"""HEAD/POST /api/blobs and /api/create's ``files`` (issue 30): ollama-python's create_blob + create.

Blobs through the real ollama client against vllama (``--upstream`` at the fake vLLM); a model made
from uploaded files runs on demand under ``vllama serve`` with the stand-in vLLM (``tests/bin/vllm``).
"""

from __future__ import annotations

import hashlib

import httpx
import ollama
import pytest

from conftest import SERVED, start_proxy, stop, write_model_dir
from conftest import OnDemandServer as Server


def test_create_blob_head_and_digest_check(client, proxy, tmp_path):
    f = tmp_path / "adapter.bin"
    f.write_bytes(b"x" * 5000)
    digest = client.create_blob(f)
    assert digest == "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
    assert httpx.head(f"{proxy.url}/api/blobs/{digest}").status_code == 200
    assert httpx.post(f"{proxy.url}/api/blobs/{digest}", content=f.read_bytes()).status_code == 200  # there already
    other = "sha256:" + "0" * 64
    assert httpx.head(f"{proxy.url}/api/blobs/{other}").status_code == 404
    r = httpx.post(f"{proxy.url}/api/blobs/{other}", content=b"not zeros")
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert httpx.head(f"{proxy.url}/api/blobs/{other}").status_code == 404  # nothing kept
    r = httpx.post(f"{proxy.url}/api/blobs/sha256:abc", content=b"x")
    assert r.status_code == 400 and "invalid digest format" in r.json()["error"]


def test_blob_size_limit(fake):
    p = start_proxy(fake.url, "--max-blob-size", "1000")
    try:
        data = b"y" * 2000
        r = httpx.post(f"{p.url}/api/blobs/sha256:{hashlib.sha256(data).hexdigest()}", content=data)
        assert r.status_code == 413 and "--max-blob-size" in r.json()["error"]
    finally:
        stop(p.proc)


def _upload(client: ollama.Client, model_dir) -> dict[str, str]:
    return {f.name: client.create_blob(f) for f in sorted(model_dir.iterdir())}


def test_files_refusals(client, tmp_path):
    files = _upload(client, write_model_dir(tmp_path / "m"))
    with pytest.raises(ollama.ResponseError) as e:  # --upstream: vllama runs no vLLM to load it
        client.create(model="uploaded", files=files)
    assert e.value.status_code == 400 and "runs on demand" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="uploaded", files={"model.gguf": files["model.safetensors"]})
    assert e.value.status_code == 400 and "GGUF is not served" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="uploaded", files={**files, "config.json": "sha256:" + "1" * 64})
    assert e.value.status_code == 400 and "not found: upload config.json first" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="uploaded", files={"../x": files["config.json"]})
    assert e.value.status_code == 400 and "invalid file name" in e.value.error


def test_a_model_made_from_uploaded_files_runs_on_demand(tmp_path):
    s = Server(tmp_path)
    try:
        files = _upload(s.client, write_model_dir(tmp_path / "weights"))
        progress = list(s.client.create(model="my-upload", files=files, system="be terse", stream=True))
        assert progress[-1].status == "success" and any("copying file" in (p.status or "") for p in progress)
        # the model is its own base (created.json: "base": "my-upload"): listed once, as Ollama lists it
        assert [m.model for m in s.client.list().models].count("my-upload:latest") == 1
        r = s.client.chat(model="my-upload", messages=[{"role": "user", "content": "hi"}], stream=False)
        assert r.done
        assert [m.model for m in s.client.list().models].count("my-upload:latest") == 1  # loaded in its slot too
        assert [m.model for m in s.client.ps().models].count("my-upload:latest") == 1
        argv = s.launched()[-1]
        served_from = argv[argv.index("serve") + 1]
        assert served_from.startswith(str(s.state / "models")), argv
        s.client.delete("my-upload")
        assert "my-upload:latest" not in {m.model for m in s.client.list().models}
    finally:
        stop(s.proc)
