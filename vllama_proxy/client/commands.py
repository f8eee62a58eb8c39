"""Ollama-style client commands, talking to a running server through the Ollama API.

  vllama list [PREFIX]         the models served (GET /api/tags)
  vllama ps                    the running models (GET /api/ps)
  vllama show M [--modelfile|--template|--parameters|--license]
                               a model's details (POST /api/show)
  vllama pull M                a served model: success at once; a Hugging Face id: downloaded into
                               the server's cache (POST /api/pull; tqdm bars from its NDJSON progress)
  vllama run M [PROMPT...]     chat (POST /api/chat): one prompt, piped stdin, or an interactive
                               session when neither is given and stdin is a terminal
  vllama stop M                ask the server to unload M (POST /api/generate, keep_alive 0)
  vllama cp SRC DST            another name for a model (POST /api/copy: an alias)
  vllama rm M...               forget a name made with cp, or delete a pulled model (DELETE /api/delete)

The server is ``--host`` or ``OLLAMA_HOST`` (default ``http://127.0.0.1:11434``; a bare host
gets port 11434, the scheme is optional), and ``OLLAMA_API_KEY`` is sent as a bearer token,
so these commands work against Ollama itself too. Loading shows a spinner with the server's
message (it reports no load fraction). Plain stdlib ``http.client``: every
command is a few blocking requests, and Ctrl-C during an answer simply closes the socket
(the server then aborts the generation in vLLM).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import orjson
from tqdm import tqdm

from vllama_proxy import __version__
from vllama_proxy.settings import CliParser, parse_ollama_host

from . import repl

COMMANDS = ("list", "ps", "show", "pull", "run", "stop", "cp", "rm")

DIM, RESET, CLEAR_LINE = "\x1b[2m", "\x1b[0m", "\x1b[K"


class ConnectError(Exception):
    """The server could not be reached at all."""


class ApiError(Exception):
    """The server answered ``{"error": message}`` (``status`` 0: inside a 200 stream);
    ``retry_after``: its ``Retry-After`` header, sent with a 503 that retrying will cure
    (a model loading, a busy server), absent when it will not (a model that failed to load)."""

    def __init__(self, message: str, status: int = 0, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


# ---------------------------------------------------------------------------- HTTP


class Client:
    """Blocking Ollama API client: one connection per request."""

    def __init__(self, host: str | None = None, connect_timeout: float = 10.0) -> None:
        raw = host if host is not None else os.environ.get("OLLAMA_HOST", "")
        self.https = raw.strip().strip("\"'").lower().startswith("https://")
        self.host, self.port = parse_ollama_host(raw)
        self.url = f"{'https' if self.https else 'http'}://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"
        self.connect_timeout = connect_timeout
        self.headers = {"User-Agent": f"vllama/{__version__}", "Accept": "application/json, application/x-ndjson"}
        if key := os.environ.get("OLLAMA_API_KEY"):
            self.headers["Authorization"] = f"Bearer {key}"

    def _open(self, method: str, path: str, body: Any = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.connect_timeout)
        try:
            conn.connect()
        except OSError as e:
            raise ConnectError(self.url) from e
        conn.sock.settimeout(None)  # generation may be slow to start; Ctrl-C is the way out
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        if not 200 <= resp.status < 300:
            raw = resp.read()
            conn.close()
            raise ApiError(_error_message(raw, resp), resp.status, resp.getheader("Retry-After"))
        return conn, resp

    def json(self, method: str, path: str, body: Any = None) -> Any:
        conn, resp = self._open(method, path, body)
        try:
            return orjson.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def probe(self, path: str) -> dict[str, Any]:
        """GET ``path`` and return its JSON object whatever the status (``/readyz`` says why in a
        503); ``{}`` when the body is no JSON object."""
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.connect_timeout)
        try:
            conn.request("GET", path, headers=self.headers)
            raw = conn.getresponse().read()
        finally:
            conn.close()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return {}
        return body if isinstance(body, dict) else {}

    @contextlib.contextmanager
    def stream(self, path: str, body: Any) -> Iterator[Iterator[dict[str, Any]]]:
        """POST ``body`` and yield an iterator over the NDJSON objects; closing the block closes the socket."""
        conn, resp = self._open("POST", path, body)

        def events() -> Iterator[dict[str, Any]]:
            for line in resp:
                if line.strip():
                    event = orjson.loads(line)
                    if event.get("error"):
                        raise ApiError(str(event["error"]))
                    yield event

        try:
            yield events()
        finally:
            resp.close()
            conn.close()


def _error_message(raw: bytes, resp: http.client.HTTPResponse) -> str:
    try:
        return str(orjson.loads(raw)["error"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        text = raw.decode(errors="replace").strip()
        return text or f"{resp.status} {resp.reason}"


# ---------------------------------------------------------------------------- formatting (Ollama's)


def human_bytes(n: int) -> str:
    """Ollama's ``format.HumanBytes``: decimal units, "2.7 GB", "12 MB", "512 B"."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            value = n / size
            return f"{int(value)} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def human_duration(seconds: float) -> str:
    """Ollama's ``format.humanDuration``: "Less than a second", "3 minutes", "About an hour", "2 weeks"."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = s // 60
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = round(seconds / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{int(seconds / 3600 / 24 / 365)} years"


def human_time(ts: str | None, zero: str = "Never", now: float | None = None) -> str:
    """``"3 minutes ago"``, ``"4 minutes from now"``, ``"Forever"`` (over ~20 years ahead) for an RFC 3339 time."""
    when = parse_time(ts)
    if when is None:
        return zero
    delta = (time.time() if now is None else now) - when
    if delta < -20 * 365 * 24 * 3600:
        return "Forever"
    return f"{human_duration(-delta)} from now" if delta < 0 else f"{human_duration(delta)} ago"


_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?$", re.IGNORECASE)


def parse_time(ts: str | None) -> float | None:
    """RFC 3339 (nanoseconds allowed) -> seconds since the epoch; None when empty or unparseable."""
    m = _RFC3339.match((ts or "").strip())
    if not m or m.group(1).startswith("0001-"):  # Go's zero time
        return None
    base, frac, zone = m.groups()
    zone = "+00:00" if zone in (None, "Z", "z") else zone
    when = datetime.strptime(base + zone.replace(":", ""), "%Y-%m-%dT%H:%M:%S%z")
    return when.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def go_duration(ns: int) -> str:
    """Nanoseconds as Go's ``time.Duration.String()``: "1.234s", "12.5ms", "1m2.5s", "800µs"."""

    def dec(value: int, digits: int) -> str:
        whole, frac = divmod(value, 10**digits)
        return f"{whole}.{frac:0{digits}d}".rstrip("0").rstrip(".")

    if ns == 0:
        return "0s"
    if ns < 1_000:
        return f"{ns}ns"
    if ns < 1_000_000:
        return dec(ns, 3) + "µs"
    if ns < 1_000_000_000:
        return dec(ns, 6) + "ms"
    hours, ns = divmod(ns, 3600 * 10**9)
    minutes, ns = divmod(ns, 60 * 10**9)
    out = f"{hours}h{minutes}m" if hours else (f"{minutes}m" if minutes else "")
    return out + dec(ns, 9) + "s"


def short_digest(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def table(rows: list[list[str]], indent: str = "", pad: int = 4) -> str:
    """Left-aligned columns separated by at least ``pad`` spaces (Ollama's tablewriter settings)."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    lines = [indent + "".join(cell.ljust(widths[i] + pad) for i, cell in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


class Spinner:
    """A braille spinner with a message on stderr, drawn by a thread; nothing when stderr is not a TTY.
    With ``elapsed`` the seconds since it started follow the message ("loading qwen2.5:7b (12s)")."""

    FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, message: str = "", elapsed: bool = False) -> None:
        self.message = message
        self.elapsed = elapsed
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Spinner:
        if sys.stderr.isatty():
            self._thread = threading.Thread(target=self._draw, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def drawing(self) -> bool:
        """Whether it is on screen (stderr is a terminal and it was not stopped)."""
        return self._thread is not None

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            sys.stderr.write("\r" + CLEAR_LINE)
            sys.stderr.flush()

    def _draw(self) -> None:
        i = 0
        while not self._stop.wait(0.1 if i else 0):
            tail = f" ({time.monotonic() - self.started:.0f}s)" if self.elapsed else ""
            sys.stderr.write(f"\r{self.FRAMES[i % len(self.FRAMES)]} {self.message}{tail}{CLEAR_LINE}")
            sys.stderr.flush()
            i += 1


# ---------------------------------------------------------------------------- list, ps, show, stop


def cmd_list(client: Client, args: argparse.Namespace) -> int:
    models = client.json("GET", "/api/tags").get("models") or []
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for m in models:
        if args.prefix and not m["name"].lower().startswith(args.prefix.lower()):
            continue
        rows.append([m["name"], short_digest(m.get("digest", "")), human_bytes(m.get("size", 0)), human_time(m.get("modified_at"))])
    sys.stdout.write(table(rows))
    return 0


def processor(size: int, size_vram: int) -> str:
    """Ollama's PROCESSOR column; vLLM's measured VRAM includes the KV cache, so more than ``size`` is all GPU.
    Neither known (a model in a vLLM that vllama only proxies, its files not on this host): ``unknown``."""
    if size <= 0 and size_vram <= 0:
        return "unknown"
    if size_vram <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    cpu = round((size - size_vram) / size * 100)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def cmd_ps(client: Client, args: argparse.Namespace) -> int:
    models = client.json("GET", "/api/ps").get("models") or []
    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]]
    for m in models:
        size, vram = m.get("size", 0), m.get("size_vram", 0)
        expires = parse_time(m.get("expires_at"))
        until = "Stopping..." if expires is not None and expires < time.time() else human_time(m.get("expires_at"))
        rows.append([m["name"], short_digest(m.get("digest", "")), human_bytes(vram or size) if vram or size else "unknown",
                     processor(size, vram),
                     str(m.get("context_length") or ""), until])
    sys.stdout.write(table(rows))
    return 0


def human_number(n: int) -> str:
    """Ollama's ``format.HumanNumber``: 7615616512 -> "7.6B", 494032768 -> "494.03M", 1500 -> "2K"."""
    for unit, size, digits in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 0)):
        if n >= size:
            value = n / size
            return f"{value:.{0 if value == int(value) else digits}f}{unit}"
    return str(n)


def cmd_show(client: Client, args: argparse.Namespace) -> int:
    info = client.json("POST", "/api/show", {"model": args.model})
    for flag in ("modelfile", "template", "parameters", "license"):
        if getattr(args, flag):
            print(info.get(flag) or "")
            return 0
    print(show_info(info))
    return 0


def show_info(info: dict[str, Any]) -> str:
    """``/api/show``'s answer as Ollama's ``showInfo`` prints it: Model, Capabilities, Parameters, License."""
    details, model_info = info.get("details") or {}, info.get("model_info") or {}
    arch = model_info.get("general.architecture") or details.get("family", "")
    model_rows = [["architecture", arch]]
    if model_info.get("general.parameter_count"):
        model_rows.append(["parameters", human_number(int(model_info["general.parameter_count"]))])
    elif details.get("parameter_size"):
        model_rows.append(["parameters", details["parameter_size"]])
    for label, key in (("context length", "context_length"), ("embedding length", "embedding_length")):
        if model_info.get(f"{arch}.{key}") is not None:
            model_rows.append([label, str(model_info[f"{arch}.{key}"])])
    if details.get("quantization_level"):
        model_rows.append(["quantization", details["quantization_level"]])
    sections = [("Model", model_rows), ("Capabilities", [[c] for c in info.get("capabilities") or []])]
    params = [line.split(None, 1) for line in (info.get("parameters") or "").splitlines() if line.strip()]
    sections.append(("Parameters", [p + [""] * (2 - len(p)) for p in params]))
    license_lines = [line for line in (info.get("license") or "").splitlines() if line.strip()]
    sections.append(("License", [[line] for line in license_lines[:2]] + ([["..."]] if len(license_lines) > 2 else [])))
    out = []
    for title, rows in sections:
        if rows:
            out.append(f"  {title}\n" + table(rows, indent="    "))
    return "\n".join(out)


def cmd_stop(client: Client, args: argparse.Namespace) -> int:
    """Ollama's ``stop``: unload with ``keep_alive: 0``; prints nothing, as Ollama's does."""
    client.json("POST", "/api/generate", {"model": args.model, "prompt": "", "keep_alive": 0})
    return 0


def print_version(host: str | None = None) -> int:
    """``vllama -v``, as ``ollama -v`` prints it: the server's version (at ``OLLAMA_HOST``), and the
    client's when it differs or no server answers (``/api/version``: ``{"version", "vllama"}``)."""
    try:
        info = Client(host, connect_timeout=2.0).json("GET", "/api/version")
    except (ConnectError, ApiError, OSError, http.client.HTTPException, ValueError):
        info = None
        print("Warning: could not connect to a running vllama instance")
    server = (info or {}).get("vllama")
    if server:
        print(f"vllama version is {server}")
    elif info:  # an Ollama server: it says only its own version
        print(f"ollama version is {info.get('version')}")
    if server != __version__:
        print(f"Warning: client version is {__version__}")
    return 0


def cmd_cp(client: Client, args: argparse.Namespace) -> int:
    """Ollama's ``cp SOURCE DESTINATION``: vllama keeps the new name as an alias."""
    client.json("POST", "/api/copy", {"source": args.source, "destination": args.destination})
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def cmd_rm(client: Client, args: argparse.Namespace) -> int:
    """Ollama's ``rm MODEL...``: an alias is forgotten, a cached Hugging Face model deleted."""
    for model in args.models:
        client.json("DELETE", "/api/delete", {"model": model})
        print(f"deleted '{model}'")
    return 0


# ---------------------------------------------------------------------------- pull


class PullProgress:
    """Pull progress as Ollama's CLI shows it: each status once, and a byte bar per file (digest)
    drawn by tqdm on a terminal; a file's status line only when the output is not a terminal.

    Args:
        out: where to draw (stderr).
        tty: draw bars (default: whether ``out`` is a terminal).
    """

    def __init__(self, out=None, tty: bool | None = None) -> None:
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.bars: dict[str, tqdm] = {}
        self.status: str | None = None

    def update(self, event: dict[str, Any]) -> None:
        status = event.get("status", "")
        digest, total, completed = event.get("digest"), event.get("total") or 0, event.get("completed") or 0
        if digest and total and self.tty:
            bar = self.bars.get(digest)
            if bar is None:
                bar = self.bars[digest] = tqdm(total=total, desc=status, unit="B", unit_scale=True, unit_divisor=1000,
                                               file=self.out, dynamic_ncols=True, mininterval=0.1, leave=True)
            bar.update(max(0, min(completed, total) - bar.n))
        elif status != self.status:
            if not digest:  # a step after the files ("verifying", "success"): below their bars, as Ollama's
                self.close()
            tqdm.write(status, file=self.out)
            self.out.flush()
        self.status = status

    def close(self) -> None:
        """Finish the bars (they stay on screen); a later event of the same file starts a new one."""
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()


def cmd_pull(client: Client, args: argparse.Namespace) -> int:
    progress = PullProgress()
    try:
        with client.stream("/api/pull", {"model": args.model, "insecure": args.insecure, "stream": True}) as events:
            for event in events:
                progress.update(event)
    finally:
        progress.close()
    return 0


# ---------------------------------------------------------------------------- run

def parse_think(value: str | None) -> bool | str | None:
    if value is None:
        return None
    value = value.lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    if value in ("low", "medium", "high"):
        return value
    raise argparse.ArgumentTypeError(f"invalid --think value {value!r} (true, false, low, medium, high)")


#: What the spinner says while a model in this server state comes up (``/readyz``'s ``state``).
LOADING_VERBS = {"starting": "loading", "unloaded": "loading", "sleeping": "waking", "restarting": "restarting",
                 "unhealthy": "restarting", "ready": "loading"}


def load_state(client: Client, model: str) -> str | None:
    """The server's state of ``model`` from vllama's ``/readyz`` (``starting``, ``sleeping``, ...);
    None when the server does not say (Ollama has no ``/readyz``; a model not yet claimed)."""
    try:
        body = client.probe("/readyz")
    except (ConnectError, OSError, http.client.HTTPException):
        return None
    want = model.removesuffix(":latest").casefold()
    entries = body.get("models") or ([body] if "state" in body and "model" in body else [])
    for entry in entries:
        if str(entry.get("model", "")).removesuffix(":latest").casefold() == want:
            return entry.get("state")
    return None


def watch_loading(client: Client, model: str, spinner: Spinner, done: threading.Event) -> None:
    """Until ``done``: put the server's state of ``model`` into ``spinner``'s message, once a second
    (``loading qwen2.5:7b: vLLM starting``), as ``ollama run`` shows a spinner while it loads."""
    while not done.wait(1.0):
        state = load_state(client, model)
        if state is not None and not done.is_set():
            spinner.message = f"{LOADING_VERBS.get(state, 'loading')} {model}: vLLM {state}"


def preload(client: Client, args: argparse.Namespace) -> None:
    """Load the model (an empty prompt, as ``ollama run`` does) behind a spinner that says what the
    server reports and for how long; 503s with ``Retry-After`` (loading) are retried with backoff
    up to ``--load-timeout``.

    Raises:
        ApiError: any other error at once, a 503 without ``Retry-After`` included: the model
            failed to load, and no wait will change that (Ollama fails at once too; issue 26.2).
    """
    body: dict[str, Any] = {"model": args.model, "prompt": ""}
    if args.keepalive is not None:
        body["keep_alive"] = args.keepalive
    deadline, delay = time.monotonic() + args.load_timeout, 0.25
    done = threading.Event()
    with Spinner(f"loading {args.model}", elapsed=True) as spinner:
        if spinner.drawing:
            watcher = Client(client.url, connect_timeout=2.0)
            threading.Thread(target=watch_loading, args=(watcher, args.model, spinner, done), daemon=True).start()
        try:
            while True:
                try:
                    client.json("POST", "/api/generate", body)
                    return
                except ApiError as e:
                    if e.status != 503 or e.retry_after is None:
                        raise
                    if time.monotonic() + delay > deadline:
                        raise ApiError(f"{e} (gave up after {args.load_timeout:g} s)", e.status) from None
                    time.sleep(max(delay, min(_seconds(e.retry_after), 5.0)))
                    delay = min(delay * 2, 5.0)
        finally:
            done.set()


def _seconds(retry_after: str) -> float:
    try:
        return float(retry_after)
    except ValueError:  # an HTTP date: not sent by vllama; back off as usual
        return 0.0


def chat_once(client: Client, args: argparse.Namespace, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Stream one answer to stdout; returns the assistant message. Ctrl-C propagates after the socket is closed."""
    body: dict[str, Any] = {"model": args.model, "messages": messages, "stream": True}
    for key, value in (("think", args.think), ("format", args.format), ("keep_alive", args.keepalive),
                       ("options", getattr(args, "options", None) or None)):
        if value is not None:
            body[key] = value
    show_thinking = bool(args.think) and not args.hidethinking
    tty = sys.stdout.isatty()
    out = sys.stdout
    wrap = repl.WordWrap(out, shutil.get_terminal_size().columns - 5) if tty and getattr(args, "wordwrap", False) else None
    content: list[str] = []
    final: dict[str, Any] = {}
    thinking = False
    spinner = Spinner()
    with spinner, client.stream("/api/chat", body) as events:
        for event in events:
            spinner.stop()
            msg = event.get("message") or {}
            if msg.get("thinking") and show_thinking:
                if not thinking:
                    out.write((DIM if tty else "") + "Thinking...\n")
                    thinking = True
                out.write(msg["thinking"])
            if msg.get("content"):
                if thinking:
                    out.write("\n...done thinking.\n\n" + (RESET if tty else ""))
                    thinking = False
                (wrap or out).write(msg["content"])
                content.append(msg["content"])
            out.flush()
            if event.get("done"):
                final = event
    if wrap is not None:
        wrap.close()
    if thinking:
        out.write("\n...done thinking." + (RESET if tty else ""))
    answer = "".join(content)
    if not answer.endswith("\n"):
        out.write("\n")
    out.flush()
    if args.verbose:
        print_stats(final)
    return {"role": "assistant", "content": answer}


def print_stats(final: dict[str, Any]) -> None:
    """Ollama's ``--verbose`` summary on stderr (API durations are nanoseconds)."""
    lines = []
    for label, key in (("total duration", "total_duration"), ("load duration", "load_duration")):
        if final.get(key):
            lines.append((label, go_duration(final[key])))
    for name in ("prompt_eval", "eval"):
        count, duration = final.get(f"{name}_count") or 0, final.get(f"{name}_duration") or 0
        label = name.replace("_", " ")
        if count:
            lines.append((f"{label} count", f"{count} token(s)"))
        if duration:
            lines.append((f"{label} duration", go_duration(duration)))
            lines.append((f"{label} rate", f"{count / (duration / 1e9):.2f} tokens/s"))
    sys.stderr.write("".join(f"{label + ':':<22}{value}\n" for label, value in lines))
    sys.stderr.flush()


class Session:
    """What one ``>>>`` session holds: the messages, the system message, the options set with
    ``/set parameter``; the rest (verbose, think, format, wordwrap) lives on ``args``."""

    def __init__(self, client: Client, args: argparse.Namespace) -> None:
        self.client, self.args = client, args
        self.messages: list[dict[str, Any]] = []
        self.system = ""
        self.args.options = getattr(args, "options", None) or {}
        try:
            import readline
        except ImportError:  # pragma: no cover - Windows
            readline = None
        self.readline = readline

    # -- commands ----------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Apply slash command ``line`` (Ollama's, ``repl.py``); True to end the session."""
        words = line.split()
        name = words[0]
        if name in ("/bye", "/exit"):
            return True
        if name in ("/?", "/help"):
            topic = words[1] if len(words) > 1 else ""
            text = {"set": repl.USAGE_SET, "/set": repl.USAGE_SET, "show": repl.USAGE_SHOW, "/show": repl.USAGE_SHOW,
                    "shortcut": repl.USAGE_SHORTCUTS, "shortcuts": repl.USAGE_SHORTCUTS}.get(topic, "" if topic else repl.USAGE)
            sys.stderr.write(text + ("\n" if text else ""))
        elif name == "/clear":
            self.messages = [{"role": "system", "content": self.system}] if self.system else []
            print("Cleared session context")
        elif name == "/set":
            self.set(words[1:], line)
        elif name == "/show":
            self.show(words[1:])
        elif name == "/load":
            self.load(words[1:])
        elif name == "/save":
            self.save(words[1:])
        elif name == "/list":
            cmd_list(self.client, argparse.Namespace(prefix=words[1] if len(words) > 1 else None))
        else:
            print(f"Unknown command '{name}'. Type /? for help")
        return False

    def set(self, words: list[str], line: str) -> None:
        args = self.args
        if not words:
            sys.stderr.write(repl.USAGE_SET + "\n")
            return
        what = words[0]
        modes = {"verbose": ("verbose", True), "quiet": ("verbose", False), "wordwrap": ("wordwrap", True),
                 "nowordwrap": ("wordwrap", False)}
        if what in modes:
            setattr(args, *modes[what])
            print(f"Set '{what}' mode.")
        elif what in ("history", "nohistory"):
            if self.readline is not None:
                self.readline.set_auto_history(what == "history")
        elif what == "think":
            args.think = words[1] if len(words) > 1 else True
            print(f"Set 'think' mode to '{words[1]}'." if len(words) > 1 else "Set 'think' mode.")
        elif what == "nothink":
            args.think = False
            print("Set 'nothink' mode.")
        elif what == "format":
            if len(words) < 2 or words[1] != "json":
                print("Invalid or missing format. For 'json' mode use '/set format json'")
            else:
                args.format = "json"
                print("Set format to 'json' mode.")
        elif what == "noformat":
            args.format = None
            print("Disabled format.")
        elif what == "parameter":
            if len(words) < 3:
                sys.stderr.write(repl.USAGE_PARAMETERS + "\n")
                return
            try:
                args.options[words[1]] = repl.parse_parameter(words[1], words[2:])
            except ValueError as e:
                print(f'Couldn\'t set parameter: "{e}"')
                return
            print(f"Set parameter '{words[1]}' to '{', '.join(words[2:])}'")
        elif what == "system":
            if len(words) < 2:
                sys.stderr.write(repl.USAGE_SET + "\n")
                return
            text = line.split("system", 1)[1].strip()
            if text.startswith('"""'):
                text = text[3:].removesuffix('"""').strip("\n")
            self.system = text
            message = {"role": "system", "content": text}
            if self.messages and self.messages[-1]["role"] == "system":
                self.messages[-1] = message
            else:
                self.messages.append(message)
            print("Set system message.")
        else:
            print(f"Unknown command '/set {what}'. Type /? for help")

    def show(self, words: list[str]) -> None:
        if not words:
            sys.stderr.write(repl.USAGE_SHOW + "\n")
            return
        try:
            info = self.client.json("POST", "/api/show", {"model": self.args.model})
        except ApiError as e:
            print("error: couldn't get model")
            print(f"Error: {e}", file=sys.stderr)
            return
        what = words[0]
        if what == "info":
            sys.stderr.write(show_info(info) + "\n")
        elif what == "license":
            print(info.get("license") or "No license was specified for this model.")
        elif what == "modelfile":
            print(info.get("modelfile") or "")
        elif what == "parameters":
            print("Model defined parameters:")
            params = info.get("parameters") or ""
            if not params:
                print("  No additional parameters were specified for this model.")
            for row in params.splitlines():
                print(f"  {row}")
            print()
            if self.args.options:
                print("User defined parameters:")
                for key, value in self.args.options.items():
                    print(f"  {key:<30} {repl.go_value(value)}")
                print()
        elif what == "system":
            system = self.system or info.get("system") or ""
            print(system + "\n" if system else "No system message was specified for this model.")
        elif what == "template":
            print(info.get("template") or "No prompt template was specified for this model.")
        else:
            print(f"Unknown command '/show {what}'. Type /? for help")

    def load(self, words: list[str]) -> None:
        if len(words) != 1:
            print("Usage:\n  /load <modelname>")
            return
        previous = self.args.model
        self.args.model = words[0]
        print(f"Loading model '{words[0]}'")
        try:
            preload(self.client, self.args)
        except ApiError as e:
            self.args.model = previous
            if e.status == 404:
                print(f"Couldn't find model '{words[0]}'")
            else:
                print(f"Error: {e}", file=sys.stderr)
            return
        self.messages = []

    def save(self, words: list[str]) -> None:
        if len(words) != 1:
            print("Usage:\n  /save <modelname>")
            return
        body: dict[str, Any] = {"model": words[0], "from": self.args.model, "messages": self.messages}
        if self.system:
            body["system"] = self.system
        if self.args.options:
            body["parameters"] = self.args.options
        try:
            self.client.json("POST", "/api/create", body)
        except ApiError as e:
            print(f"error: {e}")
            return
        print(f"Created new model '{words[0]}'")

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> int:
        """The ``>>>`` loop: history kept, /bye or Ctrl-D exits, Ctrl-C stops an answer."""
        while True:
            try:
                text = repl.read_entry()
            except KeyboardInterrupt:
                print("\nUse Ctrl + d or /bye to exit.")
                continue
            if text is None:
                return 0
            stripped = text.strip()
            if not stripped:
                continue
            if stripped.startswith("/"):
                if self.command(stripped):
                    return 0
                continue
            if stripped.startswith('"""'):
                text = stripped[3:].removesuffix('"""').strip("\n")
            self.messages.append({"role": "user", "content": text})
            try:
                self.messages.append(chat_once(self.client, self.args, self.messages))
            except KeyboardInterrupt:
                self.messages.pop()  # the unanswered question leaves the history
                sys.stdout.write((RESET if sys.stdout.isatty() else "") + "\n")
            except ApiError as e:
                self.messages.pop()
                print(f"Error: {e}", file=sys.stderr)
            print()


def interactive(client: Client, args: argparse.Namespace) -> int:
    """Chat with ``args.model`` at the ``>>>`` prompt until /bye or Ctrl-D; returns the exit status."""
    return Session(client, args).run()


def cmd_run(client: Client, args: argparse.Namespace) -> int:
    prompt = " ".join(args.prompt)
    piped = not sys.stdin.isatty()
    if piped:  # like ollama: stdin first, then the arguments
        prompt = " ".join(p for p in (sys.stdin.read(), prompt) if p)
    try:  # as `ollama run`: a model the server does not have is pulled first, with progress
        client.json("POST", "/api/show", {"model": args.model})
    except ApiError as e:
        if e.status == 404:
            cmd_pull(client, argparse.Namespace(model=args.model, insecure=False))
        # anything else (a model still loading: 503) is preload's to wait for or report
    preload(client, args)
    if not piped and not prompt:
        return interactive(client, args)
    if not prompt.strip():  # nothing piped in: the model is loaded, nothing to ask
        return 0
    chat_once(client, args, [{"role": "user", "content": prompt}])
    return 0


# ---------------------------------------------------------------------------- dispatch


def _parser(command: str) -> argparse.ArgumentParser:
    p = CliParser(prog=f"vllama {command}")
    p.add_argument("--host", help="server URL (default: OLLAMA_HOST, else http://127.0.0.1:11434)")
    if command == "list":
        p.description = "List the models the server serves."
        p.add_argument("prefix", nargs="?", help="only names starting with this")
    elif command == "ps":
        p.description = "List the running models."
    elif command == "show":
        p.description = "Show a model's details."
        p.add_argument("model")
        for flag in ("modelfile", "template", "parameters", "license"):
            p.add_argument(f"--{flag}", action="store_true", help=f"print only the {flag}")
    elif command == "pull":
        p.description = "Pull a model (vllama: succeeds for a served model)."
        p.add_argument("model")
        p.add_argument("--insecure", action="store_true", help="allow insecure registries")
    elif command == "run":
        p.description = "Chat with a model: PROMPT, piped stdin, or interactively."
        p.add_argument("model", nargs="?")  # checked in main: argparse would call the prompt required too
        p.add_argument("prompt", nargs="*", help="the prompt (none: piped stdin, or an interactive session)")
        p.add_argument("--verbose", action="store_true", help="show timings after each answer")
        p.add_argument("--think", type=parse_think, metavar="[=LEVEL]",
                       help="ask for thinking and show it (--think, --think=false, --think=high)")
        p.add_argument("--hidethinking", action="store_true", help="think, but do not show the thinking")
        p.add_argument("--nowordwrap", dest="wordwrap", action="store_false",
                       help="do not wrap words to the next line automatically")
        p.add_argument("--format", help='response format, e.g. "json"')
        p.add_argument("--keepalive", help='how long the model stays loaded, e.g. "5m"')
        p.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for the model to load (600)")
    elif command == "stop":
        p.description = "Ask the server to unload a model."
        p.add_argument("model")
    elif command == "cp":
        p.description = "Give a model another name (an alias every client can use)."
        p.add_argument("source")
        p.add_argument("destination")
    elif command == "rm":
        p.description = "Remove a name made with cp, or a pulled model from the cache."
        p.add_argument("models", nargs="+", metavar="model")
    return p


HANDLERS = {"list": cmd_list, "ps": cmd_ps, "show": cmd_show, "pull": cmd_pull, "run": cmd_run, "stop": cmd_stop,
            "cp": cmd_cp, "rm": cmd_rm}


def main(command: str, argv: list[str]) -> int:
    """Run client ``command`` (one of ``COMMANDS``) with its arguments; returns the exit status."""
    if command not in HANDLERS:
        print(f"vllama: unknown command {command!r} (one of {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    if command == "run":  # a bare --think must not swallow the model name
        argv = ["--think=true" if a == "--think" else a for a in argv]
    try:
        args = _parser(command).parse_intermixed_args(argv)  # flags may follow the prompt words
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if command == "run" and args.model is None:  # Ollama: "requires at least 1 arg(s)"; the prompt is optional
        print("vllama run: error: name a model: vllama run MODEL [PROMPT...]\n(`vllama run --help` lists the options)",
              file=sys.stderr)
        return 2
    if command == "run" and args.hidethinking and args.think is None:
        args.think = True
    try:
        client = Client(args.host)
    except ValueError as e:
        print(f"Error: invalid host: {e}", file=sys.stderr)
        return 1
    try:
        return HANDLERS[command](client, args)
    except ConnectError as e:
        print(f"Error: could not connect to vllama at {e} (is `vllama serve` running?)", file=sys.stderr)
    except ApiError as e:
        print(f"Error: {e}", file=sys.stderr)
    except (OSError, http.client.HTTPException) as e:
        if isinstance(e, BrokenPipeError):  # `vllama list | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        print(f"Error: lost the connection to vllama at {client.url}: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1
