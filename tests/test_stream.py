"""Unit tests of the pieces of ``api/stream.py`` that need no HTTP: the ``created_at`` clock
(``api/timestamps.py``) and the timing marks behind ``eval_duration`` and the TPOT histogram."""

from __future__ import annotations

import time

from vllama_proxy.api import stream, timestamps


def test_created_at_follows_a_wall_clock_stepped_back(monkeypatch):
    now = [1_800_000_000_123_456_789]
    monkeypatch.setattr(timestamps.time, "time_ns", lambda: now[0])
    clock = timestamps.Clock()
    first = clock.now()
    assert first == "2027-01-15T08:00:00.123456789Z"
    now[0] += 50_000  # within the 100 µs window: the same string
    assert clock.now() == first
    now[0] -= 3600 * 10**9  # NTP steps the clock back an hour
    assert clock.now() == "2027-01-15T07:00:00.123506789Z"
    now[0] += 1800 * 10**9  # half an hour on, still before the first window
    assert clock.now() == "2027-01-15T07:30:00.123506789Z"


def _chunk(content: str | None, finish: str | None = None) -> dict:
    delta = {"content": content} if content is not None else {}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_eval_duration_ends_at_the_finish_chunk():
    """vLLM counts the EOS token (sent as an empty finish chunk) in ``completion_tokens``, so the
    eval window, and TPOT over eval_count - 1 tokens, must end there, not at the last text."""
    for translator_cls in (stream.ChatTranslator, stream.GenerateTranslator):
        t = stream.Timings(time.perf_counter_ns())
        tr = translator_cls("m", t, aggregate=False)
        tr.feed(_chunk("a"))
        time.sleep(0.05)
        tr.feed(_chunk("b"))
        time.sleep(0.05)
        tr.feed(_chunk("", "stop"))
        tr.feed({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
        final = tr.final()
        assert final["eval_count"] == 3
        assert final["eval_duration"] >= 0.1e9, translator_cls  # a..EOS, two gaps of 50 ms
        assert (t.last - t.first) / 2 >= 0.05e9  # the TPOT that _observe_tpot records


def test_a_finish_before_any_token_leaves_no_eval_window():
    t = stream.Timings(time.perf_counter_ns())
    tr = stream.ChatTranslator("m", t, aggregate=True)
    tr.feed(_chunk("", "length"))
    assert tr.finished and t.first == 0 and t.last == 0
    assert tr.final()["eval_duration"] == 1
