"""The comparator of tests/vllm_replay.py on made-up bodies (the recordings themselves: test_vllm_recordings.py)."""

from __future__ import annotations

import json

import vllm_replay as vr

SSE = {"content-type": "text/event-stream; charset=utf-8"}


def sse(*events) -> dict:
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return {"status": 200, "headers": SSE, "body": body}


def chunk(delta: dict, finish=None, **extra) -> dict:
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


USAGE = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def tool_stream(split_name_and_args: bool, reasoning_key: str = "reasoning", usage_last: bool = True) -> dict:
    start = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    events = [chunk({"role": "assistant", "content": ""}), chunk({reasoning_key: "hm"})]
    if split_name_and_args:
        events += [chunk({"tool_calls": [start]}), chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                   chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, finish="tool_calls")]
    else:
        whole = {**start, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        events += [chunk({"tool_calls": [whole]}, finish="tool_calls")]
    events = events + [USAGE, "[DONE]"] if usage_last else events[:1] + [USAGE] + events[1:] + ["[DONE]"]
    return sse(*events)


def test_same_shape_other_values_no_differences():
    a = tool_stream(True)
    b = json.loads(json.dumps(a))
    b["body"] = b["body"].replace("Paris", "Oslo").replace("call_1", "call_9")
    assert vr.differences(vr.outline(a), vr.outline(b)) == []


def test_outline_sequence_of_a_tool_stream():
    assert vr.outline(tool_stream(True))["sequence"] == ["role", "reasoning", "tool_start", "tool_args", "tool_args,+finish",
                                                         "usage", "[DONE]"]


def test_drift_is_named():
    real = vr.outline(tool_stream(True))
    assert any(d.startswith("sequence") for d in vr.differences(real, vr.outline(tool_stream(False))))
    assert any("reasoning_content" in d for d in vr.differences(real, vr.outline(tool_stream(True, "reasoning_content"))))
    assert any(d.startswith("sequence") for d in vr.differences(real, vr.outline(tool_stream(True, usage_last=False))))


def test_error_type_and_code_compared():
    def err(t, code):
        return {"status": code, "headers": {"content-type": "application/json"},
                "body": json.dumps({"error": {"message": "m", "type": t, "param": None, "code": code}})}

    assert vr.differences(vr.outline(err("BadRequestError", 400)), vr.outline(err("BadRequestError", 400))) == []
    assert vr.differences(vr.outline(err("BadRequestError", 400)), vr.outline(err("NotFoundError", 404)))


def test_request_key_ignores_sampling_and_name_not_content():
    served = {"m"}
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    same = {**base, "model": "fake-model", "temperature": 0, "stream_options": {"include_usage": True}}
    assert vr.request_key("/v1/chat/completions", base, served | {"fake-model"}) == vr.request_key("/v1/chat/completions", same, served | {"fake-model"})
    other = {**base, "messages": [{"role": "user", "content": "hello"}]}
    assert vr.request_key("/v1/chat/completions", base, served) != vr.request_key("/v1/chat/completions", other, served)
    unknown = {**base, "model": "nope"}
    assert vr.request_key("/v1/chat/completions", base, served) != vr.request_key("/v1/chat/completions", unknown, served)


def test_accumulate_streamed_and_whole():
    said = vr.accumulate(tool_stream(True))
    assert said["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert said["reasoning"] == "hm" and said["finish_reason"] == "tool_calls"
    assert vr.accumulate(tool_stream(False))["tool_calls"] == said["tool_calls"]
