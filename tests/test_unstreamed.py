"""Non-streamed Ollama requests reach a vLLM that reports per-request timings unstreamed.

With ``--enable-per-request-metrics`` among vLLM's arguments, ``/api/generate`` and ``/api/chat``
with ``stream: false`` ask vLLM for one answer (``stream: false`` upstream: vLLM's API server
sends it once instead of an event per token) and fill Ollama's durations from vLLM's
``metrics``; the answer is the same as the one assembled from a stream. Without the flag, and
for streamed requests, upstream stays streamed.
"""

from __future__ import annotations

import ollama
import pytest

from conftest import SERVED, VLLM_ARGS, _requests_of, start_fake, start_proxy, stop
from vllama_proxy.api.ollama.timestamps import Timings
from vllama_proxy.api.ollama.to_ollama import ChatTranslator, GenerateTranslator, response_chunk, unstreamed_timings
from vllama_proxy.api.ollama.to_openai import final_only

FLAG = "--enable-per-request-metrics"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
#: (route, request): generate raw and templated (thinking), chat plain, with tool calls, thinking, a length finish.
CASES = [
    ("generate", {"prompt": "hello there", "raw": True}),
    ("generate", {"prompt": "x", "think": True}),
    ("generate", {"prompt": "say [[tokens:3]]", "options": {"num_predict": 2}}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}),
    ("chat", {"messages": [{"role": "user", "content": "weather? [[tools:2]]"}], "tools": TOOLS}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "think": True}),
]
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def metrics_fake(model_dir):
    s = start_fake(model_dir, extra=[FLAG])
    yield s
    stop(s.proc)


@pytest.fixture(scope="module")
def metrics_proxy(metrics_fake):
    s = start_proxy(metrics_fake.url, vllm_args=[*VLLM_ARGS, FLAG])
    yield s
    stop(s.proc)


def _ask(url: str, route: str, req: dict, stream: bool = False):
    c = ollama.Client(host=url)
    call = c.generate if route == "generate" else c.chat
    return call(model=SERVED, stream=stream, **req)


def _generations(received) -> list[dict]:
    """The generation requests vLLM received (not the proxy's /v1/models and the like)."""
    return [r for r in received() if r["path"] in ("/v1/completions", "/v1/chat/completions")]


def _answer(r) -> dict:
    """An Ollama answer without what differs between two runs (timestamps, durations)."""
    return r.model_dump(exclude={"created_at", *DURATIONS})


@pytest.mark.parametrize(("route", "req"), CASES)
def test_same_answer_with_vllms_timings(route, req, metrics_proxy, metrics_fake, proxy, fake):
    received = _requests_of(metrics_fake)
    whole = _ask(metrics_proxy.url, route, req)
    (sent,) = _generations(received)
    assert sent["body"]["stream"] is False and "stream_options" not in sent["body"]
    streamed_upstream = _ask(proxy.url, route, req)  # the default proxy: vLLM without the flag streams
    assert _answer(whole) == _answer(streamed_upstream)
    assert whole.done and whole.eval_count == streamed_upstream.eval_count > 0
    for d in DURATIONS:
        assert isinstance(getattr(whole, d), int) and getattr(whole, d) > 0, d
    assert whole.load_duration + whole.prompt_eval_duration + whole.eval_duration <= whole.total_duration


def test_streamed_requests_and_vllm_without_the_flag_stay_streamed(metrics_proxy, metrics_fake, proxy, fake):
    received = _requests_of(metrics_fake)
    chunks = list(_ask(metrics_proxy.url, "chat", {"messages": [{"role": "user", "content": "hi"}]}, stream=True))
    assert chunks[-1].done and chunks[-1].eval_count == 8
    (sent,) = _generations(received)
    assert sent["body"]["stream"] is True
    received = _requests_of(fake)
    _ask(proxy.url, "generate", {"prompt": "hi", "raw": True})
    (sent,) = _generations(received)
    assert sent["body"]["stream"] is True and sent["body"]["stream_options"] == {"include_usage": True}


def test_final_only_needs_vllms_stats():
    assert final_only(("--max-model-len", "4096", FLAG))
    assert not final_only(("--max-model-len", "4096"))
    assert not final_only((FLAG, "--disable-log-stats"))  # vLLM refuses that pair: no metrics


def test_eval_duration_is_vllms_generation_time():
    t = Timings(1_000)
    t.sent = 2_000_000
    end = 900_000_000
    unstreamed_timings(t, {"metrics": {"generation_time_ms": 250.5, "time_to_first_token_ms": 12.0}}, end)
    assert t.last - t.first == 250_500_000 and t.last == end
    unstreamed_timings(t, {"metrics": {"generation_time_ms": 5_000.0}}, end)  # longer than the wait: clamped
    assert t.first == t.sent
    unstreamed_timings(t, {"metrics": None}, end)  # no timings: the whole wait is eval_duration
    assert (t.first, t.last) == (t.sent, end)


def test_whole_chat_answer_translates_as_its_stream():
    data = {"choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": "\n\nsure", "reasoning": "\nthink ",
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                       {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 7}, "metrics": {"generation_time_ms": 1.0}}
    tr = ChatTranslator("m", Timings(0), aggregate=True)
    tr.feed(response_chunk(data))
    out = tr.final()
    assert out["message"]["content"] == "sure" and out["message"]["thinking"] == "think "
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["message"]["tool_calls"]] == [("f", {"x": 1}), ("g", {})]
    assert out["done_reason"] == "stop" and out["eval_count"] == 7 and out["prompt_eval_count"] == 3
    completion = {"choices": [{"index": 0, "text": "abc", "finish_reason": "length", "logprobs": None}],
                  "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    assert response_chunk(completion) is completion
    tr = GenerateTranslator("m", Timings(0), aggregate=True)
    tr.feed(completion)
    assert tr.final()["response"] == "abc" and tr.done_reason == "length"
