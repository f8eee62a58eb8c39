"""How many tokens an answer may take: a request's output-token fields bounded, in one pass, before it goes
upstream (``num_predict: 1000000`` went to vLLM as ``max_tokens`` unclamped).

:func:`cap_output` is the finisher's one step for it (``finisher.py``): an Ollama ``/v1/completions`` body
without ``max_tokens`` asks until the context is full (vLLM would stop at 16), every output-token field is
clamped to the key's ``max_tokens`` and to the room the context leaves (:func:`cap_output_tokens`, pure), and
Anthropic's thinking budget stays below ``max_tokens``. The prompt is counted by vLLM (``/tokenize``) only
when a request asks for at least the whole context, or for a completion's room: the usual request makes no
extra call. :func:`prompt_tokens` is also ``context_fit.py``'s count.
"""

from __future__ import annotations

from typing import Any

from vllama_proxy.errors import UpstreamError, UpstreamRejected
from vllama_proxy.models.vllm_servers import ServedModel
from vllama_proxy.upstream import Upstream

#: The fields of each generating route that bound the answer's length, in tokens; the first is set
#: when a key's cap applies and the request gives none (vLLM's ``protocol.py`` of each route).
OUTPUT_TOKEN_FIELDS: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/messages": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}


def cap_output_tokens(body: dict[str, Any], fields: tuple[str, ...], room: int | None, key_cap: int | None) -> dict[str, Any]:
    """Clamp ``body``'s output-token ``fields`` to what the model can hold and the key may take.

    Each integer field above ``room`` (tokens the context holds after the prompt: the model's
    ``max_model_len`` less the prompt's tokens when counted, else ``max_model_len``; vLLM answers
    400 for more, Ollama clamps ``num_predict``) or ``key_cap`` (the key's ``max_tokens``) is
    lowered to the smaller; with ``key_cap`` and none of ``fields`` given, the first is set to it
    (an answer without a bound runs until the context is full). ``None``: no such limit. A field
    that is not an integer is left for vLLM to refuse in its own words. Returns ``body``.
    """
    limit = min((x for x in (room, key_cap) if x is not None), default=None)
    if limit is None:
        return body
    limit = max(limit, 1)
    given = False
    for field in fields:
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            given = True
            if value > limit:
                body[field] = limit
        elif value is not None:
            given = True
    if key_cap is not None and not given:
        body[fields[0]] = limit
    return body


def output_tokens_asked(body: dict[str, Any], fields: tuple[str, ...]) -> int:
    """The largest integer of ``body``'s output-token ``fields`` (0: none given)."""
    return max((v for f in fields if isinstance(v := body.get(f), int) and not isinstance(v, bool)), default=0)


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


async def cap_output(upstream: Upstream, model: ServedModel | None, body: dict[str, Any], path: str,
                     key_cap: int | None, *, relayed: bool) -> dict[str, Any]:
    """``body`` (what vLLM at ``path`` is asked) with its answer's length bounded, in place; returns it.

    An Ollama ``/v1/completions`` body (not ``relayed``) without ``max_tokens`` gets the room its context leaves
    (:func:`remaining_context`). Each of the route's output-token fields (:data:`OUTPUT_TOKEN_FIELDS`) is then
    clamped (:func:`cap_output_tokens`) to ``key_cap`` (the key's ``max_tokens``) and to what ``model``'s context
    holds: ``max_model_len`` less the prompt's tokens when a field asks for ``max_model_len`` or more (counted by
    :func:`prompt_tokens`, or :func:`messages_prompt_tokens` for Anthropic's ``/v1/messages``; ``max_model_len``
    alone when vLLM cannot count). Claude Code asks ``max_tokens`` 32000 of any model, which vLLM 0.26 refused
    outright and refused again when lowered to the whole context beside the prompt (seen on the H200). On
    ``/v1/messages`` the thinking budget then stays below ``max_tokens``."""
    fields = OUTPUT_TOKEN_FIELDS.get(path)
    if fields is None:
        return body
    if not relayed and model is not None and path == "/v1/completions" and "max_tokens" not in body:
        body["max_tokens"] = await remaining_context(upstream, model, body["prompt"])
    context = model.max_model_len if model is not None else None
    room = context
    if context and output_tokens_asked(body, fields) >= context:
        count = messages_prompt_tokens if path == "/v1/messages" else prompt_tokens
        used = await count(upstream, body)
        if used is not None:
            room = context - used
    cap_output_tokens(body, fields, room, key_cap)
    if path == "/v1/messages":
        _budget_below(body)
    return body


async def remaining_context(upstream: Upstream, model: ServedModel, prompt: str) -> int:
    """``max_tokens`` meaning "until the context is full": context length minus prompt tokens.

    vLLM's ``/v1/completions`` stops at 16 tokens when ``max_tokens`` is absent or null
    (measured on vLLM 0.26, ``benchmarks/RESULTS.md``), unlike Ollama's ``num_predict: -1``.
    The prompt is counted by vLLM's own ``/tokenize``; if that fails, by its UTF-8 length
    (an upper bound for byte-level tokenizers), so the cap stays within the context.
    """
    try:
        data = await upstream.post_json("/tokenize", {"model": model.name, "prompt": prompt})
        count = int(data["count"])
        limit = int(data.get("max_model_len") or model.max_model_len or 0)
    except (UpstreamRejected, KeyError, TypeError, ValueError):
        count = len(prompt.encode()) + 2
        limit = model.max_model_len or 0
    return max(limit - count, 1)


def _budget_below(body: dict[str, Any]) -> None:
    """Anthropic's rule (and vLLM's check): ``thinking.budget_tokens`` stays below ``max_tokens``."""
    thinking, most = body.get("thinking"), body.get("max_tokens")
    if isinstance(thinking, dict) and isinstance(thinking.get("budget_tokens"), int) and isinstance(most, int) \
            and thinking["budget_tokens"] >= most:
        body["thinking"] = {**thinking, "budget_tokens": max(most - 1, 1)}
