"""How many tokens an answer may take: a request's output-token fields clamped before it goes
upstream (issue 38: ``num_predict: 1000000`` went to vLLM as ``max_tokens`` unclamped).

The clamp is ``translate.cap_output_tokens`` (pure); this module adds the one fact it may need from
vLLM, the prompt's length, asked of vLLM's ``/tokenize`` only when a request asks for at least the
whole context (rare: the per-token path and the usual request make no extra call).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from vllama_proxy.errors import UpstreamError
from vllama_proxy.models.backends import ServedModel
from vllama_proxy.upstream import Upstream

from ..keys import key_of
from ..translate import cap_output_tokens, output_tokens_asked


async def prompt_tokens(upstream: Upstream, body: dict[str, Any]) -> int | None:
    """The prompt's tokens as vLLM counts them (``/tokenize`` with the body's ``messages`` or
    ``prompt``), ``None`` when vLLM cannot say (a prompt of token ids, images, an error)."""
    ask: dict[str, Any] = {"model": body.get("model")}
    if isinstance(body.get("messages"), list):
        ask["messages"] = body["messages"]
    elif isinstance(body.get("prompt"), str):
        ask["prompt"] = body["prompt"]
    else:
        return None
    try:
        count = (await upstream.post_json("/tokenize", ask))["count"]
    except (UpstreamError, KeyError, TypeError):
        return None
    return count if isinstance(count, int) else None


async def cap_output(request: web.Request, upstream: Upstream, model: ServedModel | None, body: dict[str, Any],
                     fields: tuple[str, ...]) -> dict[str, Any]:
    """``body`` with its output-token ``fields`` clamped (``translate.cap_output_tokens``) to the
    request key's ``max_tokens`` and to what ``model``'s context holds: ``max_model_len`` less the
    prompt's tokens when a field asks for ``max_model_len`` or more (counted by :func:`prompt_tokens`;
    ``max_model_len`` alone when vLLM cannot count). Returns ``body``."""
    context = model.max_model_len if model is not None else None
    room = context
    if context and output_tokens_asked(body, fields) >= context:
        used = await prompt_tokens(upstream, body)
        if used is not None:
            room = context - used
    return cap_output_tokens(body, fields, room, key_of(request).max_tokens)
