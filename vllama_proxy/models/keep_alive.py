"""How long a model stays loaded: Ollama's ``keep_alive`` (seconds or a Go duration) in seconds.

Read from requests (``api/``), from each model's config and the default setting (``settings.py``,
lazily, so that the client commands need not load aiohttp) and by the supervisors' pool, so it
sits below all of them (issue 20)."""

from __future__ import annotations

import re

from vllama_proxy.errors import BadRequest


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([+-]?)((?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|ms|s|m|h))+)")
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value: str | float | int | None, default: float) -> float:
    """Ollama ``keep_alive`` -> seconds; negative means forever, 0 unload now.

    Accepts a number of seconds or a Go duration string (``"10m"``, ``"1h30m"``,
    ``"-1m"``, ``"0"``), as Ollama's ``api.Duration`` does. ``None`` gives ``default``.

    Raises:
        BadRequest: not a number or duration.
    """
    if value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return default
        try:
            return float(s)
        except ValueError:
            pass
        m = _DURATION.fullmatch(s)
        if m:
            total = sum(float(n) * _UNITS[u] for n, u in _DURATION_PART.findall(m.group(2)))
            return -total if m.group(1) == "-" else total
    raise BadRequest(f"invalid keep_alive: {value!r} (use seconds or a duration like \"5m\")")
