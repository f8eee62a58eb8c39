"""What ``vllama batch`` did so far (``Summary``), drawn as a tqdm bar on a terminal or a line every 5 s."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm

#: Seconds between plain progress lines when stderr is not a terminal.
PLAIN_INTERVAL = 5.0


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
        eta = duration(self.remaining / rps) if rps > 0 and self.remaining else ("-" if self.remaining else "0s")
        errors = self.failed + self.invalid
        return (f"{done}/{self.total} ({pct:.1f}%)  ok {self.ok}  errors {errors}  "
                f"{rps:.1f} req/s  {self.output_tokens / t:.0f} tok/s  ETA {eta}")


def duration(s: float) -> str:
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


async def report(summary: Summary, start: float, stream: TextIO) -> None:
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

