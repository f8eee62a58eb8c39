"""The pure parts of ``api/request/resume.py``: what is resumed, the continuation's body, its chunks shaped as the
route's (the whole path runs against the real vLLM in ``tests/real_engine/test_real_resume.py``)."""

from __future__ import annotations

import pytest

from vllama_proxy.api.request.resume import Resume, refusal, resumable, resume_timeout
from vllama_proxy.errors import UpstreamRejected, UpstreamTimeout, UpstreamUnavailable


def _resume(path: str = "/v1/chat/completions", **body) -> Resume:
    return Resume(path, {"model": "m", **body}, upstream=None, board=None, worker=0, timeout=60.0,  # type: ignore[arg-type]
                  max_model_len=2048, headers=None, route="/api/chat")


def test_what_is_resumed():
    assert resumable(UpstreamUnavailable("closed")) and resumable(UpstreamTimeout("idle"))
    assert resumable(UpstreamRejected("EngineCore encountered an issue", 500))
    assert not resumable(UpstreamRejected("prompt too long", 400))  # a client's mistake, never asked again
    assert refusal("/v1/chat/completions", {"messages": []}) is None
    assert "n=2" in refusal("/v1/chat/completions", {"n": 2})
    assert "response_format" in refusal("/v1/chat/completions", {"response_format": {"type": "json_object"}})
    assert refusal("/v1/chat/completions", {"tools": [{"type": "function"}]}) is None  # continued as a chat
    assert refusal("/v1/embeddings", {}) is not None


def test_the_default_timeout_follows_the_models_start():
    class Board:
        start_seconds = 40.0

    assert resume_timeout(None, Board()) == (120.0, "3 x the model's latest start (40.0 s), at least 60 s")
    Board.start_seconds = 5.0
    assert resume_timeout(None, Board())[0] == 60.0
    assert resume_timeout(None, None)[0] == 120.0  # an --upstream vLLM
    assert resume_timeout(7.5, Board()) == (7.5, "--resume-timeout")


def test_the_continuation_is_the_prompts_ids_and_the_sent_ones_with_the_same_sampling():
    r = _resume(max_tokens=200, temperature=0, seed=3, stop=["\n\n"], cache_salt="k", priority=5, logprobs=True,
                top_logprobs=2, min_tokens=60)
    first = {"prompt_token_ids": [1, 2, 3], "choices": [{"delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
    assert r.take([first, {"choices": [{"delta": {"content": "a b"}, "token_ids": [7, 8]}]}]) is not None
    assert r.prompt_ids == [1, 2, 3] and r.ids == [7, 8]
    body = r._continuation(in_reasoning=False)
    assert body["prompt"] == [1, 2, 3, 7, 8] and body["max_tokens"] == 198 and body["min_tokens"] == 58
    assert {k: body[k] for k in ("temperature", "seed", "stop", "cache_salt", "priority", "logprobs")} == \
        {"temperature": 0, "seed": 3, "stop": ["\n\n"], "cache_salt": "k", "priority": 5, "logprobs": 2}
    assert body["stream"] is True and body["return_token_ids"] is True
    # no max_tokens: up to the context's end, as vLLM's chat route would go
    r = _resume()
    r.take([first, {"choices": [{"delta": {"content": "x"}, "token_ids": [9]}]}])
    assert r._continuation(in_reasoning=False)["max_tokens"] == 2048 - 4


def test_a_resumed_chunk_is_shaped_as_the_chats_with_the_whole_answers_usage():
    r = _resume(max_tokens=10)
    r.take([{"prompt_token_ids": [1, 2], "choices": [{"delta": {"reasoning": "hm"}, "token_ids": [5, 6, 7]}]}])
    r._continuation(in_reasoning=True)
    r.shaped, r.base = True, 3
    out = r.take([{"choices": [{"index": 0, "text": " so</think>Yes", "token_ids": [8, 9]}]},
                  {"choices": [{"index": 0, "text": "!", "finish_reason": "length", "token_ids": [10]}]},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}])
    assert out[0]["choices"][0]["delta"] == {"reasoning": " so", "content": "Yes"}  # reasoning ends at </think>
    assert out[1]["choices"][0] == {"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}
    assert out[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6}  # the client's prompt, the whole answer
    assert r.ids == [5, 6, 7, 8, 9, 10]


def test_a_non_streamed_request_is_asked_again_whole_whatever_a_continuation_refuses():
    """Nothing of a non-streamed answer reached its client: ``n`` > 1, a grammar, a batch of prompts or ``echo``
    refuse a continuation from the middle, not the request asked again whole."""
    for path, body in (("/v1/chat/completions", {"n": 2, "response_format": {"type": "json_object"}}),
                       ("/v1/completions", {"prompt": ["a", "b"], "echo": True})):
        assert not _resume(path, **body).can(UpstreamUnavailable("closed"))
        r = Resume(path, {"model": "m", **body}, upstream=None, board=None, worker=0, timeout=60.0,  # type: ignore[arg-type]
                   max_model_len=2048, headers=None, route=path, unstreamed=True)
        assert r.can(UpstreamUnavailable("closed")) and r.can(UpstreamRejected("EngineDeadError", 500))
        assert not r.can(UpstreamRejected("bad", 400))


def test_a_stream_without_its_prompts_ids_is_not_continued_once_it_began():
    r = _resume()
    assert r.can(UpstreamUnavailable("refused"))  # nothing relayed yet: asked again whole
    r.take([{"choices": [{"delta": {"content": "a"}}]}])  # a vLLM that sends no token ids
    assert not r.can(UpstreamUnavailable("closed"))
    assert not _resume(n=3).can(UpstreamUnavailable("closed"))
    r = _resume()  # the prompt's ids came, a token's did not (vLLM hides them when it hides reasoning)
    r.take([{"prompt_token_ids": [1], "choices": [{"delta": {"role": "assistant", "content": ""}}]}])
    assert r.can(UpstreamUnavailable("closed"))
    r.take([{"choices": [{"delta": {"content": "a"}}]}])
    assert not r.can(UpstreamUnavailable("closed"))


def test_a_relayed_stream_keeps_its_identity_and_loses_the_ids_it_did_not_ask_for():
    r = Resume("/v1/chat/completions", {"model": "m", "max_tokens": 10}, upstream=None, board=None, worker=0,  # type: ignore[arg-type]
               timeout=60.0, max_model_len=2048, headers=None, route="/v1/chat/completions", relayed=True, strip=True)
    first = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
    out = r.take([first, {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"reasoning": "hm"}, "token_ids": [5]}]}])
    assert "prompt_token_ids" not in out[0] and all("token_ids" not in c["choices"][0] for c in out)
    assert r.prompt_ids == [1, 2] and r.ids == [5] and r.thinking  # cut inside its reasoning
    r._continuation(in_reasoning=r.thinking)
    r.shaped, r.base = True, 1
    out = r.take([{"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "m",
                   "choices": [{"index": 0, "text": "ok</think>Hi", "token_ids": [6, 7]}]}])
    assert out[0]["id"] == "chatcmpl-1" and out[0]["object"] == "chat.completion.chunk" and out[0]["created"] == 5
    assert out[0]["choices"][0]["delta"] == {"reasoning": "ok", "content": "Hi"} and r.ids == [5, 6, 7]


def test_the_agents_routes_and_echo_are_not_resumed_and_say_why():
    assert "Anthropic Messages API" in refusal("/v1/messages", {})
    assert "Responses API" in refusal("/v1/responses", {})
    assert "echo" in refusal("/v1/completions", {"echo": True, "prompt": "x"})


def test_a_chat_with_tools_is_continued_as_a_chat_from_the_text_it_sent():
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "user", "content": "hi"}]
    r = _resume(max_tokens=100, messages=messages, tools=tools, temperature=0)
    r.take([{"prompt_token_ids": [1, 2], "choices": [{"delta": {"content": "Let me"}, "token_ids": [5, 6]}]},
            {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}, "token_ids": [7, 8]}]}])
    assert r.can(UpstreamUnavailable("closed"), calls_sent=False)  # /api/chat: the call never reached its client
    assert not r.can(UpstreamUnavailable("closed"))  # a relayed stream passed the fragment on
    body = r._chat_continuation()
    assert body["messages"] == [*messages, {"role": "assistant", "content": "Let me"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 98 and body["tools"] == tools and body["temperature"] == 0  # the call's 2 ids re-made
    r = _resume(messages=messages, tools=tools, tool_choice="required")
    r.take([{"prompt_token_ids": [1], "choices": [{"delta": {"content": "x"}, "token_ids": [5]}]}])
    assert not r.can(UpstreamUnavailable("closed"), calls_sent=False)  # a grammar would begin again
    r = _resume(messages=messages, tools=tools)
    r.take([{"prompt_token_ids": [1], "choices": [{"delta": {"reasoning": "hm"}, "token_ids": [5]}]}])
    assert not r.can(UpstreamUnavailable("closed"), calls_sent=False)


async def test_a_continuation_learns_the_context_it_was_not_told():
    """An ``--upstream`` model listed before its vLLM knew its context: the continuation's ``max_tokens`` comes from
    ``/v1/models`` asked at the resume (without it vLLM's ``/v1/completions`` would stop at 16 tokens); a model
    that lists none is not continued."""
    class Upstream:
        def __init__(self, listed):
            self.listed = listed

        async def get_json(self, path):
            assert path == "/v1/models"
            return {"data": [{"id": "other", "max_model_len": 99}, self.listed]}

    broke = UpstreamUnavailable("closed")
    r = Resume("/v1/chat/completions", {"model": "m"}, upstream=Upstream({"id": "m", "max_model_len": 2048}),  # type: ignore[arg-type]
               board=None, worker=0, timeout=60.0, max_model_len=None, headers=None, route="/api/chat")
    r.take([{"prompt_token_ids": [1, 2, 3], "choices": [{"delta": {"content": "a"}, "token_ids": [7]}]}])
    await r._learn_context(broke)
    assert r._continuation(False)["max_tokens"] == 2048 - 4
    r = Resume("/v1/chat/completions", {"model": "m"}, upstream=Upstream({"id": "m"}),  # type: ignore[arg-type]
               board=None, worker=0, timeout=60.0, max_model_len=None, headers=None, route="/api/chat")
    with pytest.raises(UpstreamUnavailable):
        await r._learn_context(broke)


async def test_a_5xx_of_a_vllm_that_serves_is_final_even_after_a_health_probe_that_failed():
    """The first ``/health`` look failed (a busy vLLM's, past its 5 s), so the request was asked again; the vLLM,
    never restarted (the board's count unchanged), fails it again with its 500 while ``/health`` now answers: that
    500 is the request's own, passed on at once, not asked again until ``--resume-timeout``."""
    import asyncio
    import contextlib

    class Board:
        ready, restarts = True, 0

        def news(self, worker):
            return asyncio.sleep(3600)

    class Upstream:
        posts = 0

        @contextlib.asynccontextmanager
        async def request(self, method, path, body=None, headers=None):
            self.posts += 1
            raise UpstreamRejected("EngineCore encountered an issue", 500)
            yield  # pragma: no cover

        async def answer(self, method, path, body):
            assert path == "/health"
            return 200, b""

    up = Upstream()
    r = Resume("/v1/completions", {"model": "m", "prompt": "x"}, upstream=up, board=Board(), worker=0,  # type: ignore[arg-type]
               timeout=60.0, max_model_len=2048, headers=None, route="/v1/completions", unstreamed=True)
    with pytest.raises(UpstreamRejected):
        await asyncio.wait_for(r.reopen(UpstreamRejected("EngineCore encountered an issue", 500)), 10)
    assert up.posts == 1 and not r.sending
