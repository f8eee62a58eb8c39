"""``vllama batch``: run an OpenAI-batch style JSONL file through a running vllama server.

::

    vllama batch requests.jsonl -o results.jsonl [--concurrency N] [--host URL] [--api-key KEY]
                 [--retries 5] [--retry-backoff 1.0] [--read-timeout 3600] [--restart | --retry-failed]

Input
-----
One JSON object per line, OpenAI Batch API format::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "...", ...}}

``url`` is one of ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` (OpenAI
surface, passed to vLLM) or ``/api/chat``, ``/api/generate``, ``/api/embed`` (Ollama surface).
Generation requests are sent with ``"stream": false`` (and without ``stream_options``)
whatever the line says. ``method``, when present, must be ``POST``. Blank lines are ignored
and not counted. ``custom_id`` must be a non-empty string, unique in the file.

An invalid line (not JSON, not an object, no ``custom_id``, unsupported ``url``, ``body`` not
an object, a ``custom_id`` already used by an earlier line) is not sent: it gets an error
result with code ``invalid_line``. A repeated ``custom_id`` is written as ``null`` there (the
message names it), so every ``custom_id`` occurs exactly once in the output.

Output
------
One line per input line, in completion order, OpenAI Batch output format::

    {"id": "batch_req_<n>", "custom_id": "q1", "response": {"status_code": 200, "body": {...}}, "error": null}

``<n>`` is the 1-based input line number, so ids are stable across resumed runs. A
non-2xx answer keeps ``response`` (status and the server's body) and adds
``"error": {"message": ..., "code": "http_error"}``. Requests that got no answer have
``"response": null`` and ``code`` ``connection_error`` (retries exhausted) or ``timeout``
(no byte for ``--read-timeout`` s); a 2xx answer that is not JSON is ``invalid_response``.

Retries: 503 (``server busy`` beyond ``--max-queue``, or a model still loading) and 429
are retried after ``Retry-After`` (at least) or an exponential backoff
(``--retry-backoff`` s doubling, capped at 60 s, with jitter), and so are connection
failures (refused, reset, connect timeout), at most ``--retries`` times. Any other status
is a final result: a 4xx is the request's own fault and would fail again.

Writing and resuming
--------------------
Each result is appended as one ``write`` of the whole line (``O_APPEND``, no user-space
buffer) the moment its request finishes; the file is fsynced at most every 0.5 s and at
exit. On start, when the output exists, its complete lines are read and the input lines
already answered there are skipped (matched by ``custom_id``; lines without a usable
``custom_id`` by ``id``, i.e. line number). A trailing partial line (a crash mid-write,
a power loss) is truncated away first; a complete line that is not JSON stops the run
(fix the file or use ``--restart``). Requests in flight when the run was stopped have no
line and are sent again, so the final output has every input line exactly once.
``--restart`` empties the output first; ``--retry-failed`` removes results that failed
for a transient reason (no response, 5xx, 429) from it and sends those lines again.

Exit codes: 0 when every input line has a result (error results included), 1 on usage
errors (bad flags, unreadable input, corrupt output, server unreachable or refusing the
API key) and unexpected failures (disk full), 130 on SIGINT / 143 on SIGTERM after
writing and syncing what finished (in-flight requests are cancelled; resume redoes them).

Concurrency
-----------
Without ``--concurrency`` the run keeps the server's running capacity busy: vllama's
``GET /api/version`` says how many requests vLLM runs at once (``max_running``: each
model's ``--max-num-seqs`` x data-parallel size), and the batch keeps that many plus a
quarter in flight, so vLLM already holds the next request when one finishes (a lone
client at 64 in flight streamed 0.78x of vLLM's offline ``LLM.generate`` on an H100,
issue 28). A server that does not say (another Ollama-API server, ``vllama serve
--upstream`` without ``--max-running``) gets ``FALLBACK_CONCURRENCY``. The choice is
printed. The open-file limit is raised to its hard limit when the connections need it.

Progress goes to stderr: on a terminal a tqdm bar (done/total, ok, errors, output tokens/s,
requests/s, ETA), otherwise a log line every 5 s: done/total, ok/errors, requests/s, output
tokens/s (``usage.completion_tokens`` or Ollama's ``eval_count``), ETA.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import orjson
from tqdm import tqdm

from vllama_proxy import error_message, ollama_host

#: Accepted ``url`` values.
URLS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/chat", "/api/generate", "/api/embed"})
#: Generation endpoints: sent with ``"stream": false``.
_GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"})
#: Statuses worth another attempt (server busy / loading, rate limited).
_RETRY_STATUS = frozenset({429, 503})
SYNC_INTERVAL = 0.5  # s between fsyncs of the output while results arrive
BACKOFF_MAX = 60.0  # s, cap of one retry delay
#: Requests in flight when the server does not say how many it runs at once.
FALLBACK_CONCURRENCY = 64
#: Seconds between plain progress lines when stderr is not a terminal.
PLAIN_INTERVAL = 5.0

Key = tuple[str, str]  # ("c", custom_id) or ("i", "batch_req_<n>"): what marks an input line as answered


class BatchError(Exception):
    """A problem that stops the whole run before or instead of sending (exit code 1)."""


# --------------------------------------------------------------------------- input


@dataclass(frozen=True)
class Item:
    """One non-blank input line.

    ``custom_id`` is ``None`` when the line has no usable one (or repeats an earlier
    line's); ``error`` is why the line is not sent (``None``: it is valid).
    """

    line: int  # 1-based line number in the input
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    error: str | None = None

    @property
    def id(self) -> str:
        """The output ``id``: ``batch_req_<line>``."""
        return f"batch_req_{self.line}"

    @property
    def key(self) -> Key:
        """What identifies this line's result in the output (see ``_result_key``)."""
        return ("c", self.custom_id) if self.custom_id is not None else ("i", self.id)


def parse_line(raw: bytes, line: int) -> Item:
    """Validate one input line (everything but ``custom_id`` uniqueness).

    Args:
        raw: the line's bytes, newline included or not.
        line: its 1-based number.

    Returns:
        An ``Item``; invalid lines have ``error`` set (never raises).
    """
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return Item(line, None, error=f"line {line}: invalid JSON: {e}")
    if not isinstance(obj, dict):
        return Item(line, None, error=f"line {line}: not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Item(line, None, error=f"line {line}: custom_id must be a non-empty string")
    url = obj.get("url")
    if url not in URLS:
        return Item(line, cid, error=f"line {line}: unsupported url {url!r}; use one of {', '.join(sorted(URLS))}")
    method = obj.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        return Item(line, cid, error=f"line {line}: method must be POST, not {method!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return Item(line, cid, error=f"line {line}: body must be a JSON object")
    return Item(line, cid, url, body)


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of the non-blank lines of ``path``."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


@dataclass
class InputScan:
    """First pass over the input: what a run has to do."""

    total: int  # non-blank lines
    duplicates: set[int]  # line numbers repeating an earlier line's custom_id
    keys: list[tuple[Key, bool]]  # per non-blank line, in order: its result key, whether it is sent


def scan_input(path: Path) -> InputScan:
    """Read the whole input once: count lines, find repeated ``custom_id`` values.

    Raises:
        BatchError: the input cannot be read.
    """
    seen: set[str] = set()
    dups: set[int] = set()
    keys: list[tuple[Key, bool]] = []
    try:
        for n, raw in _lines(path):
            item = parse_line(raw, n)
            if item.custom_id is not None:
                if item.custom_id in seen:
                    dups.add(n)
                    item = Item(n, None)
                else:
                    seen.add(item.custom_id)
            keys.append((item.key, item.error is None and n not in dups))
    except OSError as e:
        raise BatchError(f"cannot read {path}: {e.strerror or e}") from None
    return InputScan(len(keys), dups, keys)


def iter_items(path: Path, scan: InputScan, done: set[Key]) -> Iterator[Item]:
    """Second pass: the input lines still to answer (not in ``done``), parsed, in order."""
    for n, raw in _lines(path):
        if n in scan.duplicates:
            item = parse_line(raw, n)
            item = Item(n, None, error=f"line {n}: custom_id {item.custom_id!r} repeats an earlier line's")
        else:
            item = parse_line(raw, n)
        if item.key not in done:
            yield item


# --------------------------------------------------------------------------- output


def _result_key(obj: Any) -> Key | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("custom_id"), str):
        return ("c", obj["custom_id"])
    if isinstance(obj.get("id"), str):
        return ("i", obj["id"])
    return None


def _transient(obj: dict[str, Any]) -> bool:
    """A failed result worth sending again: no response, a 5xx or a 429."""
    err = obj.get("error")
    if not err or (isinstance(err, dict) and err.get("code") == "invalid_line"):
        return False
    resp = obj.get("response")
    status = resp.get("status_code") if isinstance(resp, dict) else None
    return not isinstance(status, int) or status >= 500 or status == 429


def scan_output(path: Path, *, retry_failed: bool = False, note: Callable[[str], None] = lambda s: None) -> set[Key]:
    """Keys of the results already in ``path``, after truncating a trailing partial line.

    With ``retry_failed`` the transient failures are removed from the file (rewritten
    through a temporary file and an atomic rename) and not returned, so they are sent again.

    Args:
        path: the output file; missing means nothing is done yet.
        retry_failed: drop transient failures (see ``_transient``).
        note: receives one human-readable line per repair made.

    Raises:
        BatchError: a complete line is not a JSON result, or the file cannot be read/written.
    """
    done: set[Key] = set()
    dropped = 0
    try:
        with path.open("r+b") as f:
            good_end = 0
            for n, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    break  # a partial last line: truncated below
                good_end += len(raw)
                if not raw.strip():
                    continue
                try:
                    obj = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    obj = None
                key = _result_key(obj)
                if key is None:
                    raise BatchError(f"{path}:{n} is not a result line; fix the file, or use --restart to start over")
                if retry_failed and _transient(obj):
                    dropped += 1
                else:
                    done.add(key)
            size = f.seek(0, os.SEEK_END)
            if size > good_end:
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
                note(f"dropped a partial last line of {size - good_end} bytes from {path}")
        if dropped:
            _rewrite_without_transient(path)
            note(f"{dropped} failed result(s) removed from {path}: they are sent again")
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise BatchError(f"cannot use {path}: {e.strerror or e}") from None
    return done


def _rewrite_without_transient(path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with path.open("rb") as src, tmp.open("wb") as dst:
        for raw in src:
            if raw.strip() and _transient(orjson.loads(raw)):
                continue
            dst.write(raw)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class ResultWriter:
    """Appends whole result lines to ``path`` and fsyncs at most every ``SYNC_INTERVAL`` s.

    Every line goes out in one ``os.write`` on an ``O_APPEND`` descriptor (no user-space
    buffer, nothing to flush), so a killed process leaves whole lines only; ``fsync``
    runs on its own thread so a slow disk does not stall the event loop.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._dirty = False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllama-batch-fsync")

    def write(self, line: bytes) -> None:
        """Append ``line`` (ending in ``\\n``). Raises ``OSError`` (disk full...)."""
        view = memoryview(line)
        while view:  # a regular file takes it in one call; loop only on a short write
            view = view[os.write(self._fd, view):]
        self._dirty = True

    async def sync_forever(self) -> None:
        """fsync every ``SYNC_INTERVAL`` s while there is something new (run as a task)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SYNC_INTERVAL)
            if self._dirty:
                self._dirty = False
                await loop.run_in_executor(self._pool, os.fsync, self._fd)

    def close(self) -> None:
        """Wait for a running fsync, sync what is left, close."""
        self._pool.shutdown(wait=True)
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)


# --------------------------------------------------------------------------- requests


def server_url(value: str | None) -> str:
    """An ``OLLAMA_HOST``-style value -> base URL without a trailing ``/``
    (:func:`vllama_proxy.ollama_host`: the port defaults to 11434, 443 for https; the host to 127.0.0.1).

    Raises:
        BatchError: the value is not a usable URL (bad port or scheme).
    """
    try:
        return ollama_host(value).url()
    except ValueError as e:
        raise BatchError(f"--host: {e}") from None


def _payload(item: Item) -> bytes:
    body = item.body or {}
    if item.url in _GENERATION:
        body = {k: v for k, v in body.items() if k != "stream_options"}
        body["stream"] = False
    return orjson.dumps(body)


def output_tokens(body: Any) -> int:
    """Generated tokens reported in a response body: ``usage.completion_tokens`` or ``eval_count`` (0 if none)."""
    if not isinstance(body, dict):
        return 0
    usage = body.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else body.get("eval_count")
    return n if isinstance(n, int) else 0


def result_line(item: Item, status: int | None, body: Any, error: dict[str, Any] | None) -> bytes:
    """One output line (bytes, ending in ``\\n``); ``status`` ``None`` means no response."""
    response = None if status is None else {"status_code": status, "body": body}
    return orjson.dumps({"id": item.id, "custom_id": item.custom_id, "response": response, "error": error}) + b"\n"


def _retry_delay(attempt: int, backoff: float, retry_after: str | None) -> float:
    """Seconds before retry ``attempt`` (0-based): jittered exponential, at least ``Retry-After``."""
    delay = min(BACKOFF_MAX, backoff * 2**attempt) * random.uniform(0.5, 1.0)
    try:
        floor = float(retry_after) if retry_after else 0.0
    except ValueError:
        floor = 0.0  # an HTTP date: not worth parsing, the backoff applies
    return max(delay, min(BACKOFF_MAX, floor) * random.uniform(1.0, 1.2))


@dataclass
class Outcome:
    line: bytes
    ok: bool
    tokens: int
    retries: int


async def send(session: aiohttp.ClientSession, base: str, item: Item, *, retries: int, backoff: float) -> Outcome:
    """POST one valid item, retrying busy answers and connection failures; never raises
    (but ``CancelledError``): every outcome is a result line."""
    data = _payload(item)
    headers = {"Content-Type": "application/json", "X-Request-ID": item.id}
    attempt = 0
    while True:
        retry_after: str | None = None
        try:
            async with session.post(base + item.url, data=data, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError) as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError) and attempt < retries:
                await asyncio.sleep(_retry_delay(attempt, backoff, None))
                attempt += 1
                continue
            kind = "connection_error" if isinstance(e, aiohttp.ConnectionTimeoutError) else "timeout"
            msg = f"no answer: {e or type(e).__name__}" + (f" (after {attempt} retries)" if attempt else "")
            return Outcome(result_line(item, None, None, {"message": msg, "code": kind}), False, 0, attempt)
        except aiohttp.ClientError as e:  # refused, reset, disconnected, bad HTTP
            if attempt < retries:
                await asyncio.sleep(_retry_delay(attempt, backoff, None))
                attempt += 1
                continue
            msg = f"{type(e).__name__}: {e}" + (f" (after {attempt} retries)" if attempt else "")
            return Outcome(result_line(item, None, None, {"message": msg, "code": "connection_error"}), False, 0, attempt)
        if status in _RETRY_STATUS and attempt < retries:
            await asyncio.sleep(_retry_delay(attempt, backoff, retry_after))
            attempt += 1
            continue
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        if 200 <= status < 300:
            if isinstance(body, str):
                err = {"message": "the server's answer is not JSON", "code": "invalid_response"}
                return Outcome(result_line(item, status, body, err), False, 0, attempt)
            return Outcome(result_line(item, status, body, None), True, output_tokens(body), attempt)
        msg = error_message(raw, f"HTTP {status}") + (f" (after {attempt} retries)" if attempt and status in _RETRY_STATUS else "")
        return Outcome(result_line(item, status, body, {"message": msg, "code": "http_error"}), False, 0, attempt)


async def preflight(session: aiohttp.ClientSession, base: str) -> int | None:
    """Fail fast, before any result is written, when the server is unreachable or refuses the key.

    Returns:
        The server's ``max_running`` from ``GET /api/version`` (requests vLLM runs at once,
        vllama's field), or ``None`` when the answer has none (not vllama, or it does not know).

    Raises:
        BatchError: connection refused / timed out, or 401/403 on ``GET /api/version``.
    """
    try:
        async with session.get(base + "/api/version", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise BatchError(f"cannot reach the server at {base}: {e or type(e).__name__} (start `vllama serve`, or give --host)") from None
    if status in (401, 403):
        raise BatchError(f"{base} refused the request ({status}): {error_message(raw, f'HTTP {status}')} (give --api-key or OLLAMA_API_KEY)")
    try:
        running = orjson.loads(raw).get("max_running") if status == 200 else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return running if isinstance(running, int) and not isinstance(running, bool) and running > 0 else None


def choose_concurrency(max_running: int | None) -> tuple[int, str]:
    """``(requests in flight, why)`` for a run without ``--concurrency``: the server's
    ``max_running`` plus a quarter (vLLM holds the next request when one finishes), else
    ``FALLBACK_CONCURRENCY``."""
    if max_running is None:
        return FALLBACK_CONCURRENCY, ("the server does not say how many requests it runs at once "
                                      "(no max_running in /api/version); give --concurrency to change it")
    n = max_running + max(max_running // 4, 1)
    return n, f"the server runs {max_running} requests at once (max_running in /api/version), plus a quarter queued"


def raise_nofile(wanted: int) -> int:
    """Raise this process's soft open-file limit towards ``wanted`` (at most the hard limit);
    returns the soft limit now. One socket per request in flight, plus a margin."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    return soft


# --------------------------------------------------------------------------- progress


@dataclass
class Summary:
    """What a run did. Counts are input lines; ``elapsed`` is seconds."""

    total: int = 0  # non-blank input lines
    skipped: int = 0  # already answered in the output when the run began
    ok: int = 0  # 2xx results written by this run
    failed: int = 0  # error results for sent requests (HTTP error, no answer)
    invalid: int = 0  # error results for invalid lines
    retries: int = 0  # extra attempts made (busy, connection failures)
    output_tokens: int = 0  # generated tokens in this run's 2xx results
    elapsed: float = 0.0
    interrupted: bool = False

    @property
    def written(self) -> int:
        """Results written by this run."""
        return self.ok + self.failed + self.invalid

    @property
    def remaining(self) -> int:
        """Input lines still without a result."""
        return self.total - self.skipped - self.written

    def line(self) -> str:
        """One human-readable status line."""
        done = self.skipped + self.written
        pct = 100.0 * done / self.total if self.total else 100.0
        t = max(self.elapsed, 1e-9)
        rps = self.written / t
        eta = _duration(self.remaining / rps) if rps > 0 and self.remaining else ("-" if self.remaining else "0s")
        errors = self.failed + self.invalid
        return (f"{done}/{self.total} ({pct:.1f}%)  ok {self.ok}  errors {errors}  "
                f"{rps:.1f} req/s  {self.output_tokens / t:.0f} tok/s  ETA {eta}")


def _duration(s: float) -> str:
    s = int(s + 0.5)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def progress_bar(summary: Summary, stream: TextIO) -> tqdm:
    """A tqdm bar over the input lines (resumed ones counted as done from the start)."""
    return tqdm(total=summary.total, initial=summary.skipped, file=stream, unit="req", dynamic_ncols=True,
                smoothing=0.1, mininterval=0.25, desc="vllama batch", leave=False)


def _update_bar(bar: tqdm, summary: Summary) -> None:
    bar.n = summary.skipped + summary.written
    t = max(summary.elapsed, 1e-9)
    bar.set_postfix_str(f"ok {summary.ok}  errors {summary.failed + summary.invalid}  "
                        f"{summary.output_tokens / t:.0f} tok/s", refresh=False)
    bar.refresh()


async def _report(summary: Summary, start: float, stream: TextIO) -> None:
    """Redraw a tqdm bar 4 times a second on a TTY, else log a plain line every 5 s (a task)."""
    tty = stream.isatty()
    bar = progress_bar(summary, stream) if tty else None
    try:
        while True:
            await asyncio.sleep(0.25 if tty else PLAIN_INTERVAL)
            summary.elapsed = time.monotonic() - start
            if bar is not None:
                _update_bar(bar, summary)
            else:
                stream.write(f"vllama batch: {summary.line()}\n")
                stream.flush()
    finally:
        if bar is not None:
            bar.close()


# --------------------------------------------------------------------------- the run


async def run_batch(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    host: str | None = None,
    api_key: str | None = None,
    concurrency: int | None = None,
    retries: int = 5,
    retry_backoff: float = 1.0,
    read_timeout: float | None = 3600.0,
    connect_timeout: float = 10.0,
    restart: bool = False,
    retry_failed: bool = False,
    progress: TextIO | None = None,
    stop: asyncio.Event | None = None,
) -> Summary:
    """Send every unanswered line of ``input_path``, appending results to ``output_path``.

    At most ``concurrency`` requests are in flight: that many worker coroutines pull the
    next line from one shared reader. Results are written as they finish (see the module
    docstring for formats, retries and resume).

    Args:
        input_path: the JSONL requests file.
        output_path: the JSONL results file (created, or resumed when it exists).
        host: server base URL or ``OLLAMA_HOST``-style value (default ``http://127.0.0.1:11434``).
        api_key: sent as ``Authorization: Bearer``.
        concurrency: requests in flight at most (>= 1); ``None``: from the server's
            ``max_running`` (:func:`choose_concurrency`), which is noted on ``progress``.
        retries: extra attempts per request on 503/429 and connection failures (>= 0).
        retry_backoff: first retry delay, seconds; doubles per attempt (capped at 60 s).
        read_timeout: seconds without a byte of the answer before a request fails
            (``None``/0: none). A non-streamed answer arrives whole, so this bounds queueing
            plus generation of one request.
        connect_timeout: seconds to open a connection.
        restart: empty the output first instead of resuming.
        retry_failed: resend lines whose existing result is a transient failure.
        progress: where to draw progress and notes (``None``: silent).
        stop: when set, in-flight requests are cancelled and the run returns early with
            ``interrupted`` true (what finished is written and synced).

    Returns:
        The ``Summary``; ``remaining`` is 0 unless interrupted.

    Raises:
        BatchError: bad arguments, unreadable input, an output that is not a results
            file, or an unreachable server / refused API key (checked before writing).
        OSError: writing the output failed (disk full...): the results written so far stay.
    """
    if concurrency is not None and concurrency < 1:
        raise BatchError("--concurrency must be at least 1")
    if retries < 0:
        raise BatchError("--retries must be at least 0")
    src, dst = Path(input_path), Path(output_path)
    if not src.is_file():
        raise BatchError(f"input {src} does not exist or is not a file")
    if dst.exists() and dst.resolve() == src.resolve():
        raise BatchError("the output must not be the input file")
    if not dst.parent.is_dir():
        raise BatchError(f"the output's directory {dst.parent} does not exist")
    base = server_url(host if host is not None else os.environ.get("OLLAMA_HOST"))

    def note(msg: str) -> None:
        if progress is not None:
            progress.write(f"vllama batch: {msg}\n")
            progress.flush()

    start = time.monotonic()
    scan = scan_input(src)
    if restart:
        try:
            dst.open("wb").close()
        except OSError as e:
            raise BatchError(f"cannot write {dst}: {e.strerror or e}") from None
        done: set[Key] = set()
    else:
        done = scan_output(dst, retry_failed=retry_failed, note=note)
    summary = Summary(total=scan.total)
    summary.skipped = sum(1 for k, _ in scan.keys if k in done)
    extra = len(done) - summary.skipped
    if summary.skipped:
        note(f"resuming: {summary.skipped} of {scan.total} lines already answered in {dst}")
    if extra:
        note(f"{dst} holds {extra} result(s) for lines not in {src}; kept as they are")
    to_send = sum(1 for k, sent in scan.keys if sent and k not in done)

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout,
                                    sock_read=read_timeout or None)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        if to_send:
            max_running = await preflight(session, base)
            if concurrency is None:
                concurrency, why = choose_concurrency(max_running)
                note(f"concurrency {concurrency}: {why}")
        concurrency = concurrency or FALLBACK_CONCURRENCY
        in_flight = min(concurrency, max(1, summary.remaining))
        nofile = raise_nofile(in_flight + 64)
        if nofile < in_flight + 64:
            note(f"the open-file limit ({nofile}) is below what {in_flight} connections need; raise it (ulimit -n)")
        try:
            writer = ResultWriter(dst)
        except OSError as e:
            raise BatchError(f"cannot write {dst}: {e.strerror or e}") from None
        items = iter_items(src, scan, done)

        async def worker() -> None:
            for item in items:  # one shared generator: each line goes to exactly one worker
                if item.error is not None:
                    writer.write(result_line(item, None, None, {"message": item.error, "code": "invalid_line"}))
                    summary.invalid += 1
                    continue
                out = await send(session, base, item, retries=retries, backoff=retry_backoff)
                writer.write(out.line)  # right after the answer: cancellation never splits a line
                summary.retries += out.retries
                if out.ok:
                    summary.ok += 1
                    summary.output_tokens += out.tokens
                else:
                    summary.failed += 1

        workers = [asyncio.create_task(worker()) for _ in range(in_flight)]
        helpers = [asyncio.create_task(writer.sync_forever())]
        if progress is not None:
            helpers.append(asyncio.create_task(_report(summary, start, progress)))
        stopper = asyncio.create_task(stop.wait()) if stop is not None else None
        all_done = asyncio.gather(*workers)
        try:
            await asyncio.wait([all_done, *([stopper] if stopper else [])], return_when=asyncio.FIRST_COMPLETED)
            if all_done.done():
                all_done.result()  # a worker's unexpected error (disk full) propagates
            else:
                summary.interrupted = True
        finally:
            for t in [*workers, *helpers, *([stopper] if stopper else [])]:
                t.cancel()
            await asyncio.gather(*workers, *helpers, *([stopper] if stopper else []), return_exceptions=True)
            writer.close()
            summary.elapsed = time.monotonic() - start
    return summary


# --------------------------------------------------------------------------- command line


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Usage(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``vllama batch`` argument parser (usage errors raise instead of exiting 2)."""
    p = _Parser(
        prog="vllama batch",
        description="Send an OpenAI-batch JSONL file through a running vllama server; results are "
                    "appended as they finish, and a rerun resumes where an interrupted one stopped.",
    )
    p.add_argument("input", help="requests, one JSON object per line: {custom_id, method, url, body}")
    p.add_argument("-o", "--output", required=True, help="results file (JSONL); resumed when it exists")
    p.add_argument("-c", "--concurrency", type=int, default=None,
                   help="requests in flight at most (default: what the server runs at once, from its /api/version "
                        f"max_running, plus a quarter; {FALLBACK_CONCURRENCY} when it does not say)")
    p.add_argument("--host", default=None,
                   help="server URL (default: OLLAMA_HOST, else http://127.0.0.1:11434)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer (default: OLLAMA_API_KEY)")
    p.add_argument("--retries", type=int, default=5,
                   help="retries per request on 503/429 and connection failures (default 5)")
    p.add_argument("--retry-backoff", type=float, default=1.0,
                   help="first retry delay in seconds, doubling (default 1; Retry-After is honoured)")
    p.add_argument("--read-timeout", type=float, default=3600.0,
                   help="seconds to wait for a request's answer, queueing included (default 3600; 0: none)")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to connect (default 10)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--restart", action="store_true", help="empty the output and start over")
    g.add_argument("--retry-failed", action="store_true",
                   help="resend lines whose result failed transiently (no answer, 5xx, 429)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress, only the final summary")
    return p


def main(argv: list[str]) -> int:
    """``vllama batch ...``: returns the exit code (0 done, 1 usage/failure, 130/143 interrupted)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _Usage as e:
        parser.print_usage(sys.stderr)
        print(f"vllama batch: error: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    received: list[int] = []

    async def go() -> Summary:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            def on_signal(sig: int = sig) -> None:
                received.append(sig)
                stop.set()
                loop.remove_signal_handler(sig)  # a second one acts at once
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - no loop signals (Windows)
                pass
        return await run_batch(
            args.input, args.output, host=args.host, api_key=args.api_key or os.environ.get("OLLAMA_API_KEY") or None,
            concurrency=args.concurrency, retries=args.retries, retry_backoff=args.retry_backoff,
            read_timeout=args.read_timeout, connect_timeout=args.connect_timeout, restart=args.restart,
            retry_failed=args.retry_failed, progress=None if args.quiet else sys.stderr, stop=stop,
        )

    try:
        summary = asyncio.run(go())
    except BatchError as e:
        print(f"vllama batch: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        print(f"vllama batch: {e}", file=sys.stderr)
        return 1
    print(f"vllama batch: {summary.line()}  ({summary.skipped} skipped, {summary.invalid} invalid lines, "
          f"{summary.retries} retries, {_duration(summary.elapsed)})", file=sys.stderr)
    if summary.interrupted:
        print(f"vllama batch: interrupted; {summary.remaining} lines left, run the same command again to resume",
              file=sys.stderr)
        return 143 if received and received[0] == signal.SIGTERM else 130
    return 0
