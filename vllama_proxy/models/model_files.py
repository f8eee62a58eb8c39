"""What a model's own files say about it: architecture, size, parameters, template.

Read once per model from its directory (a local path, or the Hugging Face cache
for a hub id, without network) and cached by ``catalog.py``. Everything here is
blocking disk I/O: callers run :func:`read_model_files` in a worker thread.

Feeds ``/api/show``, ``/api/tags`` and ``/api/ps`` (``docs/wire.md``,
"Responses": ``details``, ``model_info``, ``template``, ``parameters``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}


@dataclass
class ModelFiles:
    """Facts read from a model directory; empty defaults when it is not reachable.

    Attributes:
        path: the directory read, or ``None`` when none was found.
        config: ``config.json`` (``{}`` if absent).
        size: bytes of all weight files.
        parameter_count: parameters counted from the safetensors headers (0 if unknown).
        chat_template: the Jinja chat template (``tokenizer_config.json`` or ``chat_template.jinja``).
        eos_token: the tokenizer's end-of-sequence token text, if any.
        generation_config: ``generation_config.json`` (sampling defaults vLLM applies).
        digest: 64 hex chars identifying these files.
        modified_at: mtime of ``config.json`` (seconds since the epoch), or ``None``.
        special_tokens: the tokenizer's special-looking tokens (added tokens, and vocabulary
            entries such as ``<PRE>``/``▁<PRE>`` or ``[SUFFIX]``) -> their ids; ``{}`` when no
            ``tokenizer.json``/``tokenizer_config.json`` was read.
    """

    path: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    size: int = 0
    parameter_count: int = 0
    chat_template: str | None = None
    eos_token: str | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    digest: str = ""
    modified_at: float | None = None
    special_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        """Ollama's ``general.architecture``: the HF ``model_type`` (``qwen2``, ``llama``...)."""
        text_config = self.config.get("text_config") or {}
        return str(self.config.get("model_type") or text_config.get("model_type") or "unknown")

    @property
    def quantization_level(self) -> str:
        """``AWQ``/``GPTQ``/``FP8``... from ``quantization_config``, else the weights' dtype (``BF16``)."""
        q = self.config.get("quantization_config")
        if isinstance(q, dict) and q.get("quant_method"):
            bits = q.get("bits") or q.get("w_bit")
            return f"{str(q['quant_method']).upper()}{'_' + str(bits) + 'BIT' if bits else ''}"
        dtype = self.config.get("torch_dtype") or self.config.get("dtype") or ""
        return _DTYPES.get(str(dtype), str(dtype).upper() or "unknown")


def find_model_dir(root: str) -> Path | None:
    """The local directory holding ``root``'s files: ``root`` itself if it is a directory,
    else the Hugging Face cache snapshot of hub id ``root`` (no network is used)."""
    p = Path(root).expanduser()
    if p.is_dir():
        return p
    if root.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(root, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, offline, or not a repo id: no files
        return None


def read_model_files(root: str, served_name: str) -> ModelFiles:
    """Read the facts about model ``root`` (path or hub id). Never raises for missing files."""
    path = find_model_dir(root)
    if path is None:
        digest = hashlib.sha256(f"{served_name}\0{root}".encode()).hexdigest()
        return ModelFiles(digest=digest)
    config = _load_json(path / "config.json")
    tok_config = _load_json(path / "tokenizer_config.json")
    weights = [f for f in path.iterdir() if f.name.endswith(_WEIGHT_SUFFIXES) and f.is_file()]
    size = sum(f.stat().st_size for f in weights)
    params = sum(_safetensors_parameter_count(f) for f in weights if f.name.endswith(".safetensors"))
    cfg_path = path / "config.json"
    h = hashlib.sha256(served_name.encode() + b"\0")
    h.update(cfg_path.read_bytes() if cfg_path.is_file() else root.encode())
    h.update(str(size).encode())
    return ModelFiles(
        path=path,
        config=config,
        size=size,
        parameter_count=params,
        chat_template=_chat_template(path, tok_config),
        eos_token=_token_text(tok_config.get("eos_token")),
        generation_config=_load_json(path / "generation_config.json"),
        digest=h.hexdigest(),
        modified_at=cfg_path.stat().st_mtime if cfg_path.is_file() else None,
        special_tokens=_special_tokens(path, tok_config),
    )


def format_parameter_size(count: int) -> str:
    """Ollama's ``parameter_size`` text: ``1.5B``, ``494.03M``; ``""`` when unknown."""
    if count <= 0:
        return ""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.1f}B"
    if count >= 1_000_000:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.2f}K"


def _load_json(p: Path) -> dict[str, Any]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _chat_template(path: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = tok_config.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else None


#: A vocabulary entry that reads as a control token: ``<fim_prefix>``, ``<|fim_middle|>``,
#: ``▁<PRE>`` (SentencePiece's word-start mark is dropped from the key), ``[SUFFIX]``.
_SPECIAL = re.compile(r"▁?(<[^<>\s]{1,40}>|\[[A-Z_]{2,20}\])")


def _special_tokens(path: Path, tok_config: dict[str, Any]) -> dict[str, int]:
    """Special-looking token text -> id, from ``tokenizer.json`` (added tokens, then the vocabulary)
    and ``tokenizer_config.json``'s ``added_tokens_decoder``; the first id seen for a text wins."""
    out: dict[str, int] = {}
    tok = _load_json(path / "tokenizer.json")
    for t in tok.get("added_tokens") or []:
        if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
            out.setdefault(t["content"], t["id"])
    for i, t in (tok_config.get("added_tokens_decoder") or {}).items():
        text = _token_text(t)
        if text is not None and str(i).isdigit():
            out.setdefault(text, int(i))
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for text, i in vocab.items():
            if isinstance(i, int) and _SPECIAL.fullmatch(text):
                out.setdefault(text.removeprefix("▁"), i)
    return out


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def read_safetensors_header(f: Path) -> dict[str, Any]:
    """The tensors of a safetensors file: name -> ``{"dtype", "shape", "data_offsets"}``, from its
    header (8-byte little-endian length, then JSON; ``__metadata__`` left out). ``{}`` if unreadable."""
    try:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 * 1024 * 1024:
                return {}
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error):
        return {}
    if not isinstance(header, dict):
        return {}
    return {k: t for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)}


def _safetensors_parameter_count(f: Path) -> int:
    """Sum of tensor element counts from a safetensors header (8-byte length + JSON)."""
    return sum(math.prod(t.get("shape") or []) for t in read_safetensors_header(f).values())
