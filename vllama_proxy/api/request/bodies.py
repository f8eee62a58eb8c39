"""The typed bodies of the relayed inference routes: OpenAI's (``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/rerank``, ``/v1/score``, ``/v1/responses``) and Anthropic's (``/v1/messages``,
``/v1/messages/count_tokens``), as vLLM 0.32's ``protocol.py`` of each endpoint names their fields.

Invariants: every field a policy reads has exactly one JSON type here, strictly, because vLLM's
pydantic models are lax (``"n": "8"`` is 8, ``"stream": 1`` true) and a check of one spelling while
vLLM reads another would be a hole: another spelling is a 400 naming the field (``gate.py``). Other
fields are kept unchecked (``extra="allow"``; ``user_fields.py`` decides for user keys); what goes
upstream is :func:`fields` of the typed body, never the client's dict. :meth:`Body.sequences` is ``n``
x the prompts; :meth:`Body.inputs` counts each entry vLLM makes an engine request of
(``entrypoints/pooling/base/serving.py``; OpenAI's embeddings API takes at most 2,048).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from typing_extensions import TypedDict

from ..ollama.types import MAX_STOPS

#: A list of stop strings, stop token ids or bad words: at most :data:`~vllama_proxy.api.ollama.types.MAX_STOPS` entries.
StopStrings = Annotated[list[StrictStr], Field(max_length=MAX_STOPS)]
StopIds = Annotated[list[StrictInt], Field(max_length=MAX_STOPS)]
#: A completion's ``prompt``: text, texts, token ids, or lists of token ids (each list one prompt).
Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class StreamOptions(TypedDict, total=False):
    """``stream_options`` (vLLM's ``StreamOptions``): whether a stream carries its usage."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]

    include_usage: StrictBool | None
    continuous_usage_stats: StrictBool | None


class Thinking(TypedDict, total=False):
    """Anthropic's ``thinking`` (``{"type": "enabled", "budget_tokens": N}``)."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]

    type: StrictStr
    budget_tokens: StrictInt | None


class Body(BaseModel):
    """Fields every relayed JSON body may carry that vllama reads."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr | None = None
    priority: StrictInt | None = None
    cache_salt: StrictStr | None = None

    #: The fields that bound the answer's length (``translate.to_openai.OUTPUT_TOKEN_FIELDS``).
    OUTPUT_FIELDS: ClassVar[tuple[str, ...]] = ()

    def sequences(self) -> int:
        """How many sequences vLLM runs for it at once (``n`` x prompts; 1 for most)."""
        return 1

    def inputs(self) -> int:
        """How many inputs a pooling request asks vLLM to encode (0: not a pooling request)."""
        return 0

    def output_asked(self) -> int | None:
        """The most output tokens it asks for (``None``: none given)."""
        asked = [v for f in self.OUTPUT_FIELDS if isinstance(v := getattr(self, f, None), int)]
        return max(asked) if asked else None


class _Generation(Body):
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    stream_interval: StrictInt | None = None
    n: StrictInt | None = None
    use_beam_search: StrictBool | None = None
    max_tokens: StrictInt | None = None
    min_tokens: StrictInt | None = None
    stop: StrictStr | StopStrings | None = None
    stop_token_ids: StopIds | None = None
    bad_words: StopStrings | None = None
    top_logprobs: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    ignore_eos: StrictBool | None = None

    def sequences(self) -> int:
        return max(self.n or 1, 1) * max(self._prompts(), 1)

    def _prompts(self) -> int:
        return 1


class ChatCompletions(_Generation):
    """``POST /v1/chat/completions`` (vLLM ``ChatCompletionRequest``)."""

    messages: list[Any] | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None

    OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens")


class Completions(_Generation):
    """``POST /v1/completions`` (vLLM ``CompletionRequest``)."""

    prompt: Prompt | None = None
    prompt_embeds: StrictStr | list[StrictStr] | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None

    OUTPUT_FIELDS = ("max_tokens",)

    def _prompts(self) -> int:
        return _count(self.prompt) + _count(self.prompt_embeds)


def _count(value: Any) -> int:
    """The prompts of a ``prompt`` or ``prompt_embeds``: a string or a list of token ids is one; a list of
    them is each; absent or empty is none."""
    if isinstance(value, list):
        return len(value) if value and not isinstance(value[0], int) else 1 if value else 0
    return 1 if value else 0


class Embeddings(Body):
    """``POST /v1/embeddings`` (vLLM ``EmbeddingCompletionRequest``/``EmbeddingChatRequest``)."""

    input: Any = None
    messages: Any = None
    dimensions: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None

    def inputs(self) -> int:
        return max(_batch(self.input), _batch(self.messages))


def _batch(value: Any) -> int:
    """``/v1/embeddings``' ``input`` or ``messages``: one input is itself a list (token ids, a
    conversation's messages), so a list is a batch only when its entries are strings or lists."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return len(value)
    return 1


class Rerank(Body):
    """``POST /v1/rerank`` (vLLM ``RerankRequest``): the query scored against each document."""

    query: Any = None
    documents: Any = None
    top_n: StrictInt | None = None

    def inputs(self) -> int:
        return _listed(self.documents)


#: A score request's fields of inputs, whichever pair of them vLLM's union of request models takes.
SCORE_FIELDS = ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")


class Score(Body):
    """``POST /v1/score`` (vLLM's ``Score*Request`` models): 1:1, 1:N or N:N pairs, one sequence each."""

    def inputs(self) -> int:
        extra = self.__pydantic_extra__ or {}
        return max(_listed(extra.get(f)) for f in SCORE_FIELDS)


def _listed(value: Any) -> int:
    return len(value) if isinstance(value, list) else 1


class Responses(Body):
    """``POST /v1/responses`` (vLLM ``ResponsesRequest``; Codex's)."""

    input: Any = None
    stream: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    stop: StrictStr | StopStrings | None = None
    stop_token_ids: StopIds | None = None
    top_logprobs: StrictInt | None = None
    background: StrictBool | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None

    OUTPUT_FIELDS = ("max_output_tokens",)


class Messages(Body):
    """``POST /v1/messages`` (vLLM ``AnthropicMessagesRequest``; Claude Code's)."""

    messages: list[Any] | None = None
    system: Any = None
    stream: StrictBool | None = None
    max_tokens: StrictInt | None = None
    stop_sequences: StopStrings | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None

    OUTPUT_FIELDS = ("max_tokens",)


class CountTokens(Body):
    """``POST /v1/messages/count_tokens`` (vLLM ``AnthropicCountTokensRequest``): nothing generated."""

    messages: list[Any] | None = None
    system: Any = None


#: The typed body of each relayed route that has one.
BODIES: dict[str, type[Body]] = {
    "/v1/chat/completions": ChatCompletions,
    "/v1/completions": Completions,
    "/v1/embeddings": Embeddings,
    "/v1/rerank": Rerank,
    "/v1/score": Score,
    "/v1/responses": Responses,
    "/v1/messages": Messages,
    "/v1/messages/count_tokens": CountTokens,
}


def fields(body: Body) -> dict[str, Any]:
    """What of ``body`` goes upstream: the fields sent, with their checked values (a field the client
    set to ``null`` stays ``null``), and the fields vllama does not read, as sent. A new dict."""
    out = dict(body.__pydantic_extra__ or {})
    known = type(body).model_fields
    for name in body.model_fields_set:  # (extras are in the set too, and may have been dropped by the allow-list)
        if name in known:
            out[name] = getattr(body, name)
    return out
