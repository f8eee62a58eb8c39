"""Unit tests of the streaming pieces that need no HTTP: the ``created_at`` clock
(``api/ollama/timestamps.py``), the timing marks behind ``eval_duration`` and the TPOT histogram
(``api/ollama/to_ollama.py``), and the NDJSON response's first write (``api/ollama/ndjson.py``)."""

from __future__ import annotations

import time

from vllama_proxy.api.ollama import ndjson, timestamps
from vllama_proxy.api.ollama import to_ollama


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
    for translator_cls in (to_ollama.ChatTranslator, to_ollama.GenerateTranslator):
        t = timestamps.Timings(time.perf_counter_ns())
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
        assert (t.last - t.first) / 2 >= 0.05e9  # the TPOT that metrics.observe_tpot records


def test_a_finish_before_any_token_leaves_no_eval_window():
    t = timestamps.Timings(time.perf_counter_ns())
    tr = to_ollama.ChatTranslator("m", t, aggregate=True)
    tr.feed(_chunk("", "length"))
    assert tr.finished and t.first == 0 and t.last == 0
    assert tr.final()["eval_duration"] == 1


async def test_the_status_line_and_headers_leave_with_the_first_ndjson_line(monkeypatch):
    """On every streamed answer's TTFT path: one socket write carries the status line, the headers
    and the first line (a separate write of the headers is one more send and one more wake-up of
    the client before its first token)."""
    import asyncio.selector_events as se

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    sent: list[bytes] = []
    orig_write, orig_writelines = se._SelectorSocketTransport.write, se._SelectorSocketTransport.writelines
    monkeypatch.setattr(se._SelectorSocketTransport, "write", lambda self, data: (sent.append(bytes(data)), orig_write(self, data))[1])
    monkeypatch.setattr(se._SelectorSocketTransport, "writelines",
                        lambda self, chunks: (sent.append(b"".join(bytes(c) for c in chunks)), orig_writelines(self, chunks))[1])

    async def handler(request: web.Request) -> web.StreamResponse:
        out = await ndjson.begin(request)
        await out.write(b'{"response":"first"}\n')
        await out.write_eof(b'{"done":true}\n')
        return out

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        sent.clear()
        resp = await client.get("/")
        assert (await resp.text()).splitlines() == ['{"response":"first"}', '{"done":true}']
    answer = [w for w in sent if b'"response"' in w or b"200 OK" in w]
    assert answer and b"200 OK" in answer[0] and b'{"response":"first"}' in answer[0], answer
