"""vllama: the Ollama API in front of vLLM's OpenAI-compatible server.

The package root is the one module both sides share: the server (``settings.py``,
``upstream.py``) and the client (``client/``, which imports nothing else of the package,
``tests/test_import_graph.py``). It holds what both read off the wire the same way, and
imports only the standard library and orjson:

- :func:`ollama_host`: an ``OLLAMA_HOST`` value -> scheme, host, port, path (the server
  listens there, the client connects there);
- :func:`error_text` / :func:`error_message`: the message inside an error body, in any of
  the shapes Ollama, OpenAI, vLLM and FastAPI answer with;
- :class:`CliParser`: the argparse parser of ``vllama serve`` and of the client commands
  (one line and a "did you mean" for a mistyped option).
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NamedTuple, NoReturn
from urllib.parse import urlsplit

import orjson

__version__ = "0.1.0"

#: Ollama's default port (``envconfig.Host`` in ollama/ollama).
OLLAMA_DEFAULT_PORT = 11434


class OllamaHost(NamedTuple):
    """Where an ``OLLAMA_HOST`` value points: ``scheme`` as written (``http`` when none),
    ``host`` bare (an IPv6 address without brackets), ``port``, ``path`` (``""`` or ``/base``)."""

    scheme: str
    host: str
    port: int
    path: str

    def url(self) -> str:
        """The base URL, ``http://host:port[/path]`` (IPv6 bracketed), no trailing ``/``.

        Raises:
            ValueError: the scheme is not ``http`` or ``https`` (nothing else can be connected to).
        """
        if self.scheme not in ("http", "https"):
            raise ValueError(f"unsupported scheme {self.scheme!r} (use http or https)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


def ollama_host(value: str | None) -> OllamaHost:
    """Read an ``OLLAMA_HOST`` value the way Ollama does (``envconfig.Host``).

    Accepts ``host``, ``host:port``, ``:port``, ``scheme://host[:port][/path]`` and bracketed
    IPv6, in quotes or not. An empty host means ``127.0.0.1``; the port defaults to 11434
    (443 for ``https://``, as Ollama's); a trailing ``/`` of the path is dropped.

    Raises:
        ValueError: the port is not a number in 0..65535.
    """
    raw = (value or "").strip().strip("\"'")
    text = raw if "://" in raw else "http://" + raw
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"invalid port in {raw!r}") from None
    if port is None:
        port = 443 if scheme == "https" else OLLAMA_DEFAULT_PORT
    return OllamaHost(scheme, parts.hostname or "127.0.0.1", port, parts.path.rstrip("/"))


def parse_ollama_host(value: str) -> tuple[str, int]:
    """``(host, port)`` of :func:`ollama_host` (the listen address ``vllama serve`` reads).

    Raises:
        ValueError: the port is not a number in 0..65535.
    """
    where = ollama_host(value)
    return where.host, where.port


def error_text(body: Any) -> str | None:
    """The message inside an error body, or ``None`` when ``body`` is not one.

    The shapes: Ollama's ``{"error": "..."}``; OpenAI's and vLLM ≥0.10's ``{"error":
    {"message", "type", "code"}}``; older vLLM's ``{"object": "error", "message": ...}``
    (and any bare ``{"message": "..."}``); FastAPI's ``{"detail": ...}``.
    """
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, str):
        return err
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if "message" in body and (body.get("object") == "error" or isinstance(body["message"], str)):
        return str(body["message"])
    if "detail" in body:
        return str(body["detail"])
    return None


def error_message(raw: bytes, fallback: str) -> str:
    """The text of an HTTP error answer's body ``raw``: :func:`error_text` of its JSON, else the
    body's own text (its first 500 characters), else ``fallback`` (e.g. ``"HTTP 502"``)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace").strip()[:500] or fallback
    return error_text(data) or fallback


class CliParser(argparse.ArgumentParser):
    """The parser of ``vllama serve`` and the client commands: a mistyped option gets one line and
    a "did you mean", not the 30 lines of usage argparse prints first (issue 26.8)."""

    def error(self, message: str) -> NoReturn:
        import difflib

        hint = ""
        options = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        for word in re.findall(r"(--?[\w-]+)", message.split(":", 1)[-1]) if "unrecognized" in message else []:
            close = difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6)
            if close:
                hint = f" (did you mean {close[0]}?)"
                break
        self.exit(2, f"{self.prog}: error: {message}{hint}\n(`{self.prog} --help` lists the options)\n")
