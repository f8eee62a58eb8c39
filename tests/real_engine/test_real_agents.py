"""The coding agents' APIs against the real vLLM on CPU (issue 40): the real ``anthropic`` and ``openai`` SDKs,
and Claude Code's and Codex's own request shapes replayed.

The session's ``tool_server`` serves the shipped tool model with no parser flags given: vllama tells
``hermes`` and ``qwen3`` from its chat template, so vLLM's Anthropic and Responses endpoints return
``tool_use``/``function_call`` and ``thinking``/``reasoning`` blocks (on main the same server refused
tools with vLLM's 400 "auto tool choice requires --enable-auto-tool-choice" and gave the ``<think>``
block back as text). The shapes of ``tests/fixtures/agents/`` (cited there) go through
``benchmarks/agents_replay.py``, the script the coordinator runs against a GPU's vLLM 0.26.
"""

from __future__ import annotations

import re
import sys

import anthropic
import httpx
import openai

from .conftest import ROOT, TOOL_NAME

sys.path.insert(0, str(ROOT / "benchmarks"))
import agents_replay  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def output_tokens(url: str) -> float:
    """vllama's per-key output-token counter for the open server's key ``-`` and the tool model."""
    text = httpx.get(url + "/metrics").text
    pattern = rf'^vllama_key_output_tokens_total{{(?=[^}}]*key="-")(?=[^}}]*model="{TOOL_NAME}")[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def test_anthropic_sdk_tool_use_thinking_stream_and_count_tokens(tool_server):
    before = output_tokens(tool_server.url)
    client = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)
    msg = client.messages.create(model="claude-sonnet-4-5", max_tokens=300, messages=ASK, tools=[WEATHER])  # an alias
    kinds = [b.type for b in msg.content]
    assert kinds[0] == "thinking" and "tool_use" in kinds, msg
    call = next(b for b in msg.content if b.type == "tool_use")
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and msg.stop_reason == "tool_use"
    assert "<think>" not in msg.model_dump_json()  # the block came back as a thinking block, not as text

    with client.messages.stream(model=TOOL_NAME, max_tokens=300, messages=ASK, tools=[WEATHER]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert "content_block_start" in events and [b.type for b in final.content][0] == "thinking"
    assert any(b.type == "tool_use" and b.input == {"city": "Paris"} for b in final.content)

    plain = client.messages.create(model=TOOL_NAME, max_tokens=1500, thinking={"type": "enabled", "budget_tokens": 1024},
                                   messages=[{"role": "user", "content": "Is 17 a prime number?"}])
    assert [b.type for b in plain.content][:1] == ["thinking"] and plain.content[0].thinking.strip()
    assert any(b.type == "text" for b in plain.content)

    counted = client.messages.count_tokens(model=TOOL_NAME, messages=ASK, tools=[WEATHER])
    assert counted.input_tokens > 10
    # per-key usage, as /api/chat counts it: the open server's key "-", the served model
    assert output_tokens(tool_server.url) - before >= msg.usage.output_tokens + plain.usage.output_tokens


def test_openai_sdk_responses_tool_call_reasoning_and_stream(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)
    fn = {"type": "function", "name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    r = client.responses.create(model=TOOL_NAME, input="What is the weather in Paris?", tools=[fn], store=False)
    kinds = [o.type for o in r.output]
    assert kinds[0] == "reasoning" and "function_call" in kinds, r
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and '"Paris"' in call.arguments
    with client.responses.stream(model=TOOL_NAME, input="What is the weather in Paris?", tools=[fn], store=False) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.completed" in events and "function_call" in [o.type for o in final.output]


def test_claude_codes_and_codexs_request_shapes(tool_server):
    # both agents' shapes, unstreamed and streamed, with Claude Code's 32000-token asks on a 2048-token context;
    # greedy: the 6-layer tool model sampled at the agents' temperature 1 now and then misformats its call
    # (seen once in five streamed Codex tool turns: the call's JSON without its opening <tool_call> tag)
    results = agents_replay.replay(tool_server.url, TOOL_NAME, overrides={"temperature": 0})
    wrong = [(r["agent"], r["name"], r["stream"], r["status"], r["kinds"], r["error"]) for r in results if not r["ok"]]
    assert len(results) == 13 and wrong == []
