"""Each API key's own share of vLLM's prefix cache: vLLM's ``cache_salt``, set per key (``--cache-isolation``).

A tenant timing its TTFT learns whether a prefix is cached, i.e. whether someone else sent it; vLLM's
``cache_salt`` enters the hash of a prompt's first block (vLLM docs "Automatic Prefix Caching",
"Security"; ``vllm/v1/core/kv_cache_utils.py``). With ``key`` (the default) every request of a key
carries its key's salt: :func:`of_key` (BLAKE2b-256 of the name keyed with the secret's SHA-256,
computed once per key in ``KeyRing.load``), :func:`salted` (a client's own salt combined with it, first
checked as vLLM 0.30+ ``validate_cache_salt`` does), :func:`own_media` (media ``uuid``s, vLLM's
multimodal cache keys, hashed with it). Invariant: a client may split its own cache further but can
neither pick another key's salt nor opt out. ``off`` and a server without keys send none. Salted: the
chat, completions, responses, messages and pooling routes (vLLM 0.32). Why: ``docs/decisions.md``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from vllama_proxy.errors import BadRequest

#: vLLM's bound on a salt's length and the characters it refuses (``vllm/entrypoints/generate/base/protocol.py``).
MAX_LENGTH = 128
FORBIDDEN = frozenset("@/\\\x00")


def of_key(name: str, digest: str) -> str:
    """The prefix-cache salt of the key called ``name`` whose secret has the SHA-256 ``digest`` (64 hex
    characters): 64 hex characters (BLAKE2b-256 keyed with the digest, personalisation ``vllama-salt``)."""
    return hashlib.blake2b(name.encode(), key=bytes.fromhex(digest), digest_size=32, person=b"vllama-salt").hexdigest()


def salted(body: dict[str, Any], salt: str | None) -> dict[str, Any]:
    """``body`` (vLLM's request body) with the ``cache_salt`` of a key whose salt is ``salt``, in place:
    ``salt`` itself, or, when the client sent its own, the two combined (64 hex characters). ``salt`` is
    ``None`` (isolation off, or no key): ``body`` is left as it is. Returns ``body``.

    Raises:
        BadRequest: the client's ``cache_salt`` is one vLLM refuses (not a non-empty string of at most
            128 characters without ``@``, ``/``, ``\\`` or NUL).
    """
    if salt is None:
        return body
    own = body.get("cache_salt")
    if own is None:
        body["cache_salt"] = salt
        return body
    if not isinstance(own, str) or not own or len(own) > MAX_LENGTH or not FORBIDDEN.isdisjoint(own):
        raise BadRequest(f"invalid cache_salt: a non-empty string of at most {MAX_LENGTH} characters without "
                         "'@', '/', '\\' or NUL")
    body["cache_salt"] = hashlib.blake2b(own.encode("utf-8", "surrogatepass"), key=bytes.fromhex(salt), digest_size=32,
                                         person=b"vllama-own-salt").hexdigest()
    return body


#: The fields of vLLM's request bodies whose content parts may carry a media ``uuid``: chat messages
#: (``/v1/chat/completions``, ``/v1/embeddings``' chat input), the pooling routes' inputs (score and
#: rerank content parts), the agents' (``/v1/messages``' ``system``, ``/v1/responses``' ``input``).
_MEDIA_FIELDS = ("messages", "input", "system", "query", "documents", "queries", "items", "data_1", "data_2",
                 "text_1", "text_2")


def own_caches(body: dict[str, Any], salt: str | None) -> None:
    """``body`` (a relayed ``/v1`` or agents' body, as the client wrote it) given its key's own share of
    the prefix cache (:func:`salted`) and of the media caches (:func:`own_media`), in place.

    Raises:
        BadRequest: as :func:`salted`."""
    salted(body, salt)
    own_media(body, salt)


def own_media(body: dict[str, Any], salt: str | None) -> None:
    """Each media ``uuid`` of ``body`` (vLLM's request body) made the key's own, in place: every string
    ``uuid`` of a content part under :data:`_MEDIA_FIELDS` (a part of a list, or of a ``content`` list
    within one, as deep as they nest: a tool result's images) becomes 64 hex characters, BLAKE2b of it
    keyed with ``salt`` (personalisation ``vllama-media``). ``salt`` ``None``: left as sent.

    Per request, never per token: two dictionary looks a message or part, none into text or anything
    beside ``content`` (its cost: ``docs/decisions.md``).
    """
    if salt is None:
        return
    key = bytes.fromhex(salt)
    for field in _MEDIA_FIELDS:
        value = body.get(field)
        if isinstance(value, (dict, list)):
            _own_uuids(value, key)


def _own_uuids(value: dict[str, Any] | list[Any], key: bytes) -> None:
    if isinstance(value, list):  # (a score's or rerank's list may mix texts and parts: each item is looked at)
        for item in value:
            if type(item) is dict or type(item) is list:  # (orjson's own types; isinstance costs more on a batch of 2,048 texts)
                _own_uuids(item, key)
        return
    uuid = value.get("uuid")
    if isinstance(uuid, str):
        value["uuid"] = hashlib.blake2b(uuid.encode("utf-8", "surrogatepass"), key=key, digest_size=32,
                                        person=b"vllama-media").hexdigest()
    content = value.get("content")
    if isinstance(content, list):
        _own_uuids(content, key)
