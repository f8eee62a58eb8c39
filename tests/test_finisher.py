"""The finisher (``api/request/finisher.py``) completes a body in one pass, the answer's length last
(``api/request/output_tokens.py``): unit tests with a stand-in for vLLM's ``/tokenize``."""

from __future__ import annotations

import asyncio

from vllama_proxy.api.policy.keys import Key
from vllama_proxy.api.request.call import Call
from vllama_proxy.api.request.finisher import finish
from vllama_proxy.models.vllm_servers import ServedModel


class _Tokenize:
    """vLLM's ``/tokenize`` as the finisher asks it: the prompt's tokens and the context, every ask kept."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.asked: list[tuple[str, dict]] = []

    async def post_json(self, path: str, body: dict) -> dict:
        self.asked.append((path, body))
        return {"count": self.count, "max_model_len": 4096}


def test_a_raw_completion_without_max_tokens_asks_until_the_context_is_full_then_the_key_caps_it():
    """An Ollama /v1/completions body without max_tokens (vLLM would stop at 16 tokens) gets the room the
    context leaves, in the same pass that caps it by the key's max_tokens: the finisher owns the answer's length."""
    model = ServedModel("m", "/models/m", 4096, 0)
    upstream = _Tokenize(96)
    body = asyncio.run(finish(Call(), {"prompt": "hi", "stream": True}, "/v1/completions", served="m", model=model,
                              upstream=upstream))  # type: ignore[arg-type]
    assert body["max_tokens"] == 4096 - 96 and body["model"] == "m"
    assert upstream.asked == [("/tokenize", {"model": "m", "prompt": "hi"})]  # one count, none for the cap
    capped = asyncio.run(finish(Call(key=Key(name="k", role="user", max_tokens=100)), {"prompt": "hi"},
                                "/v1/completions", served="m", model=model, upstream=_Tokenize(96)))  # type: ignore[arg-type]
    assert capped["max_tokens"] == 100


def test_a_relayed_completion_keeps_its_own_missing_max_tokens():
    """The room-filling default is the Ollama route's (num_predict -1); a relayed /v1/completions is the client's."""
    body = asyncio.run(finish(Call(), {"prompt": "hi"}, "/v1/completions", served="m",
                              model=ServedModel("m", "/models/m", 4096, 0), upstream=_Tokenize(96), relayed=True))  # type: ignore[arg-type]
    assert "max_tokens" not in body
