"""How many requests ``vllama batch`` keeps in flight, and the open files they need."""

from __future__ import annotations

#: Requests in flight when the server does not say how many it runs at once.
FALLBACK_CONCURRENCY = 64
#: Requests in flight per request the server runs at once: one running, one waiting in vLLM's queue.
QUEUE_FACTOR = 2


def choose_concurrency(max_running: int | None) -> tuple[int, str]:
    """``(requests in flight, why)`` for a run without ``--concurrency``: ``QUEUE_FACTOR`` (2) times the
    server's ``max_running`` (vLLM's ``--max-num-seqs`` x data-parallel size, from ``/api/version``), else
    ``FALLBACK_CONCURRENCY``.

    Twice the running capacity keeps vLLM's waiting queue as deep as its running batch, as offline
    ``LLM.generate`` (every prompt queued at once) keeps it: a batch's requests of one length finish in
    waves, and a finished wave's slots are refilled from vLLM's own queue (``docs/decisions.md``)."""
    if max_running is None:
        return FALLBACK_CONCURRENCY, ("the server does not say how many requests it runs at once "
                                      "(no max_running in /api/version); give --concurrency to change it")
    n = QUEUE_FACTOR * max_running
    return n, (f"the server runs {max_running} requests at once (max_running in /api/version), "
               "and as many wait queued in vLLM")


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

