"""What the client commands print, as Ollama's CLI prints it: sizes, numbers, times and durations
(Ollama's ``format`` package, Go's ``time.Duration``), the tables of ``list``, ``ps`` and
``show``, the ``--verbose`` timings, the spinner while a model loads and the pull's progress
bars. No I/O here but writing to the terminal.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from datetime import datetime
from typing import Any, Self

from tqdm import tqdm

DIM, RESET, CLEAR_LINE = "\x1b[2m", "\x1b[0m", "\x1b[K"


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


def human_number(n: int) -> str:
    """Ollama's ``format.HumanNumber``: 7615616512 -> "7.6B", 494032768 -> "494.03M", 1500 -> "2K"."""
    for unit, size, digits in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 0)):
        if n >= size:
            value = n / size
            return f"{value:.{0 if value == int(value) else digits}f}{unit}"
    return str(n)


def table(rows: list[list[str]], indent: str = "", pad: int = 4) -> str:
    """Left-aligned columns separated by at least ``pad`` spaces (Ollama's tablewriter settings)."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    lines = [indent + "".join(cell.ljust(widths[i] + pad) for i, cell in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


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


def show_info(info: dict[str, Any]) -> str:
    """``/api/show``'s answer as Ollama's ``showInfo`` prints it (``cmd/cmd.go``): Model, Capabilities,
    Parameters, System (a created model's, its first two lines), License."""
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
    for title, key in (("System", "system"), ("License", "license")):
        lines = [line for line in (info.get(key) or "").splitlines() if line.strip()]
        sections.append((title, [[line] for line in lines[:2]] + ([["..."]] if len(lines) > 2 else [])))
    out = []
    for title, rows in sections:
        if rows:
            out.append(f"  {title}\n" + table(rows, indent="    "))
    return "\n".join(out)


class WordWrap:
    """Streamed text wrapped at ``width`` columns between words (Ollama's ``wordwrap``, on by default on a terminal)."""

    def __init__(self, out, width: int) -> None:
        self.out, self.width = out, max(width, 10)
        self.col = 0
        self.word = ""

    def write(self, text: str) -> None:
        for ch in text:
            if ch == "\n":
                self._flush()
                self.out.write("\n")
                self.col = 0
            elif ch == " ":
                self._flush()
                if self.col < self.width:
                    self.out.write(" ")
                    self.col += 1
            else:
                self.word += ch
                if len(self.word) >= self.width:  # longer than a line: break it
                    self._flush()

    def _flush(self) -> None:
        if not self.word:
            return
        if self.col and self.col + len(self.word) > self.width:
            self.out.write("\n")
            self.col = 0
        self.out.write(self.word)
        self.col += len(self.word)
        self.word = ""

    def close(self) -> None:
        self._flush()

    def flush(self) -> None:
        self.out.flush()


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

    def __enter__(self) -> Self:
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


def list_table(models: list[dict[str, Any]], prefix: str | None = None) -> str:
    """``vllama list``'s table of ``/api/tags``' ``models`` (NAME, ID, SIZE, MODIFIED), only the
    names starting with ``prefix`` (any case) when one is given."""
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for m in models:
        if prefix and not m["name"].lower().startswith(prefix.lower()):
            continue
        rows.append([m["name"], short_digest(m.get("digest", "")), human_bytes(m.get("size", 0)), human_time(m.get("modified_at"))])
    return table(rows)


def ps_table(models: list[dict[str, Any]]) -> str:
    """``vllama ps``'s table of ``/api/ps``' ``models`` (NAME, ID, SIZE, PROCESSOR, CONTEXT, UNTIL)."""
    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]]
    for m in models:
        size, vram = m.get("size", 0), m.get("size_vram", 0)
        expires = parse_time(m.get("expires_at"))
        until = "Stopping..." if expires is not None and expires < time.time() else human_time(m.get("expires_at"))
        rows.append([m["name"], short_digest(m.get("digest", "")), human_bytes(vram or size) if vram or size else "unknown",
                     processor(size, vram),
                     str(m.get("context_length") or ""), until])
    return table(rows)
