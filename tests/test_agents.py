"""The agents' routes over the stand-in (issue 40): what vllama decides before vLLM sees the request.

Tool use and thinking themselves come from vLLM's parsers and are tested against the real engine
(``tests/real_engine/test_real_agents.py``); here: the clear refusal of tools for a model served
without a tool parser (in Anthropic's error shape on ``/v1/messages``), Anthropic's ``x-api-key``
header as a key, the usage of Anthropic and Responses answers for the per-key counters, and the
parsers a local model's chat template tells (``models/family.py``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from vllama_proxy.api.routes.openai import _usage
from vllama_proxy.models.family import detect_parsers, with_detected_parsers
from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.models.model_files import ModelFiles

from conftest import ROOT, SERVED, metric, start_proxy, stop

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def no_tools(fake):
    """vllama over a vLLM started without --enable-auto-tool-choice/--tool-call-parser."""
    s = start_proxy(fake.url, vllm_args=[])
    yield s
    stop(s.proc)


def test_tools_for_a_model_without_a_tool_parser_are_refused_in_each_apis_shape(no_tools):
    r = httpx.post(no_tools.url + "/v1/messages", json={"model": SERVED, "max_tokens": 50, "tools": TOOLS,
                                                         "messages": [{"role": "user", "content": "weather in Paris?"}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": f'"{SERVED}" does not support tools'}}
    fn = {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["input_schema"]}
    r = httpx.post(no_tools.url + "/v1/responses", json={"model": "fake:7b", "input": "weather in Paris?", "tools": [fn]})
    assert r.status_code == 400 and r.json() == {"error": {"message": '"fake:7b" does not support tools', "type": "invalid_request_error",
                                                           "param": None, "code": 400}}  # OpenAI's shape, as Codex reads it


def test_an_unknown_model_on_v1_messages_is_anthropics_404(no_tools):
    r = httpx.post(no_tools.url + "/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error" and "nope" in r.json()["error"]["message"]


def test_anthropics_x_api_key_is_a_key_on_its_routes(fake):
    s = start_proxy(fake.url, "--api-key", "sk-agent", vllm_args=[])
    try:
        body = {"model": SERVED, "max_tokens": 5, "tools": TOOLS, "messages": [{"role": "user", "content": "x"}]}
        r = httpx.post(s.url + "/v1/messages", json=body, headers={"x-api-key": "sk-agent"})
        assert r.status_code == 400, r.text  # past the key: the tool check answered
        r = httpx.post(s.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(s.url + "/api/chat", json={"model": SERVED, "messages": []}, headers={"x-api-key": "sk-agent"})
        assert r.status_code == 401  # Ollama's routes take the bearer token only
    finally:
        stop(s.proc)


def test_agents_requests_reach_vllm_as_chats_do(proxy, upstream_requests):
    # an alias resolves to the served name; the conversation's key goes upstream for a router; the usage counts
    before = httpx.get(proxy.url + "/metrics").text
    claude = {"model": "fake:7b", "max_tokens": 50, "metadata": {"user_id": "user_1_account__session_42"},
              "messages": [{"role": "user", "content": "hi"}]}
    for turn in ("first", "second"):
        claude["messages"].append({"role": "user", "content": turn})
        r = httpx.post(proxy.url + "/v1/messages?beta=true", json=claude, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 200 and r.json()["usage"] == {"input_tokens": 12, "output_tokens": 8}
    codex = {"model": "fake:7b", "input": "hi", "store": False, "prompt_cache_key": "thread-1"}
    assert httpx.post(proxy.url + "/v1/responses", json=codex).status_code == 200
    sent = upstream_requests("/v1/messages") + upstream_requests("/v1/responses")
    assert [r["body"]["model"] for r in sent] == [SERVED] * 3
    keys = [r["headers"].get("X-Session-ID") for r in sent]
    assert keys[0] and keys[0] == keys[1] and keys[2] and keys[2] != keys[0]  # one per conversation
    after = httpx.get(proxy.url + "/metrics").text
    grew = metric(after, "vllama_key_output_tokens_total", model=SERVED) - metric(before, "vllama_key_output_tokens_total", model=SERVED)
    assert grew == 24


def test_claude_codes_32000_output_tokens_fit_what_the_prompt_leaves_of_the_context(proxy, upstream_requests):
    # Claude Code asks max_tokens 32000 (thinking budget 31999) of any model; vLLM 0.26 refused the context (4096)
    # too, since the prompt leaves less (H200, abcf5ef:benchmarks/results/h200-session9/agents-run.txt): max_tokens is
    # what the prompt leaves, counted by vLLM's /v1/messages/count_tokens
    words = " ".join(["word"] * 300)
    claude = {"model": "fake:7b", "max_tokens": 32000, "thinking": {"type": "enabled", "budget_tokens": 31999},
              "system": "You are Claude Code.", "messages": [{"role": "user", "content": words}]}
    r = httpx.post(proxy.url + "/v1/messages?beta=true", json=claude, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    sent = upstream_requests("/v1/messages")[-1]["body"]
    assert sent["max_tokens"] == 4096 - (300 + 4)  # the stand-in counts words: 300 + "You are Claude Code."
    assert sent["thinking"]["budget_tokens"] == sent["max_tokens"] - 1
    small = {**claude, "max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 50}}
    counted = len(upstream_requests("/v1/messages/count_tokens"))
    assert httpx.post(proxy.url + "/v1/messages", json=small).status_code == 200
    assert upstream_requests("/v1/messages")[-1]["body"]["max_tokens"] == 100  # fits: as sent, and not counted
    assert len(upstream_requests("/v1/messages/count_tokens")) == counted


@pytest.mark.parametrize("tail, want", [
    # Anthropic, unstreamed: cached input counted apart by Anthropic, added back
    (b'{"content":[],"usage":{"input_tokens":12,"cache_read_input_tokens":4,"output_tokens":7}}', (16, 7)),
    # Anthropic, streamed: the message_delta event
    (b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":12,"output_tokens":9}}\n\n'
     b'event: message_stop\ndata: {"type":"message_stop"}\n\n', (12, 9)),
    # Responses, streamed: response.completed carries the response with its usage
    (b'data: {"type":"response.completed","response":{"output":[{"type":"message","content":[{"text":"a \\"usage\\" {"}]}],'
     b'"usage":{"input_tokens":30,"input_tokens_details":{"cached_tokens":0},"output_tokens":5,"total_tokens":35}}}\n\n', (30, 5)),
    # OpenAI chat completions with include_usage, unchanged
    (b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n', (3, 2)),
    (b'data: {"choices":[{"delta":{}}],"usage":null}\n\n', None),
])
def test_usage_of_each_apis_answer(tail, want):
    assert _usage(tail) == want


TEMPLATES = {
    "qwen2.5": ("qwen2", '{%- if tools %}<tools></tools> <tool_call>{"name": ...}</tool_call>{% endif %}', "hermes", None),
    "qwen3": ("qwen3", "<tool_call>\n{{ tool_call | tojson }}</tool_call>{% if enable_thinking %}<think>{% endif %}", "hermes", "qwen3"),
    "qwen3-coder": ("qwen3_moe", "<tool_call>\n<function={{ name }}>", "qwen3_coder", None),
    "llama3.1": ("llama", '{{- "<|python_tag|>" + tool_call.name }}<|start_header_id|>ipython', "llama3_json", None),
    "mistral": ("mistral", "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral", None),
    "deepseek-r1-distill": ("qwen2", "{{'<｜Assistant｜><think>\\n'}}", None, "deepseek_r1"),
    "gpt-oss": ("gpt_oss", "<|start|>assistant<|channel|>analysis<|message|>", "openai", "openai_gptoss"),
    "granite4": ("granitemoehybrid", "<tool_call>{{ call }}</tool_call>", "granite4", None),
    "plain": ("qwen2", "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", None, None),
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_parsers_told_by_the_chat_template(family):
    model_type, template, tool, reasoning = TEMPLATES[family]
    found = detect_parsers(ModelFiles(config={"model_type": model_type}, chat_template=template))
    assert (found.tool_call_parser, found.reasoning_parser) == (tool, reasoning)


def test_the_shipped_tool_model_gets_hermes_and_qwen3_unless_it_names_its_own():
    model = str(ROOT / "tests" / "assets" / "tool-model")
    assert with_detected_parsers(ModelConfig(model=model)).args() == [
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    own = ModelConfig(model=model, vllm_args=["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
    assert with_detected_parsers(own).args() == ["--reasoning-parser", "qwen3", *own.vllm_args]
    assert with_detected_parsers(ModelConfig(model=model, reasoning_parser="deepseek_r1", tool_call_parser="hermes")).args() == [
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"]
    assert with_detected_parsers(ModelConfig(model="org/not-here")).args() == []  # no files: nothing told
    assert json.dumps(with_detected_parsers(ModelConfig(model=model, vllm_args=["--runner", "pooling"])).args()) == '["--runner", "pooling"]'


def test_api_status_says_ollamas_cloud_is_off(proxy):
    # Ollama 0.16.2's GET /api/status: whether its cloud models are available (server/routes.go StatusHandler)
    r = httpx.get(proxy.url + "/api/status")
    assert r.status_code == 200 and r.json() == {"cloud": {"disabled": True, "source": "vllama"}}
