"""A hostile tenant's review of the gate (``api/request/``), admission's reservations (``api/request/admission.py``) and the
settler (``api/request/settler.py``): each test here is a hole a user key could use, found by reading the code and
confirmed against ``vllama serve --upstream`` over the stand-in vLLM with a keys file (``test_gate.py``'s setup).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import SERVED, start_proxy, stop

WIDE = "sk-review-wide"
KEYS = f"""
[[keys]]
name = "ops"
key = "sk-review-admin"
role = "admin"

[[keys]]
name = "wide"
key = "{WIDE}"
budget_tokens = 100
budget_period = "day"

[[keys]]
name = "wideminute"
key = "sk-review-wideminute"
tpm = 100

[[keys]]
name = "plain"
key = "sk-review-plain"
"""


@pytest.fixture
def proxy(fake, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    s = start_proxy(fake.url, "--api-key-file", str(keys), "--workers", "1", "--max-choices", "8",
                    env={"VLLAMA_STATE_DIR": str(tmp_path / "state")}, log=tmp_path / "vllama.log")
    yield s
    stop(s.proc)


async def _at_once(url: str, key: str, body: dict, n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as c:
        rs = await asyncio.gather(*(c.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                                    for _ in range(n)))
    return [r.status_code for r in rs]


@pytest.mark.parametrize("key", [WIDE, "sk-review-wideminute"])
def test_a_reservation_counts_every_sequence_the_request_starts(proxy, key):
    """``admission.worst_case`` reserves the prompt's estimate plus ``max_tokens`` once, whatever ``n`` (or a
    completion's prompts) multiplies it by: ``n: 8, max_tokens: 12`` reserves ~40 tokens and vLLM may generate
    96. A key with 100 tokens (a day's budget, or a minute's tpm) that sends 8 such requests at once had 3 of
    them admitted (3 x 8 x 12 = 288 output tokens against vLLM, 2.9x its budget; more with a larger n); with each reserving its 8 sequences'
    worst case (~97 tokens), at most 2 are admitted (overspent by one reservation at most, as
    ``test_gate.py``'s ``test_requests_sent_at_once_cannot_overspend_a_budget_or_a_tpm`` holds for ``n`` 1).
    The stand-in answers one choice whatever ``n``; what is checked is what admission lets through."""
    body = {"model": SERVED, "n": 8, "max_tokens": 12,
            "messages": [{"role": "user", "content": "hi [[tokens:12]] [[fault:slow]]"}]}
    statuses = asyncio.run(_at_once(proxy.url, key, body, 8))
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) <= 2, statuses


async def _leave_when_generated(proxy_url: str, fake_url: str, path: str, body: dict, tokens: int) -> None:
    """Post ``body`` without streaming and leave once the stand-in has generated ``tokens`` for it."""
    async with httpx.AsyncClient(timeout=60) as c:
        before = (await c.get(fake_url + "/_fake/stats")).json()["generation_tokens_total"]
        task = asyncio.ensure_future(c.post(proxy_url + path, json=body, headers={"Authorization": "Bearer sk-review-plain"}))
        for _ in range(600):
            if (await c.get(fake_url + "/_fake/stats")).json()["generation_tokens_total"] - before >= tokens:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the stand-in never generated the tokens")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def _rows(url: str, name: str) -> list[dict]:
    r = httpx.get(url + "/api/usage", params={"key": name}, headers={"Authorization": "Bearer sk-review-admin"}, timeout=10)
    return r.json()["usage"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_that_leaves_a_non_streamed_v1_answer_is_charged_what_vllm_ran(proxy, fake, path):
    """A ``/v1`` request without ``stream`` whose client leaves before vLLM answers was charged nothing: the
    ledger's row says 0 prompt and 0 output tokens (so the key's budget and tpm never move), though vLLM read its
    prompt and generated until the proxy aborted it. A tenant that posts long prompts and hangs up before the
    answer is served prefill and decode for free, again and again (the Ollama routes, which stream from vLLM,
    charge what was generated: 39 tokens for the same probe on ``/api/chat``)."""
    content = "hello " * 200 + "[[tokens:20]] [[fault:hangatend]]"
    body = ({"model": SERVED, "max_tokens": 20, "messages": [{"role": "user", "content": content}]} if path.endswith("chat/completions")
            else {"model": SERVED, "max_tokens": 20, "prompt": content})
    asyncio.run(_leave_when_generated(proxy.url, fake.url, path, body, 20))
    for _ in range(200):
        rows = _rows(proxy.url, "plain")
        if rows and sum(r["requests"] for r in rows) >= 1:
            break
        asyncio.run(asyncio.sleep(0.05))
    [row] = rows
    assert row["prompt_tokens"] >= 200 and row["output_tokens"] >= 1, row
