"""The finisher: the one place that completes every body vLLM receives, for every route.

A route builds what vLLM is asked (``ollama/to_openai.py``, or the gate's checked fields); :func:`finish` adds,
in one pass, what every body owes the other tenants and the operator, so that no route can forget one: the model
as vLLM serves it; vLLM's ``priority`` (a user key never goes before others); a stream's usage ask for the
settler; a user key's Responses request stateless; with ``--resume`` the token ids (``return_token_ids``) a
broken stream is asked again with (``resume.py``); when relayed, a created model's defaults under the client's;
the key's cache share (``cache_salt.py``); and last the answer's length (``output_tokens.py``: the key's
``max_tokens`` and the context). Runs with the model held, once per request, never per token.
"""

from __future__ import annotations

from typing import Any

from vllama_proxy.models.created import CreatedModel
from vllama_proxy.models.vllm_servers import ServedModel
from vllama_proxy.upstream import Upstream

from ..policy.cache_salt import own_media, salted
from .call import Call
from ..ollama.to_openai import sampling_params
from .output_tokens import cap_output

#: The upstream routes whose vLLM request model takes ``priority`` (Anthropic's has none: it would be dropped).
_PRIORITY = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/v1/score",
                       "/v1/responses"})
#: The upstream routes whose vLLM request model takes ``cache_salt`` (vLLM 0.32; ``cache_salt.py``).
_SALTED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/v1/score",
                     "/v1/responses", "/v1/messages"})
#: The relayed routes a created model's layers apply to (what Ollama's Modelfile sets has a meaning there).
_DEFAULTED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
#: The upstream routes whose streams carry their usage only when asked (``stream_options.include_usage``).
_STREAMED_USAGE = frozenset({"/v1/chat/completions", "/v1/completions"})


async def finish(call: Call, body: dict[str, Any], path: str, *, served: str,
                 model: ServedModel | None, upstream: Upstream, made: CreatedModel | None = None,
                 relayed: bool = False, token_ids: bool = False) -> dict[str, Any]:
    """``body`` (what vLLM at ``path`` is asked) completed for ``call``, in place; returns it.

    Args:
        served: the served model's name (the base of a created model).
        model: the resolved model (its context bounds the output; ``None``: unknown to vllama).
        upstream: its vLLM (``/tokenize`` for the cap).
        made: the created model the client named, whose adapter and, on a relayed route, defaults apply.
        relayed: the body is the client's own (a ``/v1`` or agents' route), not one vllama translated.
        token_ids: ask vLLM for the token ids of the prompt and the answer (``resume.py``).

    Raises:
        BadRequest: a client's ``cache_salt`` vLLM would refuse (``cache_salt.salted``).
    """
    key = call.key
    body["model"] = made.served_as(served) if made is not None else served
    if path in _PRIORITY:
        _priority(body, call.priority, key.admin)
    if relayed and path in _STREAMED_USAGE:
        call.drop_usage = _ask_usage(body)
    if path == "/v1/responses" and not key.admin:
        body["store"] = False  # stateless, as Ollama serves it: vLLM would keep every response in memory
    if token_ids and path in ("/v1/chat/completions", "/v1/completions"):
        body["return_token_ids"] = True
    if relayed and made is not None and path in _DEFAULTED:
        _defaults(body, path, made)  # before the cap: a PARAMETER num_predict is capped as the client's own
    if path in _SALTED or not relayed:
        salted(body, key.cache_salt)
        if relayed:
            own_media(body, key.cache_salt)
    return await cap_output(upstream, model, body, path, key.max_tokens, relayed=relayed)


def _priority(body: dict[str, Any], priority: int | None, admin: bool) -> None:
    """The request's vLLM ``priority`` when fair sharing set one (``admission.py``), replacing any the client
    sent: a client must not jump the queue. Without one (``--fair-share off``, or an ``--upstream`` vLLM, which
    may run ``--scheduling-policy priority`` all the same), a user key's ``priority`` below vLLM's default 0
    (lower is served first) is left out: a user may yield to others, never go before them."""
    if priority is not None:
        body["priority"] = priority
    elif not admin:
        sent = body.get("priority")
        if not isinstance(sent, int) or isinstance(sent, bool) or sent < 0:
            body.pop("priority", None)


def _ask_usage(body: dict[str, Any]) -> bool:
    """Ask vLLM for the usage of a stream that did not ask for it (``stream_options.include_usage``, without
    ``continuous_usage_stats``: one chunk, at the end); whether it was asked here (the relay then drops that
    chunk, which the client did not ask for). Without it vLLM's stream says nothing of its tokens."""
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True,
                              "continuous_usage_stats": False}
    return True


#: A created model's ``PARAMETER`` s as each relayed route names them (Ollama's options -> vLLM's fields,
#: ``to_openai.sampling_params``); Anthropic's and the Responses API's take fewer.
_AGENT_FIELDS = {
    "/v1/messages": {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop": "stop_sequences",
                     "max_tokens": "max_tokens"},
    "/v1/responses": {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop": "stop",
                      "max_tokens": "max_output_tokens", "repetition_penalty": "repetition_penalty", "seed": "seed",
                      "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                      "min_p": "min_p"},
}


def _defaults(body: dict[str, Any], path: str, made: CreatedModel) -> None:
    """A created model's layers under a relayed body, as Ollama applies its Modelfile on every route: its
    ``PARAMETER`` s for the fields the client did not send, its ``SYSTEM`` when the conversation has no
    system prompt of its own, its ``MESSAGE`` s before a chat's messages."""
    params, _ = sampling_params(made.parameters)  # type: ignore[arg-type]
    names = _AGENT_FIELDS.get(path)
    for field, value in params.items():
        target = names.get(field) if names is not None else field
        if target is not None and body.get(target) is None:
            body[target] = value
    if path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        messages = body["messages"]
        pre = [dict(m) for m in made.messages]
        if made.system and not any(isinstance(m, dict) and m.get("role") in ("system", "developer") for m in messages):
            pre.insert(0, {"role": "system", "content": made.system})
        if pre:
            body["messages"] = pre + messages
    elif path == "/v1/messages" and made.system and not body.get("system"):
        body["system"] = made.system
    elif path == "/v1/responses" and made.system and not body.get("instructions"):
        body["instructions"] = made.system
