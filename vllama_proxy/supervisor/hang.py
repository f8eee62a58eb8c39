"""Hang detection for a ready vLLM, as a pure decider: what one look at vLLM's load means.

Hung means shown not to work, never a gauge alone (``probes.py``): requests pending (vLLM's
``num_requests_running`` + ``_waiting``) with no token generated since the last look make a stall;
once it lasted half of ``--hang-timeout`` vllama asks vLLM its own smallest request
(``probes.answers``), and the engine is hung if that has no answer when the stall reaches
``--hang-timeout`` (or fails). Answered, the gauge was stale: logged, the stall counted again from
then. ``EngineWatch`` keeps the counts between looks and returns a ``Look``; the supervisor
(``lifecycle.py``) sends and cancels the request and restarts vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Load:
    """Engine load from ``/metrics`` (``probes.load``): requests running + waiting, generated tokens so far."""

    pending: float
    generation_tokens: float


@dataclass(frozen=True)
class Look:
    """What to do after one look. ``hung``: restart vLLM, why; ``stale``: vLLM's own request was
    answered during a stall (log ``engine_gauge_stale``; ``first``: at warning, the stall's first);
    ``ask``: send vllama's own request now; ``cancel``: cancel the one in flight (tokens came)."""

    hung: str | None = None
    stale: dict[str, object] | None = None
    first: bool = False
    ask: bool = False
    cancel: bool = False


class EngineWatch:
    """The tokens, stall and check of one ready vLLM between looks (times: ``time.monotonic`` seconds).

    Args:
        hang_timeout: ``--hang-timeout`` (> 0 for :meth:`judge`).
        health_interval: ``--health-interval``: a gauge of pending requests with no token for this
            long does not keep an idle model from being put away (:meth:`idle`).
        now: when the watch began (the stall's clock before the first look that sees tokens).
    """

    def __init__(self, hang_timeout: float, health_interval: float, now: float) -> None:
        self.hang_timeout = hang_timeout
        self.health_interval = health_interval
        self.tokens: float | None = None  # vLLM's generated tokens at the last look that saw them move
        self.moved_at = now  # ... and when
        self.stalled_since: float | None = None  # when the current stall began (or was last shown not a hang)
        self.stale_seen = False  # this stall's gauge was shown stale once

    def saw(self, load: Load | None, now: float) -> None:
        """Note a look's load (``None``: ``/metrics`` unread)."""
        if load is not None and load.generation_tokens != self.tokens:
            self.tokens, self.moved_at = load.generation_tokens, now

    def idle(self, load: Load | None, now: float) -> bool:
        """Whether vLLM's load lets an idle model (none of vllama's requests in flight) be put away:
        nothing pending, or pending with no token generated for a ``--health-interval`` (an H200 vLLM's
        gauge stood at 6 after a batch)."""
        return load is not None and (load.pending == 0 or now - self.moved_at >= self.health_interval)

    def judge(self, load: Load, now: float, *, asking: bool, answer: tuple[bool, str] | None) -> Look:
        """The hang check's step at a look (after :meth:`saw`).

        Args:
            load: this look's load.
            asking: vllama's own request is in flight (not yet answered).
            answer: its ``(works, what it said)``, when it ended since the last look (then not ``asking``).
        """
        stalled = load.pending > 0 and self.moved_at < now
        stale: dict[str, object] | None = None
        first = False
        if answer is not None:
            works, said = answer
            if works:
                stale = {"pending": load.pending, "no_token_s": round(now - self.moved_at, 1), "answer": said}
                first, self.stale_seen, self.stalled_since = not self.stale_seen, True, now
            elif stalled:
                return Look(hung=f"engine hung: {load.pending:g} requests pending, no token generated for "
                                 f"{now - self.moved_at:.0f} s, and vllama's own request failed: {said}")
        if load.pending == 0:
            self.stale_seen = False
        if not stalled:
            self.stalled_since = None
            return Look(stale=stale, first=first, cancel=asking)  # tokens came, or nothing is pending: it works
        self.stalled_since = self.stalled_since or now
        if not asking and now - self.stalled_since >= self.hang_timeout / 2:
            return Look(stale=stale, first=first, ask=True)
        if asking and now - self.stalled_since >= self.hang_timeout:
            return Look(hung=f"engine hung: {load.pending:g} requests pending, no token generated for "
                             f"{now - self.moved_at:.0f} s, and vllama's own request got no answer in "
                             f"{now - self.stalled_since - self.hang_timeout / 2:.0f} s")
        return Look(stale=stale, first=first)
