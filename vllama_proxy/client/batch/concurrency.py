"""How many requests ``vllama batch`` keeps in flight, and the open files they need."""

from __future__ import annotations

#: Requests in flight when the server does not say how many it runs at once.
FALLBACK_CONCURRENCY = 64


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

