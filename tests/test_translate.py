"""Pure translation functions: Ollama request pieces -> vLLM request pieces."""

from __future__ import annotations

import pytest

from vllama_proxy.errors import BadRequest
from vllama_proxy.ollama_types import Options, parse_keep_alive
from vllama_proxy.stream import ChatTranslator, Timings
from vllama_proxy.translate import image_url, response_format, sampling_params


def test_sampling_params_names_and_ignored():
    fields, ignored = sampling_params(Options(num_predict=0, repeat_penalty=1.1, stop="x", num_ctx=4096, mirostat=2, typical_p=0.5, foo=1))
    assert fields == {"repetition_penalty": 1.1, "stop": ["x"]}  # num_predict 0: no cap, left out
    assert ignored == ["foo", "mirostat", "num_ctx", "typical_p"]


def test_response_format():
    assert response_format("") is None and response_format(None) is None
    assert response_format("json") == {"type": "json_object"}
    with pytest.raises(BadRequest):
        response_format("yaml")


def test_image_media_types():
    assert image_url("iVBORw0")["image_url"]["url"].startswith("data:image/png;base64,")
    assert image_url("/9j/4AA")["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert image_url("R0lGODlh")["image_url"]["url"].startswith("data:image/gif;base64,")
    assert image_url("data:image/webp;base64,UklGR")["image_url"]["url"] == "data:image/webp;base64,UklGR"


@pytest.mark.parametrize("value,seconds", [(None, 300), ("10m", 600), ("1h30m", 5400), ("-1m", -60), (0, 0), ("0", 0), ("1.5s", 1.5), ("", 300), (-1, -1)])
def test_keep_alive(value, seconds):
    assert parse_keep_alive(value, default=300) == seconds


def test_malformed_tool_arguments_are_kept():
    t = ChatTranslator("m", Timings(0), aggregate=True)
    t.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{oops"}}]}, "finish_reason": None}]})
    t.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    assert t.final()["message"]["tool_calls"] == [{"id": "c1", "function": {"index": 0, "name": "f", "arguments": {"__raw__": "{oops"}}}]
