"""No tenant can harm another: one embeddings, rerank or score request with a huge list of inputs.

Each input is a sequence of vLLM's scheduler (one engine request per input), while the admission bound
and a key's share count the request once: a user key's request over ``--max-inputs`` (2,048, OpenAI's
own bound) is a 400 before anything reaches vLLM, and the fair queue charges each input
(``api/inputs.py``). An Ollama client's embeddings are charged their prompt tokens, as a relayed
``/v1/embeddings`` is.

``vllama serve`` with the stand-in vLLM as its ``vllm``, a pooling model (``--runner pooling``), keys
of both roles; driven by the real ``ollama`` and ``openai`` clients where they have the route.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import ollama
import openai
import pytest

from conftest import place

KEYS = """
[[keys]]
name = "root"
key = "sk-root"
role = "admin"

[[keys]]
name = "bob"
key = "sk-bob"
role = "user"

[[keys]]
name = "batch"
key = "sk-batch"
priority = -1
"""


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _fake_url(s, i: int = 0) -> str:
    argv = s.launched()[i]
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def _sent(s, path: str, i: int = 0) -> list:
    """What the stand-in vLLM number ``i`` received on ``path``."""
    return [r for r in httpx.get(_fake_url(s, i) + "/_fake/requests").json() if r["path"] == path]


def _wait(cond, what, timeout: float = 30) -> None:
    """Until ``cond()``; ``what`` (or what it returns, when a function) says what did not happen."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.02)


@pytest.fixture
def emb(serve, hub, tmp_path):
    """The operator serves acme/tiny-emb as ``emb``, a pooling model, behind the keys file."""
    place(hub, "acme/tiny-emb")
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    s = serve("--model", "acme/tiny-emb", "--served-model-name", "emb", "--api-key-file", str(keys),
              "--", "--runner", "pooling")
    s.wait_ready()
    httpx.delete(_fake_url(s) + "/_fake/requests")
    return s


def _refused(text: str, count: int) -> bool:
    return f"{count} inputs" in text and "at most 2048" in text and "--max-inputs" in text


def test_a_user_keys_embed_sends_at_most_max_inputs_and_the_clients_see_why(emb):
    """The real clients: ``openai``'s ``embeddings.create`` gets the 400 naming the bound and the count; at the
    bound the request goes; nothing over it reaches vLLM. ``ollama``'s ``embed`` (vllama builds that vLLM request)
    gets every vector, its list sent in parts of at most the bound, one after another."""
    s = emb
    bob = ollama.Client(host=s.url, headers=_auth("sk-bob"), timeout=60)
    texts = [f"text {i}" for i in range(4100)]
    got = bob.embed(model="emb", input=texts)
    assert len(got.embeddings) == 4100 and got.prompt_eval_count > 0
    alone = bob.embed(model="emb", input=texts[2049:2050]).embeddings[0]  # the parts keep the list's order
    assert got.embeddings[2049] == alone
    assert [len(r["body"]["input"]) for r in _sent(s, "/v1/embeddings")] == [2048, 2048, 4, 1]
    assert len(bob.embed(model="emb", input=["x"] * 2048).embeddings) == 2048
    httpx.delete(_fake_url(s) + "/_fake/requests")

    oai = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-bob", max_retries=0)
    with pytest.raises(openai.BadRequestError) as b:
        oai.embeddings.create(model="emb", input=["x"] * 2049)
    assert b.value.status_code == 400 and _refused(str(b.value.body), 2049), b.value.body
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model="emb", input=[[1, 2]] * 2049)  # lists of token ids: one input each
    assert len(oai.embeddings.create(model="emb", input=["x"] * 2048).data) == 2048
    assert len(oai.embeddings.create(model="emb", input=[7] * 3000).data) == 1  # token ids: one input

    sent = [len(r["body"]["input"]) for r in _sent(s, "/v1/embeddings")]
    assert sent == [2048, 3000], sent  # the refused ones never reached vLLM
    # an admin (the operator's own batch jobs, an open server's every caller) is not bounded
    root = ollama.Client(host=s.url, headers=_auth("sk-root"), timeout=60)
    assert len(root.embed(model="emb", input=["x"] * 2049).embeddings) == 2049


def test_every_route_with_a_list_of_inputs_is_bounded_for_a_user_key(emb):
    """``/v1/embeddings``' batched conversations, ``/v1/rerank``'s documents, ``/v1/score``'s pairs in each
    of vLLM 0.32's field names: over the bound a 400 in OpenAI's error shape, as every refusal on ``/v1``,
    before vLLM; at the bound relayed and answered."""
    s = emb
    many, over = ["d"] * 2048, ["d"] * 2049
    chat = [{"role": "user", "content": "x"}]
    cases = [
        ("/v1/embeddings", {"messages": [chat] * 2049}, {"messages": [chat] * 2048}),
        ("/v1/embeddings", {"input": [chat] * 2049}, {"input": [[1, 2]] * 2048}),
        ("/v1/rerank", {"query": "q", "documents": over}, {"query": "q", "documents": many}),
        ("/v1/score", {"text_1": "q", "text_2": over}, {"text_1": "q", "text_2": many}),
        ("/v1/score", {"queries": over, "documents": over}, {"queries": many, "documents": many}),
        ("/v1/score", {"queries": "q", "items": over}, {"queries": "q", "items": many}),
        ("/v1/score", {"data_1": "q", "data_2": over}, {"data_1": "q", "data_2": many}),
    ]
    for path, refused, taken in cases:
        r = httpx.post(s.url + path, json={"model": "emb", **refused}, headers=_auth("sk-bob"), timeout=60)
        assert r.status_code == 400 and _refused(r.json()["error"]["message"], 2049), (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
        assert not _sent(s, path), path
        r = httpx.post(s.url + path, json={"model": "emb", **taken}, headers=_auth("sk-bob"), timeout=60)
        assert len(_sent(s, path)) == 1, (path, r.text)
        if "messages" not in taken:  # the stand-in takes no batch of conversations (vLLM 0.32 does)
            assert r.status_code == 200, (path, r.text)
        httpx.delete(_fake_url(s) + "/_fake/requests")


def test_an_ollama_clients_embeddings_are_charged_their_prompt_tokens(emb):
    """``/api/embed`` and ``/api/embeddings`` set no usage: the key's budget, tpm, fair share and ledger
    counted none of their tokens (a relayed ``/v1/embeddings`` was charged vLLM's ``prompt_tokens``)."""
    s = emb
    bob = ollama.Client(host=s.url, headers=_auth("sk-bob"), timeout=60)
    assert bob.embed(model="emb", input=["one two three", "four five"]).prompt_eval_count == 5
    bob.embeddings(model="emb", prompt="six seven")

    def row() -> dict:
        usage = httpx.get(s.url + "/api/usage", headers=_auth("sk-bob")).json()["usage"]
        return usage[0] if usage else {}

    _wait(lambda: row().get("requests") == 2, f"the two requests' row: {row()}")
    assert row()["prompt_tokens"] == 7, row()  # 5 + 2 words: the stand-in's tokens


def test_an_ollama_clients_embeddings_go_to_vllm_with_their_keys_priority(emb):
    """With fair sharing vllama sets each request's vLLM ``priority`` (a key's later requests and a
    lower-priority key's after the others' in vLLM's queue); ``/api/embed`` and ``/api/embeddings`` sent
    none, so a key's embeddings of thousands of inputs were never put after another key's."""
    s = emb
    batch = ollama.Client(host=s.url, headers=_auth("sk-batch"), timeout=60)
    batch.embed(model="emb", input=["a", "b"])
    batch.embeddings(model="emb", prompt="c")
    assert [r["body"].get("priority") for r in _sent(s, "/v1/embeddings")] == [1_000_000, 1_000_000]


FAIR_KEYS = KEYS + """
[[keys]]
name = "hold"
key = "sk-hold"

[[keys]]
name = "scrape"
key = "sk-scrape"
role = "metrics"

[[keys]]
name = "many"
key = "sk-many"

[[keys]]
name = "one"
key = "sk-one"
"""


def test_the_fair_share_charges_each_input(serve, hub, tmp_path):
    """One running slot (``--max-running 1``), a generation model holding it and a pooling model beside it.
    Key ``many`` queues 10 embeddings of 50 inputs first, key ``one`` 10 of one input after; once the
    holder leaves, the fair queue dispatches them. Counted once each, both keys cost the same (nothing: an
    embedding has no output tokens) and ``many``, backlogged first, went first with all ten; each input
    charged, ``one``'s ten go after ``many``'s first, before its second."""
    for repo in ("acme/tiny-prod", "acme/tiny-emb"):
        place(hub, repo)
    keys = tmp_path / "keys.toml"
    keys.write_text(FAIR_KEYS)
    config = ('[[models]]\nmodel = "acme/tiny-prod"\nname = "prod"\ngpu_memory_utilization = 0.3\n\n'
              '[[models]]\nmodel = "acme/tiny-emb"\nname = "emb"\ngpu_memory_utilization = 0.3\n'
              'vllm_args = ["--runner", "pooling"]\n')
    s = serve("--api-key-file", str(keys), "--max-running", "1", "--max-queue", "64", "--workers", "1",
              "--fair-share", "on", config=config, env={"FAKE_VLLM_TOKEN_DELAY": "0.02"})
    s.wait_ready(timeout=60)
    emb = 1 if "pooling" in s.launched()[1] else 0

    def in_flight() -> float:
        text = httpx.get(s.url + "/metrics", headers=_auth("sk-scrape")).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllama_requests_in_flight"))

    arrived = threading.Event()

    def hold() -> int:
        body = {"model": "prod", "prompt": "hold [[tokens:4000]]", "options": {"num_predict": 4000}}
        with httpx.stream("POST", s.url + "/api/generate", json=body, headers=_auth("sk-hold"), timeout=120) as r:
            for _ in r.iter_lines():
                if arrived.is_set():
                    break
            return r.status_code

    def embed(key: str, first: str, inputs: int) -> int:
        body = {"model": "emb", "input": [first] + ["x"] * (inputs - 1)}
        return httpx.post(s.url + "/v1/embeddings", json=body, headers=_auth(key), timeout=120).status_code

    with cf.ThreadPoolExecutor(24) as ex:
        held = ex.submit(hold)
        _wait(lambda: in_flight() == 1, "the holding request did not start")
        futures = [ex.submit(embed, "sk-many", "many", 50) for _ in range(10)]
        _wait(lambda: in_flight() == 11, lambda: f"key many's requests did not all arrive: {in_flight()} in flight", timeout=60)
        futures += [ex.submit(embed, "sk-one", "one", 1) for _ in range(10)]
        _wait(lambda: in_flight() == 21, "key one's requests did not all arrive", timeout=60)
        arrived.set()
        assert held.result() == 200
        assert all(f.result() == 200 for f in futures)
    order = [r["body"]["input"][0] for r in _sent(s, "/v1/embeddings", emb)]
    assert len(order) == 20 and order[0] == "many", order
    assert order[1:11] == ["one"] * 10, order
