"""The ``vllama batch`` command line: its flags, signals, the exit code and the closing summary."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from .concurrency import FALLBACK_CONCURRENCY
from .errors import BatchError
from .progress import Summary, duration
from .run import run_batch


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
                        f"max_running, twice: as many waiting as running; {FALLBACK_CONCURRENCY} when it does not say)")
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
          f"{summary.retries} retries, {duration(summary.elapsed)})", file=sys.stderr)
    if summary.interrupted:
        print(f"vllama batch: interrupted; {summary.remaining} lines left, run the same command again to resume",
              file=sys.stderr)
        return 143 if received and received[0] == signal.SIGTERM else 130
    return 0
