"""How long a model stays loaded: Ollama's ``keep_alive`` (seconds or a Go duration) in seconds.

Read from requests (``api/``), from each model's config and the default setting (``settings/``,
lazily, so that the client commands need not load aiohttp) and by the supervisors' pool, so it
sits below all of them."""

from __future__ import annotations

import math
import re
from typing import TypeVar

from vllama_proxy.errors import BadRequest


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([+-]?)((?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|ms|s|m|h))+)")
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h)")


#: Go's longest ``time.Duration`` (2^63 - 1 ns, ~292 years), in seconds: Ollama's ``time.ParseDuration``
#: refuses a longer one.
MAX_SECONDS = (2**63 - 1) / 1e9

_D = TypeVar("_D", float, None)


def parse_keep_alive(value: str | float | int | None, default: _D) -> float | _D:
    """Ollama ``keep_alive`` -> seconds; negative means forever, 0 unload now.

    Accepts a number of seconds or a Go duration string (``"10m"``, ``"1h30m"``,
    ``"-1m"``, ``"0"``), as Ollama's ``api.Duration`` does. ``None`` or a blank string gives ``default``.

    Raises:
        BadRequest: not a number or duration, or one no clock holds: ``NaN``, or longer than Go's
            longest duration (:data:`MAX_SECONDS`; a user key's ``1e308`` made every ``/api/ps`` a 500).
    """
    if value is None:
        return default
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an integer beyond any float
            seconds = math.inf if value > 0 else -math.inf
    elif isinstance(value, str):
        s = value.strip()
        if not s:
            return default
        try:
            seconds = float(s)
        except ValueError:
            m = _DURATION.fullmatch(s)
            if m:
                total = sum(float(n) * _UNITS[u] for n, u in _DURATION_PART.findall(m.group(2)))
                seconds = -total if m.group(1) == "-" else total
    if seconds is None:
        raise BadRequest(f"invalid keep_alive: {value!r} (use seconds or a duration like \"5m\")")
    if math.isnan(seconds) or seconds > MAX_SECONDS:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise BadRequest(f"invalid keep_alive: {shown} (at most {MAX_SECONDS / 3.15576e7:.0f} years, Ollama's longest "
                         "duration; a negative one keeps the model loaded)")
    return seconds
