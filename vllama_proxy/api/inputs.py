"""How many inputs one embeddings, rerank or score request asks vLLM to encode (``--max-inputs``).

vLLM's pooling routes take lists, and its serving makes one engine request of each entry (vLLM 0.32
``entrypoints/pooling/base/serving.py`` ``_prepare_generators``: one ``engine_client.encode`` per
input): each is a sequence of vLLM's scheduler, as each of a completion's prompts is, while vllama's
admission bound, a key's ``max_in_flight`` and its fair share counted the request once, bounded only
by ``--max-body-size`` (thousands of inputs in one request). So admission (``admission.py``) asks
:func:`count` how many, refuses a user key's request over ``--max-inputs`` (:func:`check`) and charges
the fair queue one running slot for a step per input.

What counts, per route (vLLM 0.32's request models, ``entrypoints/pooling/*/protocol.py``; Ollama's
``EmbedRequest``):

- ``/api/embed``: ``input``, a string (one) or a list of them (each one);
- ``/v1/embeddings``: ``input``, a string, a list of token ids or a chat conversation (one), a list of
  strings, of token-id lists or of conversations (each one); ``messages`` the same
  (``EmbeddingChatRequest``, ``EmbeddingBatchChatRequest``);
- ``/v1/rerank``: ``documents`` (the query is scored against each);
- ``/v1/score``: the longer list of its pair (``text_1``/``text_2``, ``data_1``/``data_2``, ``queries``
  with ``documents`` or ``items``): vLLM scores 1:1, 1:N or N:N (``scoring/utils.py``), one pair a
  sequence.

Ollama bounds none of them (its ``/api/embed`` takes any list); OpenAI's embeddings API takes at most
2,048 inputs a request ("any array must be 2048 dimensions or less"), ``--max-inputs``'s default. A user
key's ``/api/embed`` list is not refused but sent in parts of that many (:data:`SPLIT`).
"""

from __future__ import annotations

from typing import Any

import orjson

from vllama_proxy.errors import TooManyInputs

#: The routes whose requests carry lists of inputs (POST). ``/api/embeddings`` takes one prompt.
ROUTES = frozenset({"/api/embed", "/v1/embeddings", "/v1/rerank", "/v1/score"})
#: Of those, the routes whose vLLM requests vllama builds itself: a longer list is sent in parts of at most
#: ``--max-inputs``, one after another (``routes/embed.py``), not refused: Ollama takes any number, and its
#: clients send a whole document set at once (langchain-ollama's ``embed_documents``).
SPLIT = frozenset({"/api/embed"})
#: A score request's fields of inputs, whichever pair of them vLLM's union of request models takes.
_SCORE_FIELDS = ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")


def count(path: str, body: bytes) -> int:
    """The inputs of a request to ``path`` (one of :data:`ROUTES`) whose JSON body is ``body``: 1 for a
    body that is not a JSON object (its route answers that in its own words)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 1
    if not isinstance(data, dict):
        return 1
    if path == "/api/embed":
        return _listed(data.get("input"))
    if path == "/v1/embeddings":
        return max(_batch(data.get("input")), _batch(data.get("messages")))
    if path == "/v1/rerank":
        return _listed(data.get("documents"))
    return max(_listed(data.get(field)) for field in _SCORE_FIELDS)


def check(inputs: int, most: int) -> None:
    """Refuse a request of ``inputs`` over ``most`` (``--max-inputs``), for a non-admin key.

    Raises:
        TooManyInputs: naming the count and the bound."""
    if inputs > most:
        raise TooManyInputs(f"this request asks vLLM to encode {inputs} inputs at once; a key of role user may send at "
                            f"most {most} a request (--max-inputs): send several requests")


def _listed(value: Any) -> int:
    """A field that is one input or a list of them."""
    return len(value) if isinstance(value, list) else 1


def _batch(value: Any) -> int:
    """``/v1/embeddings``' ``input`` or ``messages``: one input is itself a list (token ids, a
    conversation's messages), so a list is a batch only when its entries are strings or lists."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return len(value)
    return 1
