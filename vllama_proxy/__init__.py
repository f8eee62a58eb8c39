"""vllama: the Ollama API in front of vLLM's OpenAI-compatible server.

The package root is the one module both sides share: the server (``settings/``, ``upstream/``) and the
client (``client/``, which imports nothing else of the package, ``tests/test_import_graph.py``). It holds what
both read off the wire the same way, and imports only the standard library and orjson: :func:`ollama_host`
(an ``OLLAMA_HOST`` value: where the server listens and the client connects), :func:`error_text` /
:func:`error_message` (the message inside an error body of Ollama, OpenAI, vLLM or FastAPI),
:class:`CliParser` (the commands' argparse parser, with a "did you mean") and :func:`read_modelfile`
(Ollama's Modelfile grammar).
"""

from __future__ import annotations

import argparse
import json
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
    a "did you mean", not the 30 lines of usage argparse prints first."""

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


class ModelfileError(ValueError):
    """A Modelfile that :func:`read_modelfile` cannot read; the message says which line and why."""


_MODELFILE_COMMAND = re.compile(r"(?i)^\s*(FROM|ADAPTER|SYSTEM|TEMPLATE|PARAMETER|MESSAGE|LICENSE|REQUIRES|DRAFT|RENDERER|PARSER)\s+(.*)$")


def read_modelfile(text: str) -> dict[str, Any]:
    """A Modelfile -> the fields of Ollama's create request (``from``, ``system``, ``template``,
    ``parameters``, ``messages``, ``license``, ``adapters`` as a list of sources; Ollama 0.33's ``draft``,
    ``requires``, ``renderer``, ``parser`` as written).

    Ollama's ``parser/parser.go`` grammar: one command per line, ``\"\"\"`` for text over several
    lines, ``#`` comments; a ``PARAMETER``'s value typed (int, float, bool, else the text), each
    ``stop`` added to a list. ``FROM`` and ``ADAPTER`` are kept as written (the client resolves a
    path against the Modelfile's directory).

    Raises:
        ModelfileError: a line that is no command, an unterminated ``\"\"\"``, a bad ``MESSAGE`` role.
    """
    out: dict[str, Any] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _MODELFILE_COMMAND.match(line)
        if m is None:
            raise ModelfileError(f"invalid Modelfile line {i}: {line.strip()[:60]!r} (commands: FROM, SYSTEM, PARAMETER, MESSAGE, ...)")
        cmd, rest = m.group(1).upper(), m.group(2)
        if cmd in ("PARAMETER", "MESSAGE"):
            key, _, rest = rest.strip().partition(" ")
        if rest.lstrip().startswith('"""'):
            body = rest.lstrip()[3:]
            while '"""' not in body:
                if i >= len(lines):
                    raise ModelfileError('invalid Modelfile: unterminated """')
                body += "\n" + lines[i]
                i += 1
            value = body[: body.index('"""')]
        else:
            value = rest.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                try:
                    value = json.loads(value) if cmd == "PARAMETER" else value[1:-1]
                except ValueError:
                    raise ModelfileError(f"invalid Modelfile line {i}: {line.strip()[:60]!r} is not a quoted string") from None
        if cmd == "FROM":
            out["from"] = value
        elif cmd in ("SYSTEM", "TEMPLATE"):
            out[cmd.lower()] = value
        elif cmd == "LICENSE":
            out.setdefault("license", []).append(value)
        elif cmd == "ADAPTER":
            out.setdefault("adapters", []).append(value)
        elif cmd in ("DRAFT", "REQUIRES", "RENDERER", "PARSER"):  # Ollama 0.33's: one each, the last wins
            out[cmd.lower()] = value
        elif cmd == "MESSAGE":
            if key not in ("system", "user", "assistant"):
                raise ModelfileError(f'invalid Modelfile: MESSAGE role "{key}" is none of system, user, assistant')
            out.setdefault("messages", []).append({"role": key, "content": value})
        elif cmd == "PARAMETER":
            params = out.setdefault("parameters", {})
            if key == "stop":
                params.setdefault("stop", []).append(str(value))
            else:
                params[key] = _typed(value)
    return out


def _typed(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    if value in ("true", "false"):
        return value == "true"
    return value
