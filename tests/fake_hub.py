"""A fake Hugging Face Hub: as much of the Hub's HTTP API as ``huggingface_hub`` 2.x uses to download a model.

    python tests/fake_hub.py --port P --cdn-port Q [--delay S]

It answers what ``HfApi.model_info``, ``HfApi.list_repo_tree``, ``HfApi.auth_check`` and
``hf_hub_download`` send (``huggingface_hub/hf_api.py``, ``file_download.py``,
``utils/_http.py``), the way huggingface.co does:

    GET  /api/models/{repo}[/revision/{rev}]      model info: ``sha`` (the commit), ``gated``, ``siblings``
    GET  /api/models/{repo}/tree/{rev}[/{path}]   the file list: ``oid`` (git blob id), ``size``,
                                                  ``lfs: {oid: sha256, size, pointerSize}`` for LFS files
    GET  /api/models/{repo}/auth-check            200, or 401 ``X-Error-Code: GatedRepo`` for a gated repo without access
    HEAD /{repo}/resolve/{rev}/{file}             ``X-Repo-Commit``; a git file: 200 with ``ETag`` (its blob id) and
                                                  ``Content-Length``; an LFS file: 302 to the CDN with
                                                  ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``
    GET  /{repo}/resolve/{rev}/{file}             the bytes of a git file; an LFS file: 302 to the CDN
    GET  {cdn}/blobs/{sha256}                     LFS bytes, in 1 MiB pieces with ``--delay`` seconds between them

The CDN listens on its own port: a different origin, so ``huggingface_hub`` takes the file's
metadata from the 302 itself and downloads from ``Location``, as with huggingface.co's CDN.
Errors carry the Hub's ``X-Error-Code``: an unknown repo is 401 ``RepoNotFound`` (what the Hub
answers without a token), an unknown revision 404 ``RevisionNotFound``, an unknown file 404
``EntryNotFound``. ``Authorization: Bearer hf_granted`` opens the gated repo.

Repositories (see :func:`repo_files`):
    acme/tiny-*         any name: config, tokenizer config, generation config, ``model.safetensors``
                        (~24 MiB, LFS), and files vLLM never reads (``pytorch_model.bin``, ``original/``)
    Qwen/Qwen2.5-0.5B-Instruct, Qwen/Qwen2.5-0.5B-Instruct-AWQ
                        the same files, under the repos vllama's library maps ``qwen2.5:0.5b`` and
                        ``qwen2.5:0.5b-instruct-q4_K_M`` to (``vllama pull qwen2.5:0.5b``)
    acme/gated-model    gated: 401 GatedRepo on download without access
    acme/huge-model     its weights claim 10 PB
    acme/corrupt-model  the bytes of its weights do not match the sha256 the tree lists

Test hooks: ``GET /_fake/requests`` (every request as ``"METHOD path"``), ``DELETE /_fake/requests``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import struct
from dataclasses import dataclass
from functools import cache

from aiohttp import web

GRANTED_TOKEN = "hf_granted"
WEIGHTS_BYTES = 24 * 1024 * 1024 + 4096
CHUNK = 1024 * 1024


@dataclass(frozen=True)
class File:
    path: str
    data: bytes
    lfs: bool
    claimed_size: int | None = None  # acme/huge-model: a size the bytes do not have
    claimed_sha256: str | None = None  # acme/corrupt-model: a digest the bytes do not have

    @property
    def size(self) -> int:
        return self.claimed_size if self.claimed_size is not None else len(self.data)

    @property
    def sha256(self) -> str:
        return self.claimed_sha256 or _sha256(self.data)

    @property
    def blob_id(self) -> str:
        """The git object id: of the content for a git file, of the LFS pointer for an LFS file."""
        body = self.pointer() if self.lfs else self.data
        return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()

    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()


@cache
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@cache
def weights() -> bytes:
    """A safetensors file of ~24 MiB: more than two of huggingface_hub's 10 MiB read chunks."""
    n = (WEIGHTS_BYTES - 1024) // 2
    header = json.dumps({"embed.weight": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(range(256)) * (2 * n // 256) + b"\0" * (2 * n % 256)


#: Repos of the library table (vllama_proxy/models/library.toml) the fake Hub serves, as tiny ones.
LIBRARY_REPOS = ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct-AWQ")


def repo_files(repo_id: str) -> list[File] | None:
    """The files of ``repo_id`` (``None``: no such repo)."""
    config = json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
                         "num_hidden_layers": 2, "vocab_size": 1000, "torch_dtype": "bfloat16"}).encode()
    if repo_id.startswith("acme/tiny-") or repo_id in LIBRARY_REPOS:
        return [
            File("config.json", config, lfs=False),
            File("tokenizer_config.json", json.dumps({"eos_token": "<|im_end|>", "repo": repo_id}).encode(), lfs=False),
            File("generation_config.json", json.dumps({"temperature": 0.7}).encode(), lfs=False),
            File("model.safetensors", weights(), lfs=True),
            File("pytorch_model.bin", b"pickled weights vLLM skips when safetensors exist", lfs=True),
            File("original/consolidated.pth", b"a checkpoint in Meta's format", lfs=True),
        ]
    if repo_id == "acme/gated-model":
        return [File("config.json", config, lfs=False), File("model.safetensors", b"\0" * 4096, lfs=True)]
    if repo_id == "acme/huge-model":
        return [File("config.json", config, lfs=False), File("model.safetensors", b"", lfs=True, claimed_size=10**16)]
    if repo_id == "acme/corrupt-model":
        return [File("config.json", config, lfs=False),
                File("model.safetensors", b"\1" * 8192, lfs=True, claimed_sha256=hashlib.sha256(b"other").hexdigest())]
    return None


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


def gated(repo_id: str) -> bool:
    return repo_id == "acme/gated-model"


# ---------------------------------------------------------------------------- handlers

def _error(status: int, code: str, message: str, commit: str | None = None) -> web.Response:
    headers = {"X-Error-Code": code, "X-Error-Message": message}
    if commit:
        headers["X-Repo-Commit"] = commit
    return web.json_response({"error": message}, status=status, headers=headers)


def _repo(request: web.Request) -> tuple[str, list[File] | None]:
    repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
    return repo_id, repo_files(repo_id)


def _revision_ok(repo_id: str, revision: str) -> bool:
    return revision in ("main", commit_of(repo_id))


def _not_found(repo_id: str) -> web.Response:
    return _error(401, "RepoNotFound", "Repository not found")


def _has_access(request: web.Request, repo_id: str) -> bool:
    return not gated(repo_id) or request.headers.get("Authorization") == f"Bearer {GRANTED_TOKEN}"


def _gated_error(repo_id: str) -> web.Response:
    return _error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it and be "
                  "authenticated to access it. Please log in.", commit_of(repo_id))


async def model_info(request: web.Request) -> web.Response:
    repo_id, files = _repo(request)
    if files is None:
        return _not_found(repo_id)
    revision = request.match_info.get("revision", "main")
    if not _revision_ok(repo_id, revision):
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    return web.json_response({
        "_id": commit_of(repo_id)[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
        "sha": commit_of(repo_id), "private": False, "gated": "manual" if gated(repo_id) else False,
        "disabled": False, "downloads": 0, "likes": 0, "tags": ["transformers", "safetensors"],
        "library_name": "transformers", "pipeline_tag": "text-generation",
        "createdAt": "2025-01-01T00:00:00.000Z", "lastModified": "2025-01-02T00:00:00.000Z",
        "siblings": [{"rfilename": f.path} for f in files],
    })


async def tree(request: web.Request) -> web.Response:
    repo_id, files = _repo(request)
    if files is None:
        return _not_found(repo_id)
    if not _revision_ok(repo_id, request.match_info["revision"]):
        return _error(404, "RevisionNotFound", f"Invalid rev id: {request.match_info['revision']}")
    prefix = request.match_info.get("path", "")
    entries, folders = [], set()
    for f in files:
        if prefix and not f.path.startswith(prefix + "/"):
            continue
        parts = f.path.split("/")
        for i in range(1, len(parts)):
            folders.add("/".join(parts[:i]))
        entry = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
        if f.lfs:
            entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(f.pointer())}
        entries.append(entry)
    entries += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d} for d in sorted(folders)]
    return web.json_response(entries)


async def auth_check(request: web.Request) -> web.Response:
    repo_id, files = _repo(request)
    if files is None:
        return _not_found(repo_id)
    if not _has_access(request, repo_id):
        return _gated_error(repo_id)
    return web.json_response({})


async def resolve(request: web.Request) -> web.StreamResponse:
    repo_id, files = _repo(request)
    if files is None:
        return _not_found(repo_id)
    revision, filename = request.match_info["revision"], request.match_info["filename"]
    if not _revision_ok(repo_id, revision):
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    commit = commit_of(repo_id)
    if not _has_access(request, repo_id):
        return _gated_error(repo_id)
    file = next((f for f in files if f.path == filename), None)
    if file is None:
        return _error(404, "EntryNotFound", f"{filename} does not exist on \"{revision}\"", commit)
    if file.lfs:
        cdn = request.app[CDN_URL]
        return web.Response(status=302, headers={
            "Location": f"{cdn}/blobs/{file.sha256}", "X-Repo-Commit": commit, "ETag": f'"{file.blob_id}"',
            "X-Linked-Etag": f'"{file.sha256}"', "X-Linked-Size": str(file.size),
        })
    return web.Response(body=file.data, content_type="application/json" if filename.endswith(".json") else "text/plain",
                        headers={"X-Repo-Commit": commit, "ETag": f'"{file.blob_id}"'})


async def cdn_blob(request: web.Request) -> web.StreamResponse:
    sha = request.match_info["sha256"]
    repos = ("acme/tiny-x", "acme/gated-model", "acme/corrupt-model")
    data = next((f.data for r in repos for f in repo_files(r) or [] if f.sha256 == sha), None)
    if data is None:
        raise web.HTTPNotFound()
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "ETag": f'"{sha}"'})
    resp.content_length = len(data)
    await resp.prepare(request)
    if request.method == "HEAD":
        return resp
    delay = request.app[DELAY]
    try:
        for i in range(0, len(data), CHUNK):
            await resp.write(data[i:i + CHUNK])
            if delay and i + CHUNK < len(data):
                await asyncio.sleep(delay)
        await resp.write_eof()
    except ConnectionResetError:  # the downloader left (a pull that was stopped)
        pass
    return resp


async def requests_log(request: web.Request) -> web.Response:
    if request.method == "DELETE":
        request.app[LOG].clear()
        return web.json_response([])
    return web.json_response(request.app[LOG])


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


CDN_URL = web.AppKey("cdn_url", str)
DELAY = web.AppKey("delay", float)
LOG = web.AppKey("log", list)


@web.middleware
async def record(request: web.Request, handler) -> web.StreamResponse:
    if not request.path.startswith("/_fake/"):
        request.app[LOG].append(f"{request.method} {request.path}")
    return await handler(request)


def build_app(cdn_url: str, delay: float) -> web.Application:
    app = web.Application(middlewares=[record])
    app[CDN_URL] = cdn_url
    app[DELAY] = delay
    app[LOG] = []
    repo = "/{org}/{name}"
    app.router.add_get("/_fake/health", health)
    app.router.add_route("*", "/_fake/requests", requests_log)
    app.router.add_get("/api/models" + repo, model_info)
    app.router.add_get("/api/models" + repo + "/revision/{revision}", model_info)
    app.router.add_get("/api/models" + repo + "/tree/{revision}", tree)
    app.router.add_get("/api/models" + repo + "/tree/{revision}/{path:.+}", tree)
    app.router.add_get("/api/models" + repo + "/auth-check", auth_check)
    app.router.add_get(repo + "/resolve/{revision}/{filename:.+}", resolve)
    app.router.add_get("/blobs/{sha256}", cdn_blob)
    return app


async def serve(host: str, port: int, cdn_port: int, delay: float) -> None:
    runner = web.AppRunner(build_app(f"http://{host}:{cdn_port}", delay), access_log=None)
    await runner.setup()
    for p in (port, cdn_port):
        await web.TCPSite(runner, host, p).start()
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cdn-port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between 1 MiB pieces of an LFS file")
    args = parser.parse_args()
    weights()  # build the big file before answering anything
    asyncio.run(serve(args.host, args.port, args.cdn_port, args.delay))


if __name__ == "__main__":
    main()
