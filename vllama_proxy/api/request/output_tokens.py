"""How many tokens an answer may take: a request's output-token fields clamped before it goes
upstream (``num_predict: 1000000`` went to vLLM as ``max_tokens`` unclamped).

The clamp is ``translate.cap_output_tokens`` (pure); this module adds the one fact it may need from
vLLM, the prompt's length, asked of vLLM's ``/tokenize`` only when a request asks for at least the
whole context (rare: the per-token path and the usual request make no extra call).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from vllama_proxy.errors import UpstreamError
from vllama_proxy.models.vllm_servers import ServedModel
from vllama_proxy.upstream import Upstream

from ..policy.keys import key_of
from ..ollama.to_openai import cap_output_tokens, output_tokens_asked


async def prompt_tokens(upstream: Upstream, body: dict[str, Any], template: tuple[str, ...] = ()) -> int | None:
    """The prompt's tokens as vLLM counts them (``/tokenize`` with the body's ``messages`` or
    ``prompt``, and its ``template`` fields the chat template reads, such as ``tools``), ``None`` when vLLM
    cannot say (a prompt of token ids, images, an error)."""
    ask: dict[str, Any] = {"model": body.get("model")}
    if isinstance(body.get("messages"), list):
        ask["messages"] = body["messages"]
        ask.update((f, body[f]) for f in template if body.get(f) is not None)
    elif isinstance(body.get("prompt"), str):
        ask["prompt"] = body["prompt"]
    else:
        return None
    try:
        count = (await upstream.post_json("/tokenize", ask))["count"]
    except (UpstreamError, KeyError, TypeError):
        return None
    return count if isinstance(count, int) else None


#: What vLLM's Anthropic ``/v1/messages/count_tokens`` renders: the fields a request's prompt is built from.
_MESSAGES_PROMPT = ("model", "messages", "system", "tools", "tool_choice", "thinking")


async def messages_prompt_tokens(upstream: Upstream, body: dict[str, Any]) -> int | None:
    """An Anthropic ``/v1/messages`` body's prompt as vLLM counts it (its ``/v1/messages/count_tokens``:
    the same template, system and tools), ``None`` when vLLM cannot say."""
    try:
        count = (await upstream.post_json("/v1/messages/count_tokens", {k: v for k, v in body.items() if k in _MESSAGES_PROMPT}))
        count = count.get("input_tokens")
    except (UpstreamError, AttributeError):
        return None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


async def cap_output(request: web.Request, upstream: Upstream, model: ServedModel | None, body: dict[str, Any],
                     fields: tuple[str, ...]) -> dict[str, Any]:
    """``body`` with its output-token ``fields`` clamped (``translate.cap_output_tokens``) to the
    request key's ``max_tokens`` and to what ``model``'s context holds: ``max_model_len`` less the
    prompt's tokens when a field asks for ``max_model_len`` or more (counted by :func:`prompt_tokens`, or
    :func:`messages_prompt_tokens` for Anthropic's ``/v1/messages``; ``max_model_len`` alone when vLLM
    cannot count). Claude Code asks ``max_tokens`` 32000 of any model, which vLLM 0.26 refused outright and
    refused again when lowered to the whole context beside the prompt (seen on the H200). Returns ``body``."""
    context = model.max_model_len if model is not None else None
    room = context
    if context and output_tokens_asked(body, fields) >= context:
        count = messages_prompt_tokens if request.path == "/v1/messages" else prompt_tokens
        used = await count(upstream, body)
        if used is not None:
            room = context - used
    return cap_output_tokens(body, fields, room, key_of(request).max_tokens)
