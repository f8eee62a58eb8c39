"""``vllama create NAME [-f Modelfile] [-q LEVEL] [--experimental]``: a Modelfile on disk made
into Ollama's create request and sent, with Ollama's progress.

As Ollama's ``cmd/cmd.go`` ``CreateHandler`` and ``parser/parser.go`` ``CreateRequest`` do it: the
Modelfile is ``-f PATH``, else ``./Modelfile``, else the current directory is the model (``FROM
.``); ``FROM`` and ``ADAPTER`` paths resolve against the Modelfile's directory; a local directory is
uploaded (``/api/blobs``, each file once) and sent as ``files`` / ``adapters``, any other ``FROM`` is
a name, and an absolute path not here or a repo id is left to the server. ``SYSTEM``, ``TEMPLATE``,
``PARAMETER``, ``MESSAGE`` and ``LICENSE`` become fields; the server's progress is shown on stderr
as ``pull``'s is. What cannot apply to vLLM is said, not ignored: ``-q`` is sent (the server
answers that vLLM serves published quantizations) and ``--experimental`` prints a note.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from vllama_proxy import ModelfileError, read_modelfile

from .api_client import Client
from .formatting import PullProgress

#: Ollama's words when neither ``-f`` nor ``./Modelfile`` is given and the directory holds no model.
NO_MODEL = "no Modelfile or safetensors files found"

#: The Modelfile when there is none: the current directory is the model (Ollama's ``CreateHandler``).
IMPLICIT = "FROM .\n"

#: Weights vLLM does not load from a directory vllama serves (GGUF, PyTorch pickles, other frameworks').
_NOT_UPLOADED = (".gguf", ".bin", ".pth", ".pt", ".ckpt", ".h5", ".msgpack", ".onnx", ".md")

EXPERIMENTAL_NOTE = ("note: --experimental is Ollama's direct import of safetensors; vLLM serves a safetensors "
                     "directory as it is, so vllama creates the model through the server as without it")


class CreateError(Exception):
    """The Modelfile or a file it names cannot be used here; the message is the one line shown."""


def modelfile(file: str | None, cwd: Path | None = None) -> tuple[Path, str]:
    """``(the directory its paths resolve against, the Modelfile's text)`` for ``-f file``.

    Raises:
        CreateError: ``-f`` names no file (``specified Modelfile wasn't found``), or it cannot be read.
    """
    cwd = cwd or Path.cwd()
    if file is None:
        default = cwd / "Modelfile"
        if not default.is_file():
            return cwd, IMPLICIT
        path = default
    else:
        path = cwd / Path(file).expanduser()
        if not path.is_file():
            raise CreateError("specified Modelfile wasn't found")
    try:
        return path.absolute().parent, path.read_text(encoding="utf-8-sig")  # a BOM is skipped, as Ollama's parser does
    except (OSError, UnicodeDecodeError) as e:
        raise CreateError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def expand(path: str, base: Path) -> Path:
    """A ``FROM``/``ADAPTER`` path as Ollama's ``expandPath`` reads it: ``~`` and ``~user`` are home
    directories, an absolute path stays, anything else is relative to ``base`` (the Modelfile's directory)."""
    if path.startswith("~"):
        return Path(os.path.expanduser(path)).absolute()
    return (base / path).absolute()


def model_files(directory: Path) -> list[Path]:
    """The files of a model (or adapter) directory that vLLM reads: the top-level files (weights as
    ``*.safetensors``, ``config.json``, the tokenizer's, the chat template), not hidden ones, not
    weights in formats vLLM does not load from such a directory.

    Raises:
        CreateError: no ``*.safetensors`` among them.
    """
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")
                   and not p.name.lower().endswith(_NOT_UPLOADED))
    if not any(p.suffix == ".safetensors" for p in files):
        raise CreateError(f"no safetensors files found in {directory} (vLLM serves a Hugging Face directory: "
                          "config.json, the tokenizer's files, *.safetensors)")
    return files


def sha256_digest(path: Path) -> str:
    """``sha256:<hex>`` of the file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


class _Counting:
    """A binary file read by http.client that reports the bytes read so far."""

    def __init__(self, f: BinaryIO, report: Callable[[int], None]) -> None:
        self.f, self.report, self.n = f, report, 0

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.n += len(data)
        self.report(self.n)
        return data


def upload(client: Client, files: list[Path], progress: PullProgress) -> dict[str, str]:
    """Each file sent as a blob unless the server has it; returns file name -> digest (create's
    ``files``/``adapters``). Progress: ``copying file sha256:...`` with a byte bar, as Ollama's."""
    out: dict[str, str] = {}
    for path in files:
        digest = sha256_digest(path)
        out[path.name] = digest
        size = path.stat().st_size
        status = f"copying file {digest}"
        if client.has_blob(digest):
            progress.update({"status": status, "digest": digest, "total": size, "completed": size})
            continue
        with path.open("rb") as f:
            def report(n: int, status: str = status, digest: str = digest, size: int = size) -> None:
                progress.update({"status": status, "digest": digest, "total": size, "completed": n})

            client.create_blob(digest, _Counting(f, report), size)  # type: ignore[arg-type]
    return out


def parse(text: str) -> dict[str, Any]:
    """The fields Modelfile ``text`` sets (:func:`vllama_proxy.read_modelfile`), read before anything
    is sent, as Ollama's parser reads it before its first progress line.

    Raises:
        CreateError: an unreadable Modelfile (which line, why), or no ``FROM`` line.
    """
    try:
        fields = read_modelfile(text)
    except ModelfileError as e:
        raise CreateError(str(e)) from None
    if "from" not in fields:
        raise CreateError("no FROM line")
    return fields


def create_request(name: str, base: Path, fields: dict[str, Any], client: Client, progress: PullProgress,
                   implicit: bool = False) -> dict[str, Any]:
    """Ollama's create request for a Modelfile's ``fields`` (:func:`parse`) whose paths resolve
    against ``base``; the local directories it names are uploaded on the way. ``implicit``: there
    was no Modelfile (``FROM .``).

    Raises:
        CreateError: a local model or adapter directory with no safetensors, a file where a
            directory belongs, a relative ``ADAPTER`` or ``DRAFT`` that is not there.
        ApiError, ConnectError: an upload the server refused, or no server.
    """
    fields = dict(fields)
    source = fields.pop("from")
    req: dict[str, Any] = {"model": name, "stream": True}
    here = expand(source, base)
    if here.is_dir():
        try:
            req["files"] = upload(client, model_files(here), progress)
        except CreateError:
            if implicit:  # no Modelfile, and the directory is no model either
                raise CreateError(NO_MODEL) from None
            raise
    elif here.is_file():
        raise CreateError(f"FROM {source}: a file; vLLM serves a model directory (config.json, the tokenizer's "
                          "files, *.safetensors), or name a model")
    else:
        req["from"] = source
    remote: list[str] = []
    adapters = fields.pop("adapters", [])
    if len(adapters) > 1:  # the server's rule, said before anything is uploaded
        raise CreateError("one adapter per model: vLLM applies one LoRA adapter to a request")
    for adapter in adapters:
        path = expand(adapter, base)
        if path.is_dir():
            req["adapters"] = upload(client, model_files(path), progress)
        elif path.exists():
            raise CreateError(f"ADAPTER {adapter}: a file; name the adapter's directory (adapter_config.json, "
                              "adapter_model.safetensors)")
        elif adapter.startswith((".", "~")) or (not adapter.startswith("/") and adapter.count("/") != 1):
            raise CreateError(f"ADAPTER {adapter}: no such directory ({path})")
        else:  # on the server, or a Hugging Face repo id: the server reads it (Modelfile text is how it takes one)
            remote.append(adapter)
    if remote:
        req["modelfile"] = "".join(f"ADAPTER {a}\n" for a in remote)
    draft = fields.pop("draft", None)
    if draft is not None:  # Ollama 0.33's DRAFT: a local directory is uploaded (draft_files), as Ollama's client does
        path = expand(draft, base)
        if path.is_dir():
            req["draft_files"] = upload(client, model_files(path), progress)
        elif path.exists():
            raise CreateError(f"DRAFT {draft}: a file; name the draft model's directory (config.json, *.safetensors)")
        elif draft.startswith((".", "~")):
            raise CreateError(f"DRAFT {draft}: no such directory ({path})")
        else:  # ngram, a Hugging Face repo id, or a directory on the server: the server reads it
            req["draft"] = draft
    req.update(fields)  # system, template, parameters, messages, license
    return req


def cmd_create(client: Client, args: argparse.Namespace) -> int:
    """``vllama create NAME [-f FILE] [-q LEVEL] [--experimental]`` (see the module docstring)."""
    if args.experimental:
        print(EXPERIMENTAL_NOTE, file=sys.stderr)
    progress = PullProgress()
    try:
        base, text = modelfile(args.file)
        fields = parse(text)
        progress.update({"status": "gathering model components"})
        req = create_request(args.model, base, fields, client, progress, implicit=text == IMPLICIT and args.file is None)
        if args.quantize:
            req["quantize"] = args.quantize
        with client.stream("/api/create", req) as events:
            for event in events:
                progress.update(event)
    except CreateError as e:
        progress.close()
        print(f"Error: {e}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    return 0
