#!/usr/bin/env python3
"""Streaming load generator: the Ollama API (via vllama) vs vLLM's OpenAI API, same workload.

Two protocols, one workload (a random ~N-word text prompt, exactly ``--output-tokens``
output tokens thanks to ``ignore_eos``):

* ``ollama``: ``POST {base}/api/generate`` with ``raw: true, stream: true`` and
  ``options.num_predict / ignore_eos / temperature``; NDJSON lines, the last one
  ``done: true`` with ``eval_count``.
* ``ollama-nostream``: the same with ``stream: false``: one JSON body (``done: true``, ``eval_count``).
* ``openai``: ``POST {base}/v1/completions`` with ``max_tokens / ignore_eos / stream`` and
  ``stream_options.include_usage``; SSE ``data:`` events ending with ``data: [DONE]``.
* ``openai-nostream``: the same with ``stream: false``: one JSON body, no TTFT or ITL; what the
  engine delivers when no API server has to stream token by token.
* ``openai-vllama``: ``POST {base}/v1/completions`` with exactly the body vllama sends vLLM for
  the ``ollama`` target's request (built by ``vllama_proxy.api.ollama.to_openai.generate_body``, encoded
  by vllama's ``encode_json``): vLLM direct, minus the hop, with vllama's body.
* ``ollama-chat`` / ``openai-chat``: the same workload as one user message to ``/api/chat`` /
  ``/v1/chat/completions`` (the chat template applies; tokens are ``message.content`` /
  ``delta.content``).

Per request: ok or error (HTTP status, an ``error`` line/event, an exception, a stream
without ``done``/``[DONE]``, or a token count other than the one asked for), TTFT (first
non-empty content chunk), ITL (time between consecutive content chunks), TPOT
(``(e2e - ttft) / (output_tokens - 1)``), end-to-end latency and output tokens (from
``eval_count`` / ``usage.completion_tokens``).

Per concurrency level ``c``: ``requests`` requests, at most ``c`` in flight: ``c`` worker
coroutines pull the next request index (nothing else limits the client: one shared
``ClientSession``, ``TCPConnector(limit=0)``, no total timeout). The targets run one
after the other, alternately (``--rounds``; round r starts with target r), in this one
process, so they face the same conditions. ``--cpu-by-kind`` adds where the machine's
cores went during each run (vLLM API servers, engine core, vllama, client). Every prompt is new random words (no prefix-cache hits, also not
between targets), generated before the clock starts.

Library use (see ``cpu_bench.py``)::

    targets = [Target.parse("proxy=ollama:http://127.0.0.1:11434")]
    wl = Workload(model="m", output_tokens=128, prompt_words=128)
    prompts = PromptFactory(128, seed=0)
    async with make_session() as session:
        run = await run_level(session, targets[0], wl, prompts, concurrency=32, n_requests=64)
    print(summarize([run]))

CLI: ``python benchmarks/loadgen.py --help`` and ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import collections
import math
import os
import platform
import random
import resource
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import aiohttp
import orjson

PROTOCOLS = ("ollama", "ollama-nostream", "openai", "openai-nostream", "openai-vllama", "ollama-chat", "openai-chat")

# Common English words: each is one token (with its leading space) in the usual BPE
# vocabularies, so N words is about N prompt tokens for any real model.
VOCAB: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from his her they this which have
had are not but be he she it an or were been their has one all would there what so
up out if about who get them me my more no when make can like time just him know take
people into year your good some could see other than then now look only come its over
think also back after use two how our work first well way even new want because any these
give day most us great where much through long down should still own last each old high
small large next early young few public same able city world house water room mother area
money story fact month lot right study book eye job word business issue side kind head
far black white long little home place hand part child woman man life case point group
number night state school family system program question government company country week
under never always often again while few both between open run move live play turn start
show hear might begin seem help talk keep leave put mean call ask need feel become try
write read learn change follow stop create speak allow add spend grow offer remember love
consider appear buy wait serve die send expect build stay fall cut reach kill remain
""".split())


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Target:
    """One endpoint under test: ``name=protocol:url`` (``proxy=ollama:http://127.0.0.1:11434``)."""

    name: str
    protocol: str
    base: str
    model: str | None = None  # overrides Workload.model for this target
    api_key: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Target:
        name, sep, rest = spec.partition("=")
        proto, sep2, url = rest.partition(":")
        if not sep or not sep2 or not name or proto not in PROTOCOLS or not url.startswith(("http://", "https://")):
            raise ValueError(f"bad target {spec!r}: want NAME=ollama:URL or NAME=openai:URL")
        return cls(name.strip(), proto, url.rstrip("/"))


@dataclass(frozen=True)
class Workload:
    model: str
    output_tokens: int = 128
    prompt_words: int = 128
    temperature: float = 0.0
    check_tokens: bool = True  # an answer with another token count than asked is an error


class PromptFactory:
    """Random prompts of ``words`` words from :data:`VOCAB`, reproducible from ``seed``."""

    def __init__(self, words: int, seed: int | None = 0) -> None:
        self.words = words
        self.rng = random.Random(seed)

    def __call__(self) -> str:
        return " ".join(self.rng.choices(VOCAB, k=self.words))


def request_for(target: Target, wl: Workload, prompt: str) -> tuple[str, bytes, dict[str, str]]:
    """``(url, body, headers)`` of one streamed request for ``target``'s protocol."""
    model = target.model or wl.model
    headers = {"Content-Type": "application/json"}
    if target.protocol == "openai-vllama":
        return target.base + "/v1/completions", vllama_upstream_body(model, prompt, wl), headers
    if target.protocol in ("ollama", "ollama-nostream"):
        body = {
            "model": model,
            "prompt": prompt,
            "raw": True,
            "stream": target.protocol == "ollama",
            "options": {"num_predict": wl.output_tokens, "ignore_eos": True, "temperature": wl.temperature},
        }
        url = target.base + "/api/generate"
    elif target.protocol == "ollama-chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "options": {"num_predict": wl.output_tokens, "ignore_eos": True, "temperature": wl.temperature},
        }
        url = target.base + "/api/chat"
    elif target.protocol == "openai-chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": wl.output_tokens,
            "ignore_eos": True,
            "temperature": wl.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = target.base + "/v1/chat/completions"
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
    else:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": wl.output_tokens,
            "ignore_eos": True,
            "temperature": wl.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if target.protocol == "openai-nostream":
            body["stream"] = False
            del body["stream_options"]
        url = target.base + "/v1/completions"
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
    return url, orjson.dumps(body), headers


def vllama_upstream_body(model: str, prompt: str, wl: Workload) -> bytes:
    """The bytes vllama's ``/api/generate`` sends to vLLM's ``/v1/completions`` for the ``ollama``
    target's request (raw, streamed, ``num_predict``/``ignore_eos``/``temperature``): its own
    translation (``vllama_proxy`` must be importable), so the body cannot drift from vllama's."""
    from vllama_proxy.api.ollama.types import GenerateRequest
    from vllama_proxy.api.ollama.to_openai import generate_body
    from vllama_proxy.upstream import encode_json

    req = GenerateRequest.model_validate({
        "model": model, "prompt": prompt, "raw": True, "stream": True,
        "options": {"num_predict": wl.output_tokens, "ignore_eos": True, "temperature": wl.temperature},
    })
    path, body, _ = generate_body(req, model)
    assert path == "/v1/completions", path
    return encode_json(body)


# --------------------------------------------------------------------------- one request


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str | None = None
    status: int | None = None  # HTTP status, None when no answer came at all
    start: float = 0.0  # perf_counter at send
    ttft: float | None = None  # seconds
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    chunks: int = 0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class _StreamState:
    """Per-request parse state; ``line()`` returns False to stop reading."""

    __slots__ = ("res", "t0", "last", "done", "count")

    def __init__(self, res: RequestResult, t0: float) -> None:
        self.res = res
        self.t0 = t0
        self.last = 0.0
        self.done = False
        self.count: int | None = None

    def token(self, now: float) -> None:
        res = self.res
        if res.ttft is None:
            res.ttft = now - self.t0
        else:
            res.itls.append(now - self.last)
        self.last = now
        res.chunks += 1


def _ollama_line(st: _StreamState, line: bytes, now: float) -> bool:
    line = line.strip()
    if not line:
        return True
    obj = orjson.loads(line)
    if "error" in obj:
        st.res.error = f"error line: {obj['error']}"
        return False
    if obj.get("response") or obj.get("thinking"):
        st.token(now)
    if obj.get("done"):
        st.done = True
        st.count = obj.get("eval_count")
        st.res.prompt_tokens = obj.get("prompt_eval_count")
    return True


def _ollama_chat_line(st: _StreamState, line: bytes, now: float) -> bool:
    line = line.strip()
    if not line:
        return True
    obj = orjson.loads(line)
    if "error" in obj:
        st.res.error = f"error line: {obj['error']}"
        return False
    msg = obj.get("message") or {}
    if msg.get("content") or msg.get("thinking"):
        st.token(now)
    if obj.get("done"):
        st.done = True
        st.count = obj.get("eval_count")
        st.res.prompt_tokens = obj.get("prompt_eval_count")
    return True


def _openai_line(st: _StreamState, line: bytes, now: float) -> bool:
    if not line.startswith(b"data:"):
        return True
    payload = line[5:].strip()
    if payload == b"[DONE]":
        st.done = True
        return True
    obj = orjson.loads(payload)
    if "error" in obj:
        err = obj["error"]
        st.res.error = f"error event: {err.get('message') if isinstance(err, dict) else err}"
        return False
    choices = obj.get("choices")
    if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
        st.token(now)
    usage = obj.get("usage")
    if usage:
        st.count = usage.get("completion_tokens")
        st.res.prompt_tokens = usage.get("prompt_tokens")
    return True


_LINE_HANDLERS = {"ollama": _ollama_line, "ollama-nostream": _ollama_line, "ollama-chat": _ollama_chat_line}


async def one_request(
    session: aiohttp.ClientSession, target: Target, wl: Workload, url: str, body: bytes, headers: dict[str, str],
    handle: Callable[[_StreamState, bytes, float], bool] | None = None,
) -> RequestResult:
    """Send one streamed request and measure it; never raises (errors are in the result).
    ``handle``: another line handler than the protocol's (one that also keeps the text)."""
    res = RequestResult()
    handle = handle or _LINE_HANDLERS.get(target.protocol, _openai_line)
    clock = time.perf_counter
    t0 = res.start = clock()
    st = _StreamState(res, t0)
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            res.status = resp.status
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace").strip()
                res.error = f"HTTP {resp.status}: {text[:200]}"
            elif target.protocol == "openai-nostream":
                usage = orjson.loads(await resp.read()).get("usage") or {}
                st.done, st.count, res.prompt_tokens = True, usage.get("completion_tokens"), usage.get("prompt_tokens")
            else:
                buf = b""
                going = True
                async for data in resp.content.iter_any():
                    now = clock()
                    if b"\n" not in data:
                        buf += data
                        continue
                    *lines, rest = (buf + data).split(b"\n")
                    buf = rest
                    for line in lines:
                        if not handle(st, line, now):
                            going = False
                            break
                    if not going:
                        break
                if going and buf.strip():
                    handle(st, buf, clock())
    except asyncio.CancelledError:
        raise
    except orjson.JSONDecodeError as e:
        res.error = f"bad JSON in stream: {e}"
    except Exception as e:  # noqa: BLE001 - every failure is a measured error
        res.error = f"{type(e).__name__}: {e}"[:300]
    res.e2e = clock() - t0
    if res.error is None:
        if not st.done:
            res.error = "stream ended without " + ("done:true" if target.protocol.startswith("ollama") else "[DONE]")
        else:
            res.output_tokens = st.count if isinstance(st.count, int) else res.chunks
            if wl.check_tokens and res.output_tokens != wl.output_tokens:
                res.error = f"{res.output_tokens} output tokens, asked for {wl.output_tokens}"
    else:
        res.output_tokens = st.count if isinstance(st.count, int) else res.chunks
    res.ok = res.error is None
    return res


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    """The requests of one (target, concurrency) run and its wall time."""

    target: Target
    concurrency: int
    results: list[RequestResult]
    wall: float
    client_cpu: float  # this process's user+system CPU seconds during the run
    round: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    machine_cpu: dict[str, float] = field(default_factory=dict)  # --cpu-by-kind: CPU seconds per process kind


def _kind(cmd: str) -> str | None:
    if "vllama_proxy" in cmd:  # first: a node's command line may end with its --vllm-executable .../vllm
        return "vllama_front" if "--upstream" in cmd else "vllama"  # a fleet's front, or a node / lone server
    if "APIServer" in cmd:
        return "vllm_api"
    if "EngineCore" in cmd or "DPCoordinator" in cmd:
        return "vllm_engine"
    if "vllm serve" in cmd or cmd.endswith("/vllm") or "vllm.entrypoints" in cmd:
        return "vllm_api"  # with one API server the `vllm serve` process is it
    if "vllm-router" in cmd or "vllm::router" in cmd:  # vllm-router renames its process (argv) `vllm::router`
        return "router"
    return None


def machine_cpu() -> dict[str, float]:
    """User+system CPU seconds so far of every process on the machine, by kind: ``vllm_api``,
    ``vllm_engine``, ``vllama`` (its workers are its children), ``client`` (this load generator
    and its processes), ``other``. Differences over a run show where the cores went."""
    import psutil

    me = os.getpid()
    procs = {}
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "name", "cpu_times"]):
        info = p.info
        c = info["cpu_times"]
        if c is None:
            continue
        cmd = " ".join(info["cmdline"] or []) or (info["name"] or "")
        procs[info["pid"]] = (info["ppid"], _kind(cmd), c.user + c.system)
    out: dict[str, float] = collections.Counter()
    for pid, (ppid, kind, cpu) in procs.items():
        k, seen, q = kind, 0, pid
        while k is None and q in procs and seen < 16:  # a child takes its nearest known ancestor's kind
            q = procs[q][0]
            seen += 1
            k = "client" if q == me else procs[q][1] if q in procs else None
        out["client" if pid == me else k or "other"] += cpu
    return dict(out)


def make_session() -> aiohttp.ClientSession:
    """The shared client: an unlimited pool, no total timeout, 600 s idle-read timeout."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def run_requests(
    session: aiohttp.ClientSession,
    target: Target,
    wl: Workload,
    reqs: list[tuple[str, bytes, dict[str, str]]],
    concurrency: int,
    start_at: float | None = None,
) -> tuple[list[RequestResult], float, float, float]:
    """Send prepared requests with ``concurrency`` workers; ``(results, t_start, t_end, cpu_seconds)``.

    ``start_at``: a ``time.perf_counter()`` value to wait for (CLOCK_MONOTONIC on Linux,
    shared by all processes), so several client processes start together.
    """
    n = len(reqs)
    results: list[RequestResult | None] = [None] * n
    nxt = 0

    async def worker() -> None:
        nonlocal nxt
        while nxt < n:
            i = nxt
            nxt += 1
            url, body, headers = reqs[i]
            results[i] = await one_request(session, target, wl, url, body, headers)

    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, n)))))
    t1 = time.perf_counter()
    return [r for r in results if r is not None], t0, t1, _cpu_seconds() - cpu0


async def run_level(
    session: aiohttp.ClientSession,
    target: Target,
    wl: Workload,
    prompts: Callable[[], str],
    concurrency: int,
    n_requests: int,
    round_: int = 0,
) -> Run:
    """``n_requests`` requests with at most ``concurrency`` in flight (``concurrency`` workers)."""
    reqs = [request_for(target, wl, prompts()) for _ in range(n_requests)]  # before the clock
    results, t0, t1, cpu = await run_requests(session, target, wl, reqs, concurrency)
    return Run(target, concurrency, results, t1 - t0, cpu, round_)


# --------------------------------------------------------------------------- multi-turn conversations


@dataclass(frozen=True)
class Conversations:
    """Multi-turn chats with shared system prompts, as Ollama clients hold them (``--conversations G,S,T``).

    ``groups`` groups of ``sessions`` sessions each; every session of a group starts with the group's
    system prompt (``system_words`` random words: the prefix a group shares), then ``turns`` user
    turns of ``turn_words`` words, each answered with ``output_tokens`` tokens; every turn resends the
    whole history (system, earlier user turns and the assistant's actual replies) to ``/api/chat``,
    so turn k's prompt begins with turn k-1's. Sessions run ``concurrency`` at a time, each its
    turns one after the other; the first turns of all sessions are interleaved across groups.
    """

    groups: int
    sessions: int
    turns: int
    system_words: int = 1000
    turn_words: int = 64

    @classmethod
    def parse(cls, spec: str, system_words: int, turn_words: int) -> Conversations:
        g, s, t = (int(x) for x in spec.split(","))
        if min(g, s, t) < 1:
            raise ValueError(f"bad --conversations {spec!r}: want G,S,T, each >= 1")
        return cls(g, s, t, system_words, turn_words)


async def chat_turn(session: aiohttp.ClientSession, target: Target, wl: Workload, messages: list[dict[str, str]],
                    headers: dict[str, str] | None = None) -> tuple[RequestResult, str]:
    """One streamed ``/api/chat`` turn: its measurement and the assistant's text (for the next turn)."""
    body = {"model": target.model or wl.model, "messages": messages, "stream": True,
            "options": {"num_predict": wl.output_tokens, "ignore_eos": True, "temperature": wl.temperature}}
    parts: list[str] = []

    def handle(st: _StreamState, line: bytes, now: float) -> bool:
        line = line.strip()
        if line:
            content = (orjson.loads(line).get("message") or {}).get("content")
            if content:
                parts.append(content)
        return _ollama_chat_line(st, line, now)

    res = await one_request(session, target, wl, target.base + "/api/chat", orjson.dumps(body),
                            {"Content-Type": "application/json", **(headers or {})}, handle=handle)
    return res, "".join(parts)


async def run_conversations(session: aiohttp.ClientSession, target: Target, wl: Workload, conv: Conversations,
                            concurrency: int, seed: int = 0) -> Run:
    """Every session of ``conv`` against ``target`` (``ollama-chat``), ``concurrency`` sessions at a time.

    The run's ``extra`` has ``timeline``: per turn ``[start_s, e2e_s, ok, turn, group, ttft_s]`` (start
    relative to ``t0_unix``, the wall clock at the run's start; ``ttft_s`` None without a first token),
    for failover analysis and for pooling TTFT over several runs.
    """
    rng = random.Random(seed)
    systems = [" ".join(rng.choices(VOCAB, k=conv.system_words)) for _ in range(conv.groups)]
    order = [(g, s) for s in range(conv.sessions) for g in range(conv.groups)]  # groups interleaved
    users = {key: [" ".join(rng.choices(VOCAB, k=conv.turn_words)) for _ in range(conv.turns)] for key in order}
    results: list[RequestResult] = []
    timeline: list[list[Any]] = []
    nxt = 0
    t0 = time.perf_counter()

    async def one_session(g: int, s: int) -> None:
        messages = [{"role": "system", "content": systems[g]}]
        for turn, text in enumerate(users[(g, s)]):
            messages.append({"role": "user", "content": text})
            res, reply = await chat_turn(session, target, wl, messages)
            results.append(res)
            timeline.append([round(res.start - t0, 4), round(res.e2e, 4), res.ok, turn, g,
                             None if res.ttft is None else round(res.ttft, 4)])
            if not res.ok:
                return  # a client whose turn failed starts over elsewhere; this session ends
            messages.append({"role": "assistant", "content": reply})

    async def worker() -> None:
        nonlocal nxt
        while nxt < len(order):
            key = order[nxt]
            nxt += 1
            await one_session(*key)

    t0_unix = time.time()
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(order))))))
    wall = time.perf_counter() - t0
    run = Run(target, concurrency, results, wall, _cpu_seconds() - cpu0)
    run.extra = {"t0_unix": round(t0_unix, 3), "timeline": sorted(timeline)}
    return run


async def engine_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """One vLLM's prefix-cache ``queries``/``hits`` (tokens) and finished ``requests``, from its Prometheus
    ``/metrics`` (``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``,
    ``vllm:request_success_total``); zeros when it cannot be read (an engine restarting)."""
    out = {"queries": 0.0, "hits": 0.0, "requests": 0.0}
    names = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
             "vllm:request_success_total": "requests"}
    try:
        async with session.get(url) as resp:
            text = (await resp.read()).decode()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return out
    for line in text.splitlines():
        name, _, rest = line.partition("{") if "{" in line.split(" ")[0] else line.partition(" ")
        key = names.get(name)
        if key:
            try:
                out[key] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def cluster_cache(before: list[dict[str, float]], after: list[dict[str, float]], urls: list[str]) -> dict[str, Any]:
    """Cluster prefix-cache hit rate: the sum of every engine's hit tokens over the sum of their queried tokens."""
    # an engine restarted during the run starts its counters again: what it counted since (marked)
    per = [{"url": u, **({k: a[k] - b[k] for k in a} if a["queries"] >= b["queries"] else {**a, "restarted": True})}
           for u, b, a in zip(urls, before, after)]
    q, h = sum(e["queries"] for e in per), sum(e["hits"] for e in per)
    return {"cluster_hit_rate": round(h / q, 4) if q else None, "queries": q, "hits": h, "engines": per}


async def conversations_main(args: argparse.Namespace) -> dict[str, Any]:
    """``--conversations``: one run per target per level; cluster prefix-cache rate from ``--engine-metrics``."""
    conv = Conversations.parse(args.conversations, args.system_words, args.turn_words)
    wl = Workload(args.model, args.output_tokens, args.turn_words, args.temperature, not args.no_check_tokens)
    urls = [u for u in (args.engine_metrics or "").split(",") if u]
    out: dict[str, Any] = {**environment(), "config": {k: v for k, v in vars(args).items() if k not in ("target_list", "level_list", "n_for")},
                           "workload": {"groups": conv.groups, "sessions_per_group": conv.sessions, "turns": conv.turns,
                                        "system_words": conv.system_words, "turn_words": conv.turn_words,
                                        "output_tokens": wl.output_tokens, "model": wl.model},
                           "runs": []}
    async with make_session() as session:
        for c in args.level_list:
            for t in args.target_list:
                before = [await engine_counters(session, u) for u in urls]
                run = await run_conversations(session, t, wl, conv, c, args.seed)
                after = [await engine_counters(session, u) for u in urls]
                s = summarize([run])
                s["timeline"] = run.extra["timeline"]
                s["t0_unix"] = run.extra["t0_unix"]
                if urls:
                    s["cache"] = cluster_cache(before, after, urls)
                log(progress(run) + (f" cluster hit rate {s['cache']['cluster_hit_rate']}" if urls else ""))
                out["runs"].append(s)
    out["table"] = results_table([{k: v for k, v in r.items() if k != "timeline"} for r in out["runs"]])
    return out


# --------------------------------------------------------------------------- several client processes


def _child_main(conn: Any, use_uvloop: bool) -> None:
    """A client process: one loop and one session for its life, one run per message."""
    loop: asyncio.AbstractEventLoop | None = None
    if use_uvloop:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            pass
    loop = loop or asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def open_session() -> aiohttp.ClientSession:
        return make_session()

    session = loop.run_until_complete(open_session())
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            target, wl, reqs, concurrency, start_at = msg
            conn.send(loop.run_until_complete(run_requests(session, target, wl, reqs, concurrency, start_at)))
    finally:
        loop.run_until_complete(session.close())
        loop.close()


class ClientPool:
    """``procs`` client processes sharing each run: concurrency and requests split evenly.

    One Python process parses roughly 20-60k streamed chunks/s; above that the client,
    not the server, would be measured (watch the client CPU column). The processes keep
    their connection pools between runs, like the single-process client.
    """

    def __init__(self, procs: int, use_uvloop: bool = True) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # never fork a process with a running event loop
        self.conns = []
        self.procs = []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child_main, args=(child, use_uvloop), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    @staticmethod
    def _share(total: int, k: int, i: int) -> int:
        return total // k + (1 if i < total % k else 0)

    async def run_level(self, target: Target, wl: Workload, prompts: Callable[[], str], concurrency: int,
                        n_requests: int, round_: int = 0) -> Run:
        # No more processes than streams: each process runs at least one stream, so spreading
        # c=1 over 4 processes would run 4 streams at once (issue 19: the GPU's "c=1" was c=4).
        conns = self.conns[:max(1, min(len(self.conns), concurrency))]
        k = len(conns)
        reqs = [request_for(target, wl, prompts()) for _ in range(n_requests)]
        start_at = time.perf_counter() + 0.3 + 0.0002 * n_requests  # after every child got its share
        pos = 0
        for i, conn in enumerate(conns):
            n_i = self._share(n_requests, k, i)
            conn.send((target, wl, reqs[pos:pos + n_i], self._share(concurrency, k, i), start_at))
            pos += n_i
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(None, conn.recv) for conn in conns))
        results = [r for part in parts for r in part[0]]
        wall = max(p[2] for p in parts) - min(p[1] for p in parts)
        return Run(target, concurrency, results, wall, sum(p[3] for p in parts), round_)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join()


# --------------------------------------------------------------------------- statistics


def percentile(sorted_xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of an already sorted list."""
    if not sorted_xs:
        return None
    k = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def _dist_ms(xs: list[float]) -> dict[str, float | None]:
    s = sorted(xs)
    out: dict[str, float | None] = {}
    for q in (50, 90, 99):
        v = percentile(s, q)
        out[f"p{q}"] = None if v is None else round(v * 1000, 3)
    out["mean"] = round(sum(s) / len(s) * 1000, 3) if s else None
    return out


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Pooled statistics of one or more runs of the same target and level (times in ms)."""
    results = [r for run in runs for r in run.results]
    ok = [r for r in results if r.ok]
    wall = sum(run.wall for run in runs)
    tokens = sum(r.output_tokens for r in ok)
    errors = collections.Counter(r.error for r in results if not r.ok)
    client_cpu = sum(run.client_cpu for run in runs)
    return {
        "target": runs[0].target.name,
        "protocol": runs[0].target.protocol,
        "concurrency": runs[0].concurrency,
        "runs": len(runs),
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "answered": sum(1 for r in results if r.status is not None),
        "error_samples": [{"error": e, "count": n} for e, n in errors.most_common(5)],
        "wall_s": round(wall, 4),
        "req_s": round(len(ok) / wall, 4) if wall else None,
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2) if wall else None,
        "ttft_ms": _dist_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _dist_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _dist_ms([x for r in ok for x in r.itls]),
        "e2e_ms": _dist_ms([r.e2e for r in ok]),
        "client_cpu_util": round(client_cpu / wall, 3) if wall else None,
        **_machine_summary(runs, wall, tokens),
        **({"extra": runs[0].extra} if len(runs) == 1 and runs[0].extra else {}),
    }


def _machine_summary(runs: list[Run], wall: float, tokens: int) -> dict[str, Any]:
    """Cores busy per process kind during the runs, and CPU µs per output token (--cpu-by-kind)."""
    if not any(run.machine_cpu for run in runs) or not wall:
        return {}
    total: dict[str, float] = collections.Counter()
    for run in runs:
        total.update(run.machine_cpu)
    return {
        "machine_cores": {k: round(v / wall, 3) for k, v in sorted(total.items())},
        "machine_cpu_us_per_token": {k: round(v / tokens * 1e6, 2) for k, v in sorted(total.items())} if tokens else {},
    }


def compare(s: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``s`` against the baseline ``base``: throughput ratio and p50 latency deltas (ms)."""

    def delta(key: str) -> float | None:
        a, b = s[key]["p50"], base[key]["p50"]
        return None if a is None or b is None else round(a - b, 3)

    def ratio(key: str) -> float | None:
        a, b = s[key], base[key]
        return round(a / b, 4) if a is not None and b else None

    return {
        "target": s["target"],
        "baseline": base["target"],
        "tok_s_ratio": ratio("output_tok_s"),
        "req_s_ratio": ratio("req_s"),
        "ttft_p50_delta_ms": delta("ttft_ms"),
        "tpot_p50_delta_ms": delta("tpot_ms"),
        "itl_p50_delta_ms": delta("itl_ms"),
        "e2e_p50_delta_ms": delta("e2e_ms"),
    }


# --------------------------------------------------------------------------- tables


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def results_table(summaries: list[dict[str, Any]]) -> str:
    head = ("| c | target | reqs | ok | err | req/s | tok/s | TTFT p50 | p90 | p99 | TPOT p50 | p90 | p99 "
            "| ITL p50 | p90 | p99 | E2E p50 | p90 | p99 | client CPU |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        row = [str(s["concurrency"]), s["target"], str(s["requests"]), str(s["ok"]), str(s["errors"]),
               _f(s["req_s"], 2), _f(s["output_tok_s"], 0)]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            row += [_f(s[key]["p50"]), _f(s[key]["p90"]), _f(s[key]["p99"])]
        row.append(_f(s["client_cpu_util"] * 100 if s["client_cpu_util"] is not None else None, 0) + "%")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + ("\n(latencies in ms; client CPU = the load generator's CPU time / wall, "
                               "summed over its processes: near 100% per process means the client is the limit)")


def machine_table(summaries: list[dict[str, Any]]) -> str:
    kinds = sorted({k for s in summaries for k in s.get("machine_cores", {})})
    if not kinds:
        return ""
    head = "| c | target | " + " | ".join(f"{k} cores" for k in kinds) + " | " + " | ".join(f"{k} µs/tok" for k in kinds) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(kinds))]
    for s in summaries:
        cores, per = s.get("machine_cores", {}), s.get("machine_cpu_us_per_token", {})
        lines.append(f"| {s['concurrency']} | {s['target']} | " + " | ".join(_f(cores.get(k), 2) for k in kinds)
                     + " | " + " | ".join(_f(per.get(k), 1) for k in kinds) + " |")
    return "\n".join(lines) + ("\n(every process on the machine by kind, CPU time over the runs' wall time: "
                               "cores busy, and CPU µs per output token)")


def ratio_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| c | target / baseline | tok/s ratio | TTFT p50 Δ ms | TPOT p50 Δ ms | ITL p50 Δ ms | E2E p50 Δ ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['target']} / {r['baseline']} | {_f(r['tok_s_ratio'], 3)} | "
                     f"{_f(r['ttft_p50_delta_ms'], 2)} | {_f(r['tpot_p50_delta_ms'], 3)} | "
                     f"{_f(r['itl_p50_delta_ms'], 3)} | {_f(r['e2e_p50_delta_ms'], 1)} |")
    return "\n".join(lines)


def burst_table(summaries: list[dict[str, Any]]) -> str:
    lines = ["| burst | target | round | wall s | answered | ok | errors | tok/s | TTFT p50 | TTFT p99 | E2E p99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['concurrency']} | {s['target']} | {s.get('round', '-')} | {_f(s['wall_s'], 2)} | "
                     f"{s['answered']} | {s['ok']} | {s['errors']} | {_f(s['output_tok_s'], 0)} | "
                     f"{_f(s['ttft_ms']['p50'])} | {_f(s['ttft_ms']['p99'])} | {_f(s['e2e_ms']['p99'])} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- helpers


_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Call, ast.Name, ast.Load, ast.Constant,
                  ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)
_FUNCS = {"max": max, "min": min, "int": int, "round": round, "ceil": math.ceil}


def requests_formula(expr: str) -> Callable[[int], int]:
    """``"64"`` or a formula of ``c`` (``"max(32,4*c)"``) -> a function of the concurrency."""
    tree = ast.parse(expr.strip(), mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"not allowed in --requests-per-level: {type(node).__name__}")
        if isinstance(node, ast.Name) and node.id not in ("c", *_FUNCS):
            raise ValueError(f"unknown name in --requests-per-level: {node.id} (use c, {', '.join(_FUNCS)})")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS):
            raise ValueError("only max/min/int/round/ceil calls are allowed in --requests-per-level")
    code = compile(tree, "<requests-per-level>", "eval")

    def f(c: int) -> int:
        return max(1, int(eval(code, {"__builtins__": {}}, {"c": c, **_FUNCS})))  # noqa: S307 - checked above

    f(1)
    return f


def raise_nofile() -> tuple[int, int]:
    """Raise ``RLIMIT_NOFILE``'s soft limit to its hard limit; returns the new ``(soft, hard)``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            if hard == resource.RLIM_INFINITY:
                resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def environment() -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "cpu_count": os.cpu_count(),
    }


def run_loop(coro: Any, use_uvloop: bool = True) -> Any:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def progress(run: Run) -> str:
    s = summarize([run])
    return (f"  c={run.concurrency:<5} {run.target.name:<10} round {run.round}: {s['ok']}/{s['requests']} ok, "
            f"{s['output_tok_s'] or 0:.0f} tok/s, TTFT p50 {_f(s['ttft_ms']['p50'])} ms, "
            f"TPOT p50 {_f(s['tpot_ms']['p50'], 2)} ms, {s['wall_s']:.1f} s"
            + (f", errors: {s['error_samples'][0]['error']!r}" if s["errors"] else ""))


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Streaming load generator: Ollama /api/generate (NDJSON) vs OpenAI /v1/completions (SSE).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--targets", required=True,
                   help="comma-separated NAME=PROTOCOL:URL, PROTOCOL ollama or openai "
                        "(proxy=ollama:http://127.0.0.1:11434,direct=openai:http://127.0.0.1:8000)")
    p.add_argument("--model", required=True, help="model name sent by every target")
    p.add_argument("--model-for", action="append", default=[], metavar="NAME=MODEL",
                   help="another model name for one target (e.g. an Ollama alias); repeatable")
    p.add_argument("--api-key", default=None, help="bearer token for openai targets (vLLM --api-key)")
    p.add_argument("--levels", default="1,10,64,256,1024", help="comma-separated concurrency levels")
    p.add_argument("--requests-per-level", default="max(32,4*c)",
                   help="requests per level and target per round: a number or a formula of c")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds of the targets per level")
    p.add_argument("--output-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--prompt-words", type=int, default=128, help="random words per prompt (~tokens)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--warmup", type=int, default=8, help="unmeasured requests per target before the first level")
    p.add_argument("--baseline", default=None, help="target the others are compared to (default: the last)")
    p.add_argument("--burst", type=int, default=None, metavar="N",
                   help="instead of levels: N requests launched at once per target and round")
    p.add_argument("--no-check-tokens", action="store_true",
                   help="do not count an answer with another token count than asked as an error")
    p.add_argument("--cooldown", type=float, default=0.0, help="seconds of pause between runs")
    p.add_argument("--raise-nofile", action="store_true", help="raise RLIMIT_NOFILE soft limit to the hard limit")
    p.add_argument("--procs", type=int, default=1,
                   help="client processes sharing each run (concurrency and requests split evenly); use more "
                        "when the client CPU column nears 100%%")
    p.add_argument("--no-uvloop", action="store_true", help="use asyncio's default loop")
    p.add_argument("--cpu-by-kind", action="store_true",
                   help="record every process's CPU during each run by kind (vLLM API servers, engine core, "
                        "vllama, client, other; needs psutil)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results there")
    p.add_argument("--conversations", default=None, metavar="G,S,T",
                   help="instead of single prompts: G groups of S multi-turn sessions of T turns (ollama-chat targets; "
                        "each group shares one system prompt, the history is resent each turn); --levels is sessions in flight")
    p.add_argument("--system-words", type=int, default=1000, help="--conversations: random words of each group's system prompt")
    p.add_argument("--turn-words", type=int, default=64, help="--conversations: random words of each user turn")
    p.add_argument("--engine-metrics", default=None, metavar="URL,URL",
                   help="--conversations: each engine's vLLM /metrics, read before and after each run for the "
                        "cluster prefix-cache hit rate (sum of hits / sum of queries)")
    args = p.parse_args(argv)
    try:
        args.target_list = [Target.parse(s) for s in args.targets.split(",") if s.strip()]
        overrides = dict(x.split("=", 1) for x in args.model_for)
        args.target_list = [
            Target(t.name, t.protocol, t.base, overrides.get(t.name), args.api_key if t.protocol == "openai" else None)
            for t in args.target_list
        ]
        args.level_list = [int(x) for x in args.levels.split(",") if x.strip()]
        args.n_for = requests_formula(args.requests_per_level)
    except ValueError as e:
        p.error(str(e))
    names = [t.name for t in args.target_list]
    if len(set(names)) != len(names):
        p.error("target names must be unique")
    if args.baseline is not None and args.baseline not in names:
        p.error(f"--baseline {args.baseline} is not a target")
    return args


async def _warmup(run_fn: Callable[..., Any], targets: list[Target], n: int) -> None:
    for t in targets:
        run = await run_fn(t, min(n, 8), n)
        s = summarize([run])
        log(f"warmup {t.name}: {s['ok']}/{s['requests']} ok"
            + (f" ({s['error_samples'][0]['error']})" if s["errors"] else ""))
        if s["ok"] == 0:
            raise SystemExit(f"{t.name} ({t.base}) answered no warmup request successfully: "
                             f"{s['error_samples'][0]['error'] if s['error_samples'] else '?'}")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    targets: list[Target] = args.target_list
    wl = Workload(args.model, args.output_tokens, args.prompt_words, args.temperature, not args.no_check_tokens)
    prompts = PromptFactory(args.prompt_words, args.seed)
    baseline = args.baseline or targets[-1].name
    out: dict[str, Any] = {
        **environment(),
        "config": {k: v for k, v in vars(args).items() if k not in ("target_list", "level_list", "n_for")},
        "targets": [{"name": t.name, "protocol": t.protocol, "base": t.base, "model": t.model or wl.model}
                    for t in targets],
        "workload": {"model": wl.model, "output_tokens": wl.output_tokens, "prompt_words": wl.prompt_words,
                     "temperature": wl.temperature},
        "baseline": baseline,
    }
    pool = ClientPool(args.procs, not args.no_uvloop) if args.procs > 1 else None
    session = make_session() if pool is None else None

    async def run_fn(t: Target, c: int, n: int, r: int = 0) -> Run:
        before = machine_cpu() if args.cpu_by_kind else None
        if pool is not None:
            run = await pool.run_level(t, wl, prompts, c, n, r)
        else:
            assert session is not None
            run = await run_level(session, t, wl, prompts, c, n, r)
        if before is not None:
            after = machine_cpu()
            run.machine_cpu = {k: round(v - before.get(k, 0.0), 4) for k, v in after.items()}
        return run

    try:
        if args.warmup > 0:
            await _warmup(run_fn, targets, args.warmup)
        if args.burst:
            bursts = []
            for r in range(args.rounds):
                for t in targets:
                    run = await run_fn(t, args.burst, args.burst, r)
                    log(progress(run))
                    bursts.append({**summarize([run]), "round": r})
                    if args.cooldown:
                        await asyncio.sleep(args.cooldown)
            out["burst"] = bursts
            return out
        levels = []
        for c in args.level_list:
            n = args.n_for(c)
            log(f"level c={c}: {n} requests per target and round")
            runs: list[Run] = []
            for r in range(args.rounds):
                # Round r starts with target r: no target always runs right after the same other one.
                for t in targets[r % len(targets):] + targets[:r % len(targets)]:
                    run = await run_fn(t, c, n, r)
                    log(progress(run))
                    runs.append(run)
                    if args.cooldown:
                        await asyncio.sleep(args.cooldown)
            summary = {t.name: summarize([x for x in runs if x.target.name == t.name]) for t in targets}
            ratios = {name: {"concurrency": c, **compare(s, summary[baseline])}
                      for name, s in summary.items() if name != baseline}
            levels.append({
                "concurrency": c,
                "requests_per_run": n,
                "runs": [{**summarize([x]), "round": x.round} for x in runs],
                "summary": summary,
                "ratios": ratios,
            })
        out["levels"] = levels
        return out
    finally:
        if session is not None:
            await session.close()
        if pool is not None:
            pool.close()


def report(out: dict[str, Any]) -> str:
    parts = []
    if "burst" in out:
        parts.append(burst_table(out["burst"]))
    if out.get("levels"):
        parts.append(results_table([s for lv in out["levels"] for s in lv["summary"].values()]))
        machine = machine_table([s for lv in out["levels"] for s in lv["summary"].values()])
        if machine:
            parts.append(machine)
        ratios = [r for lv in out["levels"] for r in lv["ratios"].values()]
        if ratios:
            parts.append(ratio_table(ratios))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.raise_nofile:
        soft, hard = raise_nofile()
        log(f"RLIMIT_NOFILE: soft {soft}, hard {hard}")
    need = (args.burst or max(args.level_list, default=1)) + 64
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < need:
        log(f"warning: RLIMIT_NOFILE soft limit {soft} < {need} sockets this run may need (--raise-nofile)")
    if args.conversations:
        out = run_loop(conversations_main(args), not args.no_uvloop)
        print(out["table"])
        if args.json:
            with open(args.json, "wb") as f:
                f.write(orjson.dumps(out, option=orjson.OPT_INDENT_2))
            log(f"wrote {args.json}")
        return 0  # errors are data here (the failover run counts them)
    out = run_loop(main_async(args), not args.no_uvloop)
    text = report(out)
    print(text)
    out["table"] = text
    errors = sum(s["errors"] for lv in out.get("levels", []) for s in lv["summary"].values()) + sum(
        s["errors"] for s in out.get("burst", []))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(out, option=orjson.OPT_INDENT_2))
        log(f"wrote {args.json}")
    if errors:
        log(f"{errors} request(s) failed")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
