"""What of a ``/v1`` body a key of role ``user`` may send to vLLM: an allow-list of top-level fields per route.

The Ollama routes are translated (vLLM sees only fields vllama wrote); the ``/v1`` inference and
agents' routes relay the client's JSON to an engine every tenant shares, and vLLM 0.32's request
models (read from its CPU build) also take fields for the operator's machinery
(``kv_transfer_params``, ``vllm_xargs``, ``request_id``, the multimodal processor's arguments: GPU
work no share accounts for). For a user key a field of :data:`ALLOWED` passes, one of
:data:`OPERATORS` is a 400 naming it, and any other is left out (vLLM ignores fields its model does
not know, so a client sees no change, and a field a later vLLM adds reaches it only once listed).
Admin keys and a server without keys send what they send, but for their own ``cache_salt`` and media
uuids (``cache_salt.py``).
"""

from __future__ import annotations

from typing import Any

from vllama_proxy.errors import BadRequest

_COMMON = frozenset({
    "model", "user", "priority", "cache_salt", "add_special_tokens", "truncate_prompt_tokens", "truncation_side",
})
_GENERATION = _COMMON | frozenset({
    "stream", "stream_options", "stream_interval", "max_tokens", "n", "seed", "stop", "stop_token_ids", "bad_words",
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "length_penalty", "logit_bias", "allowed_token_ids", "logprobs", "top_logprobs", "prompt_logprobs",
    "logprob_token_ids", "min_tokens", "ignore_eos", "use_beam_search", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "response_format", "structured_outputs", "echo",
    "return_token_ids", "return_token_offsets", "return_tokens_as_token_ids", "repetition_detection",
    "thinking_token_budget", "watermarking",
})
_CHAT_INPUT = frozenset({
    "messages", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
    "documents",
})
_SCORING = frozenset({
    "instruction", "max_tokens_per_doc", "max_tokens_per_query", "padding", "use_activation", "chat_template_kwargs",
})
#: The top-level fields of each relayed inference route a user key's body may carry to vLLM.
ALLOWED: dict[str, frozenset[str]] = {
    "/v1/chat/completions": _GENERATION | _CHAT_INPUT | frozenset({
        "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort",
        "include_reasoning", "return_prompt_text",
    }),
    "/v1/completions": _GENERATION | frozenset({"prompt", "suffix", "prompt_embeds"}),
    "/v1/embeddings": _COMMON | _CHAT_INPUT | frozenset({
        "input", "dimensions", "encoding_format", "embed_dtype", "endianness", "padding", "use_activation",
    }),
    "/v1/rerank": _COMMON | _SCORING | frozenset({"query", "documents", "top_n"}),
    "/v1/score": _COMMON | _SCORING | frozenset({"text_1", "text_2", "data_1", "data_2", "queries", "documents", "items"}),
    # the agents' routes (vLLM's ResponsesRequest, AnthropicMessagesRequest, AnthropicCountTokensRequest)
    "/v1/responses": _COMMON | frozenset({
        "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "logit_bias", "parallel_tool_calls",
        "prompt", "reasoning", "include_reasoning", "service_tier", "store", "stream", "temperature", "text",
        "tool_choice", "tools", "top_logprobs", "top_p", "top_k", "min_p", "truncation", "skip_special_tokens",
        "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "prompt_cache_key", "watermarking",
        "structured_outputs", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "include",
        "chat_template_kwargs", "enable_response_messages", "previous_input_messages", "background",
        "previous_response_id",
    }),
    "/v1/messages": frozenset({
        "model", "messages", "max_tokens", "metadata", "output_config", "thinking", "stop_sequences", "stream", "system",
        "temperature", "tool_choice", "tools", "top_k", "top_p", "cache_salt", "watermarking", "chat_template_kwargs",
    }),
    "/v1/messages/count_tokens": frozenset({
        "model", "messages", "output_config", "system", "thinking", "tool_choice", "tools", "chat_template_kwargs",
    }),
}
#: vLLM 0.32's own request fields for the operator's machinery: refused from a user key.
OPERATORS = frozenset({
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "request_id", "session_id",
    "routed_experts_prompt_start", "mm_processor_kwargs", "media_io_kwargs", "mm_payload", "return_mm_kwargs",
})


def user_body(path: str, data: dict[str, Any]) -> None:
    """Keep of ``data`` (the JSON body of a user key's request to ``path``, or the fields of it the gate does not
    type: ``request/gate.py``) the fields of :data:`ALLOWED`, in place; a path not listed there is left as it is.

    Raises:
        BadRequest: a field of :data:`OPERATORS`, named.
    """
    allowed = ALLOWED.get(path)
    if allowed is None:
        return
    for field in [f for f in data if f not in allowed]:
        if field in OPERATORS:
            raise BadRequest(f"invalid field '{field}': it sets vLLM's own machinery, which only an admin key may "
                             f"set on {path}")
        del data[field]
