"""A conversation longer than its model's context, made to fit as Ollama makes it: ``truncate`` and ``shift``.

Ollama's ``truncate`` and ``shift`` default to true: a chat longer than the context drops its oldest
turns (``server/prompt.go`` ``chatPrompt``: system messages and the latest message kept, a tool's
answer never parted from its call) and an answer reaching the context's end goes on; vLLM refuses
both with a 400. When vLLM refuses for its context (:func:`is_context_full`), :func:`fit` makes the
request fit once, in vLLM's own count (``/tokenize`` with the chat template, by bisection), and it is
sent again: the output lowered to the room left (``shift``), or the oldest turns dropped until it fits
with room for the answer (``truncate``; its ``num_predict``, at most a quarter of the context), a prompt
still too long cut from its start by vLLM (``truncate_prompt_tokens``). ``false`` keeps vLLM's refusal,
in Ollama's words. Invariant: a request that fits costs nothing here.
"""

from __future__ import annotations

from typing import Any

from vllama_proxy.errors import BadRequest, UpstreamError, UpstreamRejected
from vllama_proxy.upstream import Upstream

from .output_tokens import prompt_tokens

#: The share of the context kept for the answer when a request asks for no more (Ollama shifts instead).
ANSWER_SHARE = 4


def is_context_full(error: UpstreamError) -> bool:
    """Whether vLLM refused a request because its prompt, or its prompt and output, exceed the context
    (vLLM 0.26-0.32: ``This model's maximum context length is N tokens. However, ...``)."""
    return isinstance(error, UpstreamRejected) and error.status == 400 and "maximum context length" in error.message


def refusal(error: UpstreamError) -> BadRequest:
    """Ollama's words for a request that does not fit and may not be made to (``truncate``/``shift`` false)."""
    return BadRequest(f"input length exceeds maximum context length: {error.message}")


async def fit(upstream: Upstream, body: dict[str, Any], context: int, *, truncate: bool, shift: bool) -> dict[str, Any] | None:
    """``body`` (a ``/v1/chat/completions`` or ``/v1/completions`` body vLLM refused for its context) made to fit
    ``context`` tokens, in place; ``None`` when it may not be (``truncate``/``shift`` false) or vLLM cannot count."""
    asked = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else None
    prompt = await _count(upstream, body)
    if prompt is None:
        return None
    if prompt < context:  # the prompt fits; the output asked for does not
        if not shift:
            return None
        body["max_tokens"] = context - prompt
        return body
    if not truncate:
        return None
    answer = max(1, min(asked or context // ANSWER_SHARE, context // ANSWER_SHARE))
    budget = context - answer
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > 1:
        kept = await _latest_that_fit(upstream, body, messages, budget)
        body["messages"] = kept
        prompt = await _count(upstream, body)
        if prompt is not None and prompt <= budget:
            body["max_tokens"] = min(asked or context - prompt, context - prompt)
            return body
    body["truncate_prompt_tokens"] = budget  # vLLM keeps the prompt's last tokens
    body["max_tokens"] = answer
    return body


async def _latest_that_fit(upstream: Upstream, body: dict[str, Any], messages: list[Any], budget: int) -> list[Any]:
    """The messages from the earliest start at which they fit ``budget`` (the system messages before it kept),
    found by bisection over the starts; the last message is always kept."""
    starts = sorted({_block_start(messages, i) for i in range(len(messages))})
    lo, hi = 0, len(starts) - 1  # the last start always "fits" (it is kept whatever its length)
    while lo < hi:
        mid = (lo + hi) // 2
        tokens = await _count(upstream, {**body, "messages": _from(messages, starts[mid])})
        if tokens is not None and tokens <= budget:
            hi = mid
        else:
            lo = mid + 1
    return _from(messages, starts[lo])


def _from(messages: list[Any], start: int) -> list[Any]:
    """``messages[start:]`` with the system messages before ``start`` kept in front (Ollama's ``chatPrompt``)."""
    system = [m for m in messages[:start] if isinstance(m, dict) and m.get("role") == "system"]
    return system + messages[start:]


def _block_start(messages: list[Any], i: int) -> int:
    """Where a turn starting at ``i`` must start: a tool's answer goes with the assistant call before it."""
    if i <= 0 or not isinstance(messages[i], dict) or messages[i].get("role") != "tool":
        return i
    start = i
    while start > 0 and isinstance(messages[start - 1], dict) and messages[start - 1].get("role") == "tool":
        start -= 1
    call = messages[start - 1] if start > 0 else None
    if isinstance(call, dict) and call.get("role") == "assistant" and call.get("tool_calls"):
        return start - 1
    return i


async def _count(upstream: Upstream, body: dict[str, Any]) -> int | None:
    """The prompt's tokens as vLLM counts them, the chat template given the body's tools."""
    return await prompt_tokens(upstream, body, ("tools", "chat_template_kwargs"))
