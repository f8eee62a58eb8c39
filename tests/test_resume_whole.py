"""A non-streamed ``/v1`` answer whose vLLM dies is asked again whole (``api/routes/openai.py`` ``_answered_whole``).

``vllama serve`` over the stand-in vLLM (20 ms a token); a non-streamed ``/v1/chat/completions`` and
``/v1/completions`` of the real ``openai`` client are in vLLM's hands when it is SIGKILLed: nothing had reached
their clients, so each is asked again of the restarted vLLM and answered whole, equal to an uninterrupted run,
and charged once. On the code before, each got a 5xx. A vLLM that still serves and fails a request itself gives
that error at once (Ollama's routes too); a client that leaves while its request waits for the restart is charged nothing. (Streams, and the real vLLM: ``test_resume.py``,
``real_engine/test_real_resume.py``.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import openai
import pytest

from conftest import SERVED, log_events, metric, start_fake, start_proxy, stop

N = 200  # tokens each request asks for (of the 500 its prompt makes the stand-in write): 4 s


def _charged(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    return metric(text, "vllama_key_prompt_tokens_total"), metric(text, "vllama_key_output_tokens_total")


def _vllm(v, name: str) -> float:
    return metric(httpx.get(v.url + "/vllm/metrics").text, name)


def _until(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _events(v, event: str, **match) -> list[dict]:
    return [e for e in log_events(v.log) if e.get("event") == event and all(e.get(k) == x for k, x in match.items())]


def test_a_non_streamed_answer_broken_by_its_engine_is_asked_again_whole(vllama, tmp_path):
    """Also: a vLLM that still serves and fails a request itself (its 500) gives that error at once, and a client that
    leaves while its request waits for the restarted vLLM is charged nothing (no vLLM had it)."""
    gate = tmp_path / "gate"  # the stand-in's starts finish while it exists (FAKE_VLLM_START_GATE)
    gate.touch()
    # --restart-reset-after 0: each of its three kills is a crash of a vLLM that was ready, not a crash loop
    v = vllama(env={"FAKE_VLLM_TOKEN_DELAY": "0.02", "FAKE_VLLM_START_GATE": str(gate)}, flags=["--restart-reset-after", "0"])
    v.wait_state("ready")
    client = openai.OpenAI(base_url=v.url + "/v1", api_key="none", max_retries=0, timeout=120)

    with pytest.raises(openai.InternalServerError):  # vLLM's own 500, its engine alive: not asked again
        client.completions.create(model="tiny", prompt="x [[fault:http500]]", max_tokens=5)
    with pytest.raises(openai.InternalServerError):  # nor a stream's, before its answer began
        client.completions.create(model="tiny", prompt="x [[fault:http500]]", max_tokens=5, stream=True)
    ollama_client = ollama.Client(host=v.url, timeout=120)  # and Ollama's routes, streamed or not (request/relay.py)
    for ask in (lambda **kw: ollama_client.generate(model="tiny", prompt="x [[fault:http500]]", **kw),
                lambda **kw: ollama_client.chat(model="tiny", messages=[{"role": "user", "content": "x [[fault:http500]]"}], **kw)):
        with pytest.raises(ollama.ResponseError) as e:
            ask()
        assert e.value.status_code >= 500, e.value
        with pytest.raises(ollama.ResponseError):
            list(ask(stream=True))
    refused = _events(v, "resume_refused")
    assert len(refused) == 6 and all("still serves" in r["why"] for r in refused) and not _events(v, "stream_broken"), refused

    asks = {
        "chat": lambda: client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a whole chat [[tokens:500]]"}], max_tokens=N, temperature=0),
        "completions": lambda: client.completions.create(model="tiny", prompt="a whole completion [[tokens:500]]", max_tokens=N,
                                                         temperature=0),
    }
    reference = {k: ask() for k, ask in asks.items()}
    prompt = sum(r.usage.prompt_tokens for r in reference.values())
    assert all(r.usage.completion_tokens == N for r in reference.values())
    _until(lambda: _charged(v.url) == (prompt, 2 * N), "the settler's charge follows the answer")

    start = _vllm(v, "vllm:generation_tokens_total")
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(ask) for k, ask in asks.items()}
        # both in vLLM's hands, N / 2 made of the two together: each has N / 2 or more to go (2 s and more)
        _until(lambda: _vllm(v, "vllm:num_requests_running") == 2
               and _vllm(v, "vllm:generation_tokens_total") >= start + N / 2, "both requests running")
        assert not any(f.done() for f in futures.values())
        os.kill(v.server_pid(), signal.SIGKILL)
        got = {k: f.result() for k, f in futures.items()}
    assert v.ready()["restarts"] == 1
    for k, ref in reference.items():
        text = got[k].choices[0].message.content if k == "chat" else got[k].choices[0].text
        want = ref.choices[0].message.content if k == "chat" else ref.choices[0].text
        assert text == want and got[k].usage == ref.usage and got[k].choices[0].finish_reason == "length", (k, got[k])
    _until(lambda: _charged(v.url) >= (2 * prompt, 4 * N), "the charge of the answers asked again")
    assert _charged(v.url) == (2 * prompt, 4 * N)  # each prompt and output token once: the broken work is vllama's
    text = httpx.get(v.url + "/metrics").text
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert metric(text, "vllama_resumed_streams_total", route=route) == 1, route

    # a client that leaves while its request waits for the restarted vLLM (held loading by the gate): charged nothing
    gate.unlink()
    before, broken, answered = _charged(v.url), len(_events(v, "stream_broken")), len(_events(v, "request", path="/v1/completions"))

    async def leave(prompt: str, left) -> None:
        """A non-streamed completion whose vLLM is SIGKILLed 10 tokens in; its client leaves once ``left()``."""
        async with httpx.AsyncClient(timeout=120) as h:
            asked = asyncio.create_task(h.post(v.url + "/v1/completions", json={
                "model": "tiny", "prompt": f"{prompt} [[tokens:500]]", "max_tokens": N}))
            start = _vllm(v, "vllm:generation_tokens_total")
            while _vllm(v, "vllm:generation_tokens_total") < start + 10:
                assert not asked.done()
                await asyncio.sleep(0.02)
            os.kill(v.server_pid(), signal.SIGKILL)
            while not left():
                assert not asked.done()
                await asyncio.sleep(0.02)
            asked.cancel()

    asyncio.run(leave("a client that leaves", lambda: len(_events(v, "stream_broken")) > broken))  # waiting for the restart
    _until(lambda: len(_events(v, "request", path="/v1/completions")) > answered, "the access line of the request its client left")
    assert _charged(v.url) == before
    gate.touch()

    # but one that leaves once the restarted vLLM has its request again is charged as any request vLLM had whose
    # client left before the answer: its prompt and the output it asked for (routes/openai.py _charge_left)
    restarts = v.wait_state("ready", timeout=60)["restarts"]
    before, answered = _charged(v.url), len(_events(v, "request", path="/v1/completions"))

    def running() -> float:
        try:
            return _vllm(v, "vllm:num_requests_running")
        except (httpx.HTTPError, AssertionError):
            return -1.0  # the killed vLLM, not yet restarted

    asyncio.run(leave("a client that leaves later",  # once the restarted vLLM has it again
                      lambda: v.ready()["restarts"] > restarts and running() == 1))
    _until(lambda: len(_events(v, "request", path="/v1/completions")) > answered, "the access line of the request its client left")
    prompt_after, output_after = _charged(v.url)
    assert prompt_after > before[0] and output_after - before[1] == N, (before, _charged(v.url))


def test_an_upstream_vllm_restarted_by_another_answers_the_request_again(model_dir, tmp_path):
    """``--upstream``: a vLLM that vllama does not run (restarted by its own supervisor: here the test, on the same
    port) dies under a non-streamed request: the request waits for it (``Resume.reopen``'s growing pauses) and is
    answered whole by the new one. A vLLM that was down before the request was sent is today's 503 at once. A request
    that breaks the vLLM started since too is not asked a third time, though vllama cannot see that vLLM's restarts:
    its error at once; nor is one that a vLLM which serves again (its ``/health``) fails itself."""
    env = {"FAKE_VLLM_TOKEN_DELAY": "0.02"}
    fake = start_fake(model_dir, env=env)
    log = tmp_path / "proxy.log"
    proxy = start_proxy(fake.url, "--resume-timeout", "30", vllm_args=[], log=log)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, model=SERVED, prompt="whole [[tokens:500]]", max_tokens=N,
                                 temperature=0)
            while metric(httpx.get(fake.url + "/metrics").text, "vllm:generation_tokens_total") < N / 2:
                assert not answer.done(), answer.result()
                time.sleep(0.02)
            fake.proc.kill()
            fake.proc.wait()
            fake = start_fake(model_dir, env=env, port=fake.port)
            got = answer.result()
        assert got.usage.completion_tokens == N and got.choices[0].text == "".join(f"tok{i} " for i in range(N))
        fake.proc.kill()
        fake.proc.wait()
        with pytest.raises(openai.APIStatusError) as refused:  # refused at connect: not held
            client.completions.create(model=SERVED, prompt="x", max_tokens=1)
        assert refused.value.status_code == 503

        fake = start_fake(model_dir, env=env, port=fake.port)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, model=SERVED, prompt="again [[tokens:500]]", max_tokens=N)
            start = metric(httpx.get(fake.url + "/metrics").text, "vllm:generation_tokens_total")
            while metric(httpx.get(fake.url + "/metrics").text, "vllm:generation_tokens_total") < start + 10:
                assert not answer.done(), answer.result()
                time.sleep(0.02)
            fake.proc.kill()
            fake.proc.wait()
            fake = start_fake(model_dir, env={**env, "FAKE_VLLM_CRASH_AFTER": "1"}, port=fake.port)  # dies under it too
            with pytest.raises(openai.APIStatusError) as broke:
                answer.result()
        assert broke.value.status_code >= 500
        events = [e.get("event") for e in log_events(log)]
        assert "resume_gave_up" not in events and any(
            e.get("event") == "resume_refused" and "broke again" in e.get("why", "") for e in log_events(log)), events

        # a vLLM whose /health failed when the request broke (busy, or restarting) and then fails it itself (its
        # 500) while its /health answers: that 500 is the client's, once /health says so, not waited out
        sick = tmp_path / "unhealthy"
        fake.proc.wait()
        fake = start_fake(model_dir, env={**env, "FAKE_VLLM_UNHEALTHY_FILE": str(sick)}, port=fake.port)
        sick.touch()
        seen = len(log_events(log))
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, model=SERVED, prompt="own [[fault:http500]]", max_tokens=5)
            while not any(e.get("event") == "stream_broken" for e in log_events(log)[seen:]):
                assert not answer.done(), answer.result()
                time.sleep(0.02)
            sick.unlink()
            with pytest.raises(openai.InternalServerError):
                answer.result()
        events = log_events(log)[seen:]
        assert "resume_gave_up" not in [e.get("event") for e in events] and any(
            e.get("event") == "resume_refused" and "refused the continuation" in e.get("why", "") for e in events), events
    finally:
        stop(proxy.proc)
        stop(fake.proc)
