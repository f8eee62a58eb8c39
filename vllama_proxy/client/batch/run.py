"""One ``vllama batch`` run: the input scanned, the output resumed, N workers sending, results written as they finish."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TextIO

import aiohttp

from .concurrency import FALLBACK_CONCURRENCY, choose_concurrency, raise_nofile
from .errors import BatchError
from .items import Key, iter_items, scan_input
from .progress import Summary, report
from .results import ResultWriter, result_line, scan_output
from .send import preflight, send, server_url


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
            helpers.append(asyncio.create_task(report(summary, start, progress)))
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

