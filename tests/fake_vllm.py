#!/usr/bin/env python3
"""A fake vLLM OpenAI-compatible server (0.26 shapes; 0.32 with FAKE_VLLM_VERSION): a real HTTP server process for tests.

Run it like ``vllm serve``::

    python tests/fake_vllm.py serve MODEL [--host H] [--port P]
        [--served-model-name NAME ...] [--max-model-len N] [--api-key KEY] [anything else]

Unknown arguments (``--gpu-memory-utilization 0.9``, ``--enable-auto-tool-choice``,
``--tool-call-parser hermes``, ``--runner pooling`` ...) are accepted and ignored.
``--runner pooling`` (or ``--convert embed``) makes it an embedding model: ``/v1/embeddings``,
``/v1/rerank`` and ``/v1/score`` (scores: the cosine of the two texts' vectors, as vLLM scores with an
embedding model; vLLM 0.32's response shapes) and no generation, as vLLM does; otherwise those are 404s.
``tests/bin/vllm`` is an executable wrapper, so ``PATH=tests/bin:$PATH vllm serve ...`` works.
Log lines go to stderr, shaped like vLLM's (``INFO ... Starting vLLM API server on http://H:P``).

Knobs (environment variables, read once at start)
-------------------------------------------------
FAKE_VLLM_START_DELAY      float s (0): sleep before binding the port, printing loading progress
                           lines to stderr every 0.5 s. Connections are refused until bound.
FAKE_VLLM_START_GATE       path: after the start delay, keep loading (a progress line each 0.5 s)
                           until this file exists: a test decides when vLLM is ready, whatever the
                           machine's load.
FAKE_VLLM_FAIL_AT_START    str: after the start delay print ``ERROR <msg>`` and a fake traceback
                           to stderr and exit 1 without binding.
FAKE_VLLM_FAIL_FOR         served name: FAKE_VLLM_FAIL_AT_START applies to that model only.
FAKE_VLLM_FAIL_TAIL        path: after the start delay print that file (the recorded end of a real vLLM's
                           failed start, tests/fixtures/vllm-start/) to stderr and exit 1 without binding;
                           with FAKE_VLLM_FAIL_FOR, for that model only.
FAKE_VLLM_CRASH_AFTER      int N: the N-th generation request dies with ``os._exit(3)`` once it
                           has produced 2 tokens (mid-stream).
(argument) --fake-invalid*  rejected as vLLM's argparse rejects an unknown argument: usage and
                           ``vllm serve: error: unrecognized arguments: ...`` on stderr, exit 2.
(argument) --lora-modules NAME=PATH ...  (with --enable-lora) served beside the model as vLLM serves
                           LoRA adapters: listed by /v1/models (``parent`` the model, ``root`` the path) and
                           accepted as a request's ``model``. With VLLM_ALLOW_RUNTIME_LORA_UPDATING=True,
                           ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (JSON ``lora_name``,
                           ``lora_path``; plain-text answers) add and remove them, and more than one
                           ``--api-server-count`` is refused at start as vLLM refuses it (exit 1).
(argument) --enable-per-request-metrics  non-streamed answers carry vLLM 0.26's ``metrics``
                           (``time_to_first_token_ms``, ``generation_time_ms``, ``queue_time_ms``,
                           ``mean_itl_ms``, ``tokens_per_second``) from the fake's own clock.
FAKE_VLLM_IGNORE_SIGTERM   1: SIGTERM is ignored (SIG_IGN). SIGINT still stops the server.
FAKE_VLLM_GRANDCHILD       1: spawn a child process (argv[0] "VLLM::EngineCore") in the same
                           process group, standing for the engine core. It inherits stdout/stderr
                           like the real one. Terminated on a graceful exit; survives a SIGKILL of
                           the server.
FAKE_VLLM_PIDFILE          path: the grandchild's pid is written there, the server's own pid to
                           ``<path>.server`` (the latter is written even without a grandchild).
FAKE_VLLM_TOKEN_DELAY      float s (0): delay before each generated token.
FAKE_VLLM_LOCKSTEP         1: every stream's tokens go out on one step clock, as vLLM's engine steps its
                           whole batch at once: a token waits for the next multiple of its delay on the
                           loop's clock, so the running streams write their tokens in the same loop turn
                           (a proxy then reads them together). /_fake/stats ``steps``: the steps that
                           sent a token.
FAKE_VLLM_MAX_NUM_SEQS     int N: at most N generation requests run at once (vLLM's --max-num-seqs);
                           the rest wait in arrival order, or by the body's ``priority`` (lower first,
                           then arrival) with ``--scheduling-policy priority``, as vLLM's scheduler
                           without KV pressure: a running request is never preempted. /metrics shows
                           ``vllm:num_requests_waiting``; /_fake/stats ``running``, ``waiting`` and
                           ``waited`` (requests that ever had to wait).
FAKE_VLLM_STEP_PER_SEQ     float s (0): added to each token's delay per running request (a batch step
                           slows as the batch grows, as on a GPU once compute-bound).
FAKE_VLLM_HANG_AFTER       int N: from the N-th generation request on, generation produces nothing
                           (waits forever); /health stays 200, /metrics shows the requests running
                           while ``vllm:generation_tokens_total`` stops moving.
FAKE_VLLM_UNHEALTHY_FILE   path: while it exists, /health answers 503.
FAKE_VLLM_STALE_PENDING    int N (0): /metrics adds N to ``vllm:num_requests_running`` while generation works as
                           ever: a gauge left stale (an H200 vLLM kept reporting 6 requests pending and no new
                           token after a batch had ended).
FAKE_VLLM_BACKLOG          int (1024): the listen backlog (Linux holds backlog + 1 connections not accepted yet
                           and drops a SYN beyond them; vLLM's uvicorn listens with 2048, vllm-router with 128).
FAKE_VLLM_ACCEPT_EVERY     float s (0): accept one connection per this many seconds (a server too busy to
                           accept faster: its listen queue fills whatever the machine's load).
FAKE_VLLM_TOKEN_IDS        1: a stream's ``return_token_ids`` is answered (Generation, below); else null.
FAKE_VLLM_METRICS_DELAY    float s (0): /metrics answers this long after it is asked (what it shows is read
                           then), as a busy vLLM's does; /_fake/stats ``metrics_asked``: those answers
                           not yet given.
FAKE_VLLM_REASONING_FIELD  ``reasoning`` (default) or ``reasoning_content``.
FAKE_VLLM_EMBED_DIM        int (8): embedding width.
FAKE_VLLM_SLEEP_SECONDS    float s (0.2) / FAKE_VLLM_WAKE_SECONDS (0.3): how long /sleep and /wake_up take.
FAKE_VLLM_SLEEP_GATE       path: /sleep, after its seconds, answers only once this file exists (a test
                           decides how long a sleep lasts, whatever the machine's load).
                           Those endpoints and /is_sleeping exist only with --enable-sleep-mode and
                           VLLM_SERVER_DEV_MODE=1, as in vLLM; /_fake/stats counts sleeps and wakes.
FAKE_VLLM_GPU_LEDGER       path: GPU memory accounting shared by every fake on the machine (a JSON file
                           under flock). At start a fake claims ``--gpu-memory-utilization`` (0.9) of
                           each of its GPUs (``CUDA_VISIBLE_DEVICES``, else the first
                           ``--tensor-parallel-size``); if the claims of live fakes leave too little it
                           fails like vLLM ("Free memory on device ... is less than desired GPU memory
                           utilization") and exits 1. /sleep gives the share back down to
                           FAKE_VLLM_SLEEP_RESIDUE (0.01, vLLM keeps its CUDA context), /wake_up claims
                           it again or answers 500 (CUDA out of memory). The file's ``events`` list
                           records every start, sleep, wake and exit in order, and
                           ``concurrent-start`` when a fake starts while another on the same GPU
                           is still loading (real vLLM then misjudges its KV cache size).
FAKE_VLLM_ACCESS_LOG       1: log one uvicorn-like access line per request (off by default, so a
                           parent that does not drain stderr cannot block the fake).
FAKE_VLLM_LOG_MAX          int (10000): how many requests /_fake/requests keeps (newest).
FAKE_VLLM_PREFIX_CACHE_BLOCKS  int (4096): blocks of 16 prompt words the prefix cache holds (least recently
                           used leave first); /metrics counts ``vllm:prefix_cache_queries_total`` and
                           ``_hits_total`` in words as vLLM does in tokens (leading full blocks seen before).
                           A generation request's ``cache_salt`` enters its first block's hash, as in vLLM:
                           requests with different salts share no block. A salt vLLM refuses (not a non-empty
                           string; with 0.32, over 128 characters or with '@', '/', '\\' or NUL) is its 400.
FAKE_VLLM_REPLAY           dir: a request that has a recording there (tests/vllm_replay.py, made by
                           benchmarks/tool_model/record.py on real vLLM) gets the recorded status,
                           content type and body byte for byte; any other request is generated as below.

Generation (deterministic)
--------------------------
Prompt tokens are whitespace-split words (chat: all message contents joined, each image/audio part
counts as 1). Output tokens are ``"tok0 "``, ``"tok1 "``, ...; natural length 8, or N with the
marker ``[[tokens:N]]``. ``max_tokens`` (completions default 16, chat default max_model_len - P)
cuts with finish ``length``; ``ignore_eos`` generates exactly max_tokens; ``stop`` strings equal to a
stripped token stop before it (finish ``stop``, ``stop_reason`` = the string).
Token ids (with FAKE_VLLM_TOKEN_IDS=1, a stream's ``return_token_ids`` as vLLM 0.32 answers it: the
prompt's in the first chunk, each token's in its chunk; else null, as vLLM 0.26): a prompt word's id is its CRC-32 below 100,000, the marker ``[[tokens:N]]`` 400,000 + N,
output token ``"tokI "`` 100,000 + I (any other event 300,000 + its index). A ``/v1/completions``
prompt of token ids ending in output ids continues the answer there: after ``tokI`` comes
``tok(I+1)``, up to the marker's N (what vllama's resume sends another engine: ``api/request/resume.py``).
``response_format`` json_object/json_schema (or ``structured_outputs``/``guided_json``) gives
``{"ok": true}`` as two tokens. Chat with ``chat_template_kwargs.enable_thinking`` true first emits
3 reasoning tokens ``"think0 "`` .. ``"think2 "``. Chat with ``tools`` and ``[[tool]]`` /
``[[tools:N]]`` in the last user message answers with N tool calls, arguments
``{"city": "Paris", "n": i}`` streamed in 4 fragments, finish ``tool_calls``; once a ``tool``
message follows that user message, the answer is text again (a client's tool loop ends). With thinking on, a
``"\n\n"`` content token (what qwen3's reasoning parser passes on after ``</think>``) comes between the
reasoning and the first tool call (non-streamed: content stays null).
A ``json_schema`` response format (or ``structured_outputs.json`` / ``guided_json``) whose schema
has a ``type`` outside JSON Schema's seven (e.g. ``"no-such-type"``) fails like xgrammar in vLLM:
400 ``{"error": {"message": "Grammar error: Invalid type: no-such-type", "type": "BadRequestError",
"param": null, "code": 400}}``; streamed, a 200 whose only event is that error, then ``[DONE]``.

Shapes (as recorded from vLLM 0.26.0, tests/fixtures/vllm-0.26): bodies carry ``service_tier``,
``system_fingerprint`` (``vllm-0.26.0-nohash``), ``prompt_token_ids``, ``prompt_text`` (chat),
``ec_transfer_params``, ``metrics``, and per choice ``token_ids``, ``routed_experts`` (all null
but the fingerprint); ``message.tool_calls`` only when there are calls. Streams: the chat role
chunk carries ``prompt_token_ids``/``prompt_text``; token chunks carry ``token_ids`` (chat: no
``stop_reason``); tool deltas carry ``content: null`` and the tool start has no ``arguments``;
the finish comes in a chunk of its own with an empty delta (``text: ""`` for completions), except
a ``length`` finish, which rides on the last token; no chunk has a ``usage`` key except the final
usage chunk (``include_usage``), which also has ``system_fingerprint``. A request that fails
pydantic validation (``messages`` not a list, ``model`` not a string) gets FastAPI's shape:
type ``"Bad Request"``, param ``"body.<field>"``.

Fault markers anywhere in the prompt / message contents:
``[[fault:http400]]`` (context-length 400), ``[[fault:http500]]``, ``[[fault:reset]]`` (2 tokens then
the connection is closed without ending the body), ``[[fault:garbage]]`` (2 tokens, then
``data: {not json`` and the body ends without [DONE]), ``[[fault:hang]]`` (2 tokens then nothing until
the client leaves), ``[[fault:hangatend]]`` (every token, then nothing until the
client leaves), ``[[fault:slow]]`` (0.2 s per token), ``[[fault:nullevent]]`` (2 tokens, then
``data: null``, valid JSON but not an object; streamed only), ``[[fault:nofinish]]`` (2 tokens, then
``data: [DONE]`` with no finish reason before it; streamed only).

A generation request while asleep fails with 500 (counted as ``while_asleep`` in the stats): the
proxy must wake a model before using it.

Test hooks: ``GET/DELETE /_fake/requests`` (each ``/v1/*`` request's method, path, body, headers and
``arrived``: ``time.monotonic()`` when its headers were read, one clock for every process of the
machine), ``GET /_fake/stats``
(``{"started", "completed", "aborted", "failed", "in_flight", "while_asleep", ...}``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import heapq
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time
import uuid
import zlib
from typing import Any

import orjson
from aiohttp import web

#: The vLLM version whose shapes it emits: 0.26.0 (default), or 0.32.0 (``FAKE_VLLM_VERSION``),
#: which adds ``usage.completion_tokens_details`` (tests/fixtures/vllm-0.32).
VLLM_VERSION = os.environ.get("FAKE_VLLM_VERSION") or "0.26.0"
V032 = tuple(int(x) for x in VLLM_VERSION.split(".")[:2]) >= (0, 32)


def _details(usage: dict[str, Any], chat: bool, events: list) -> dict[str, Any]:
    """vLLM 0.32's ``completion_tokens_details``: the reasoning tokens of a chat answer, null
    for completions and embeddings; nothing before 0.32."""
    if V032:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(1 for e in events if e[0] == "r")} if chat else None
    return usage
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-nohash"

_RE_TOKENS = re.compile(r"\[\[tokens:(\d+)\]\]")
_RE_FAULT = re.compile(r"\[\[fault:([a-z0-9_]+)\]\]")
#: Token ids (``return_token_ids``): output token I is _OUT_ID + I, the marker [[tokens:N]] _MARK_ID + N.
_OUT_ID, _OTHER_ID, _MARK_ID = 100_000, 300_000, 400_000


def word_id(word: str) -> int:
    """A prompt word's token id: the length marker keeps its N, any other word its CRC-32 below _OUT_ID."""
    m = _RE_TOKENS.fullmatch(word)
    return _MARK_ID + int(m[1]) if m else zlib.crc32(word.encode()) % _OUT_ID


def event_id(ev: tuple, i: int) -> int:
    """An output event's token id: ``"tokI "`` is _OUT_ID + I, any other the index's."""
    if ev[0] == "c" and ev[1].startswith("tok") and ev[1][3:-1].isdigit():
        return _OUT_ID + int(ev[1][3:-1])
    return _OTHER_ID + i
_RE_TOOLS = re.compile(r"\[\[tools:(\d+)\]\]")
_TOOL_MARK = "[[tool]]"

CONTEXT_400_MSG = (
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "in the messages, Please reduce the length of the messages."
)
ENGINE_500_MSG = "EngineCore encountered an issue"

_GRANDCHILD_CODE = (
    "import ctypes, time\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(15, b'VLLM::EngineCor', 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "time.sleep(100000)\n"
)


# --------------------------------------------------------------------------- logging


def log(level: str, msg: str, where: str = "api_server.py:1") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    sys.stderr.write(f"{level} {stamp} [{where}] {msg}\n")
    sys.stderr.flush()


def raw_log(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- knobs


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name, "")
    try:
        return float(v) if v.strip() else default
    except ValueError:
        return default


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "")
    try:
        return int(v) if v.strip() else None
    except ValueError:
        return None


class Knobs:
    def __init__(self) -> None:
        env = os.environ
        self.start_delay = _env_float("FAKE_VLLM_START_DELAY", 0.0)
        self.start_gate = env.get("FAKE_VLLM_START_GATE") or None
        self.fail_at_start = env.get("FAKE_VLLM_FAIL_AT_START") or None
        self.fail_for = env.get("FAKE_VLLM_FAIL_FOR") or None
        self.fail_tail = env.get("FAKE_VLLM_FAIL_TAIL") or None
        self.crash_after = _env_int("FAKE_VLLM_CRASH_AFTER")
        self.ignore_sigterm = env.get("FAKE_VLLM_IGNORE_SIGTERM", "") not in ("", "0", "false")
        self.grandchild = env.get("FAKE_VLLM_GRANDCHILD", "") not in ("", "0", "false")
        self.pidfile = env.get("FAKE_VLLM_PIDFILE") or None
        self.token_delay = _env_float("FAKE_VLLM_TOKEN_DELAY", 0.0)
        self.hang_after = _env_int("FAKE_VLLM_HANG_AFTER")
        self.unhealthy_file = env.get("FAKE_VLLM_UNHEALTHY_FILE") or None
        self.reasoning_field = env.get("FAKE_VLLM_REASONING_FIELD") or "reasoning"
        self.embed_dim = _env_int("FAKE_VLLM_EMBED_DIM") or 8
        self.access_log = env.get("FAKE_VLLM_ACCESS_LOG", "") not in ("", "0", "false")
        self.log_max = _env_int("FAKE_VLLM_LOG_MAX") or 10000
        self.sleep_seconds = _env_float("FAKE_VLLM_SLEEP_SECONDS", 0.2)
        self.metrics_delay = _env_float("FAKE_VLLM_METRICS_DELAY", 0.0)
        self.sleep_gate = env.get("FAKE_VLLM_SLEEP_GATE") or None
        self.wake_seconds = _env_float("FAKE_VLLM_WAKE_SECONDS", 0.3)
        self.gpu_ledger = env.get("FAKE_VLLM_GPU_LEDGER") or None
        self.sleep_residue = _env_float("FAKE_VLLM_SLEEP_RESIDUE", 0.01)
        self.prefix_cache_blocks = _env_int("FAKE_VLLM_PREFIX_CACHE_BLOCKS") or 4096
        self.max_num_seqs = _env_int("FAKE_VLLM_MAX_NUM_SEQS")
        self.step_per_seq = _env_float("FAKE_VLLM_STEP_PER_SEQ", 0.0)
        self.lockstep = env.get("FAKE_VLLM_LOCKSTEP", "") not in ("", "0", "false")
        self.backlog = _env_int("FAKE_VLLM_BACKLOG") or 1024
        self.stale_pending = _env_int("FAKE_VLLM_STALE_PENDING") or 0
        self.accept_every = _env_float("FAKE_VLLM_ACCEPT_EVERY", 0.0)
        self.token_ids = env.get("FAKE_VLLM_TOKEN_IDS", "") not in ("", "0", "false")


class Scheduler:
    """vLLM's running slots without KV pressure (FAKE_VLLM_MAX_NUM_SEQS): ``slots`` run, the rest wait
    in a heap by (priority when ``by_priority``, arrival); a running request is never preempted."""

    def __init__(self, slots: int | None, by_priority: bool) -> None:
        self.slots = slots
        self.by_priority = by_priority
        self.running = 0
        self.waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self.seq = 0
        self.waited = 0  # requests that found every slot taken

    async def acquire(self, priority: Any) -> None:
        if self.slots is None:
            self.running += 1
            return
        if self.running < self.slots and not self.waiting:
            self.running += 1
            return
        self.waited += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        prio = priority if self.by_priority and isinstance(priority, int) else 0
        heapq.heappush(self.waiting, (prio, self.seq, fut))
        self.seq += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            raise

    def release(self) -> None:
        self.running -= 1
        while self.waiting and (self.slots is None or self.running < self.slots):
            _, _, fut = heapq.heappop(self.waiting)
            if fut.cancelled():
                continue
            self.running += 1
            fut.set_result(None)

    @property
    def n_waiting(self) -> int:
        return sum(1 for _, _, f in self.waiting if not f.done())


class GpuLedger:
    """GPU memory shares claimed by the fakes on this machine (see FAKE_VLLM_GPU_LEDGER)."""

    def __init__(self, path: str, name: str, gpus: list[int], share: float) -> None:
        self.path, self.name, self.gpus, self.share = path, name, gpus, share

    def _locked(self, change: Any) -> Any:
        import fcntl

        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(self.path) as f:
                    data = json.load(f)
            except (FileNotFoundError, ValueError):
                data = {"claims": {}, "events": []}
            for pid in list(data["claims"]):  # a fake killed with SIGKILL frees its memory too
                try:
                    os.kill(int(pid), 0)
                except ProcessLookupError:
                    del data["claims"][pid]
                except PermissionError:
                    pass
            result = change(data)
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
            return result

    def claim(self, share: float, event: str) -> str | None:
        """Claim ``share`` of each GPU; the error text when the others leave too little."""
        def change(data: dict) -> str | None:
            for gpu in self.gpus:
                used = sum(c["share"] for pid, c in data["claims"].items() if pid != str(os.getpid()) and gpu in c["gpus"])
                if used + share > 1.0 + 1e-9:
                    total = 139.8
                    return (f"Free memory on device cuda:{gpu} ({(1 - used) * total:.2f}/{total} GiB) on startup is less "
                            f"than desired GPU memory utilization ({share}, {share * total:.2f} GiB). Decrease GPU memory "
                            "utilization or reduce GPU memory used by other processes.")
            starting = event == "start"
            if starting and any(c.get("starting") and set(c["gpus"]) & set(self.gpus) for c in data["claims"].values()):
                # real vLLM would misprofile here (each counts the other's allocations as its own)
                data["events"].append(["concurrent-start", self.name])
            data["claims"][str(os.getpid())] = {"name": self.name, "gpus": self.gpus, "share": share, "starting": starting}
            data["events"].append([event, self.name])
            return None
        return self._locked(change)

    def started(self) -> None:
        """Loading is over (the port is bound): no longer profiling memory."""
        def change(data: dict) -> None:
            claim = data["claims"].get(str(os.getpid()))
            if claim is not None:
                claim["starting"] = False
        self._locked(change)

    def release(self, keep: float, event: str) -> None:
        """Hold only ``keep`` of each GPU from now on (0: gone)."""
        def change(data: dict) -> None:
            if keep > 0:
                data["claims"][str(os.getpid())] = {"name": self.name, "gpus": self.gpus, "share": keep}
            else:
                data["claims"].pop(str(os.getpid()), None)
            data["events"].append([event, self.name])
        self._locked(change)


class State:
    def __init__(self, model: str, served: list[str], max_model_len: int, api_key: str | None,
                 knobs: Knobs) -> None:
        self.model = model
        self.served = served
        self.loras: dict[str, str] = {}  # LoRA adapters served beside the model: name -> path
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.knobs = knobs
        self.pooling = False
        self.created = int(time.time())
        self.requests: collections.deque[dict[str, Any]] = collections.deque(maxlen=knobs.log_max)
        self.started = 0
        self.completed = 0
        self.aborted = 0
        self.failed = 0
        self.in_flight = 0
        self.sleep_mode = False
        self.per_request_metrics = False  # --enable-per-request-metrics: non-streamed bodies carry "metrics"
        self.sleeping = 0  # 0 awake, else the sleep level
        self.sleeps = 0
        self.metrics_asked = 0
        self.wakes = 0
        self.while_asleep = 0
        self.ledger: GpuLedger | None = None
        self.generation_tokens_total = 0
        self.steps: set[int] = set()  # FAKE_VLLM_LOCKSTEP: the steps that sent a token
        self.sched = Scheduler(knobs.max_num_seqs, by_priority=False)
        self.prompt_tokens_total = 0
        self.prefix_cache = PrefixCache(knobs.prefix_cache_blocks)


class PrefixCache:
    """vLLM's automatic prefix caching, counted as vLLM counts it: a prompt's full blocks of
    ``BLOCK`` tokens (words here), each named by the hash of everything up to its end; the
    leading blocks already cached are hits. ``queries``/``hits`` in tokens, as
    ``vllm:prefix_cache_queries``/``_hits``; least recently used blocks leave a full cache."""

    BLOCK = 16

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.queries = 0
        self.hits = 0

    def query(self, words: list[str], salt: str | None = None) -> None:
        self.queries += len(words)
        h, hitting = (hash(("cache_salt", salt)) if salt else 0), True  # vLLM: the salt in the first block's hash
        for i in range(len(words) // self.BLOCK):
            h = hash((h, *words[i * self.BLOCK:(i + 1) * self.BLOCK]))
            if hitting and h in self.blocks:
                self.hits += self.BLOCK
                self.blocks.move_to_end(h)
                continue
            hitting = False
            self.blocks[h] = None
            if len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)


STATE_KEY = web.AppKey("state", State)


# --------------------------------------------------------------------------- helpers


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or {
            400: "BadRequestError",
            401: "UnauthorizedError",
            404: "NotFoundError",
            500: "InternalServerError",
            503: "ServiceUnavailableError",
        }.get(status, "BadRequestError")
        self.param = param


class GrammarError(ApiError):
    """xgrammar rejected the request's schema. vLLM 0.26 answers 400 unstreamed, but a stream
    has already begun (200): ``data: {"error": ...}`` then ``data: [DONE]``."""

    def __init__(self, message: str) -> None:
        super().__init__(400, f"Grammar error: {message}", "BadRequestError")


def error_response(status: int, message: str, err_type: str | None = None,
                   param: str | None = None) -> web.Response:
    e = ApiError(status, message, err_type, param)
    body = {"error": {"message": e.message, "type": e.err_type, "param": e.param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def read_body(request: web.Request) -> dict[str, Any]:
    parsed = request.get("fake_parsed")
    if parsed is None:
        raw = await request.read()
        parsed = _parse(raw)
    ok, body = parsed
    if not ok:
        raise ApiError(400, f"JSON decode error: {body}")
    if not isinstance(body, dict):
        raise ApiError(400, "Input should be a valid dictionary or object to extract fields from")
    return body


def _parse(raw: bytes) -> tuple[bool, Any]:
    if not raw:
        return False, "Expecting value: line 1 column 1 (char 0)"
    try:
        return True, orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return False, str(e)


def runtime_lora() -> bool:
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``vllm/envs.py``: "1" or "true", any case)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def check_model(state: State, body: dict[str, Any]) -> str:
    if state.sleeping:  # vLLM's engine has no weights or KV cache while asleep
        state.while_asleep += 1
        raise ApiError(500, "The engine is sleeping; wake it up first (POST /wake_up).", "InternalServerError")
    model = body.get("model")
    if model is None or model == "":
        return state.served[0]
    if not isinstance(model, str):  # vLLM's request model (pydantic) rejects it before any lookup
        raise validation_error("model", "string_type", "Input should be a valid string", model)
    if model not in state.served and model not in state.loras:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return model


def validation_error(field: str, kind: str, msg: str, value: Any) -> ApiError:
    """FastAPI/pydantic's request validation error as vLLM 0.26 answers it (type "Bad Request")."""
    detail = {"type": kind, "loc": ("body", field), "msg": msg, "input": value}
    return ApiError(400, f"1 validation error:\n  {detail!r}", "Bad Request", f"body.{field}")


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _bad_schema_type(schema: Any) -> str | None:
    """The first ``type`` in a JSON schema that xgrammar does not know (None: all known)."""
    if isinstance(schema, dict):
        t = schema.get("type")
        for one in (t if isinstance(t, list) else [t]):
            if isinstance(one, str) and one not in _SCHEMA_TYPES:
                return one
        for k, v in schema.items():
            if k in ("enum", "const", "default", "examples", "required"):
                continue
            bad = _bad_schema_type(v)
            if bad is not None:
                return bad
    elif isinstance(schema, list):
        for v in schema:
            bad = _bad_schema_type(v)
            if bad is not None:
                return bad
    return None


def _check_grammar(body: dict[str, Any]) -> None:
    schemas: list[Any] = []
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
        schemas.append(rf["json_schema"].get("schema"))
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        schemas.append(so.get("json"))
    schemas.append(body.get("guided_json"))
    for schema in schemas:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                continue
        bad = _bad_schema_type(schema)
        if bad is not None:
            raise GrammarError(f"Invalid type: {bad}")


def _opt_int(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ApiError(400, f"Input should be a valid integer: {name}", param=name)
        if v < 0:
            raise ApiError(400, f"{name} must be at least 0, got {v}.", param=name)
        return v
    return None


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str)]
    raise ApiError(400, "stop must be a string or a list of strings", param="stop")


def _wants_json(body: dict[str, Any]) -> bool:
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        return True
    so = body.get("structured_outputs")
    if isinstance(so, dict) and (so.get("json") is not None or so.get("json_object")):
        return True
    return body.get("guided_json") is not None


def _content_text(content: Any) -> tuple[str, int]:
    """Text of an OpenAI message content and its count of non-text parts."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    if isinstance(content, list):
        texts: list[str] = []
        extra = 0
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                if part.get("type") == "text" or ("text" in part and "type" not in part):
                    t = part.get("text")
                    if isinstance(t, str):
                        texts.append(t)
                else:
                    extra += 1  # image_url / input_audio / video_url ...
        return " ".join(texts), extra
    raise ApiError(400, "message content must be a string or a list of parts", param="messages")


# --------------------------------------------------------------------------- generation plan


class Plan:
    """What a request will generate: a list of events, its finish reason and stop reason.

    Events: ("r", text) reasoning, ("c", text) content, ("ts", index, id, name) tool call start,
    ("ta", index, fragment) tool call argument fragment.
    """

    def __init__(self, events: list[tuple], finish: str, stop_reason: str | None,
                 prompt_tokens: int, faults: set[str], words: list[str] | None = None,
                 ids: list[int] | None = None) -> None:
        self.words = words or []  # the prompt's tokens, for the prefix cache
        self.ids = ids if ids is not None else [word_id(w) for w in self.words]  # the prompt's token ids
        self.salt: str | None = None  # the request's cache_salt, for the prefix cache
        self.token_ids = False  # the request's return_token_ids
        self.events = events
        self.finish = finish
        self.stop_reason = stop_reason
        self.prompt_tokens = prompt_tokens
        self.faults = faults


def _content_tokens(text: str, max_tokens: int, ignore_eos: bool, stops: list[str],
                    json_mode: bool, start: int = 0) -> tuple[list[str], str, str | None]:
    """The answer's tokens from ``tok<start>`` on (``start``: output tokens already in the prompt)."""
    if json_mode:
        natural = ['{"ok":', " true}"]
    else:
        m = _RE_TOKENS.findall(text)
        n = (int(m[-1]) if m else 8) - start
        if ignore_eos:
            n = max_tokens
        natural = [f"tok{start + i} " for i in range(max(0, min(n, max_tokens + 1)))]
    stop_at = None
    stop_reason = None
    if stops:
        for i, tok in enumerate(natural):
            if tok.strip() in stops:
                stop_at, stop_reason = i, tok.strip()
                break
    if stop_at is not None and stop_at < max_tokens:
        return natural[:stop_at], "stop", stop_reason
    if len(natural) > max_tokens or (ignore_eos and not json_mode):
        return natural[:max_tokens], "length", None
    return natural, "stop", None


def _validate_len(state: State, prompt_tokens: int, max_tokens: int | None) -> None:
    mml = state.max_model_len
    if prompt_tokens >= mml:
        raise ApiError(
            400,
            f"This model's maximum context length is {mml} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            param="input_tokens")
    if max_tokens is not None and prompt_tokens + max_tokens > mml:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {mml} tokens and your request has {prompt_tokens} input "
            f"tokens ({max_tokens} > {mml} - {prompt_tokens}).",
            param="max_tokens")


def _fault_errors(faults: set[str]) -> None:
    if "http400" in faults:
        raise ApiError(400, CONTEXT_400_MSG)
    if "http500" in faults:
        raise ApiError(500, ENGINE_500_MSG, "InternalServerError")


def plan_completion(state: State, body: dict[str, Any]) -> Plan:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    start = 0
    if isinstance(prompt, str):
        text = prompt
        ptoks = len(prompt.split())
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # token ids: the length marker read back; output ids at the end continue the answer after them
        text = " ".join(f"[[tokens:{t - _MARK_ID}]]" for t in prompt if t >= _MARK_ID)
        ptoks = len(prompt)
        while start < len(prompt) and _OUT_ID <= prompt[-1 - start] < _OTHER_ID:
            start += 1
    elif prompt is None:
        raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.",
                       param="prompt")
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a one-element list "
                            "(batched prompts are not supported by the fake)", param="prompt")
    faults = set(_RE_FAULT.findall(text))
    _fault_errors(faults)
    # vLLM 0.26: an absent or null max_tokens is 16 for completions (measured on the H200).
    mt = _opt_int(body, "max_tokens")
    if mt is None:
        mt = 16
    _validate_len(state, ptoks, mt)
    _check_grammar(body)
    toks, finish, stop_reason = _content_tokens(
        text, mt, bool(body.get("ignore_eos")), _stops(body), _wants_json(body), start)
    if isinstance(prompt, str):
        return Plan([("c", t) for t in toks], finish, stop_reason, ptoks, faults, text.split())
    return Plan([("c", t) for t in toks], finish, stop_reason, ptoks, faults, [str(t) for t in prompt],
                list(prompt))


def plan_chat(state: State, body: dict[str, Any]) -> Plan:
    messages = body.get("messages")
    if not isinstance(messages, list):
        if "messages" not in body:
            raise validation_error("messages", "missing", "Field required", body)
        raise validation_error("messages", "list_type", "Input should be a valid list", messages)
    if not messages:
        raise ApiError(400, "messages: Field required (a non-empty list)", param="messages")
    texts: list[str] = []
    extra = 0
    last_user = ""
    answered = False  # a tool result after the last user message: answer in words, as a model does
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message must be an object with a role", param="messages")
        t, x = _content_text(m.get("content"))
        extra += x
        texts.append(t)
        if m["role"] == "user":
            last_user = t
            answered = False
        elif m["role"] == "tool":
            answered = True
    text = " ".join(texts)
    ptoks = len(text.split()) + extra
    faults = set(_RE_FAULT.findall(text))
    _fault_errors(faults)
    asked = _opt_int(body, "max_completion_tokens", "max_tokens")
    _validate_len(state, ptoks, asked)
    mt = asked if asked is not None else state.max_model_len - ptoks
    _check_grammar(body)

    events: list[tuple] = []
    kwargs = body.get("chat_template_kwargs")
    thinking = isinstance(kwargs, dict) and bool(
        kwargs.get("enable_thinking") or kwargs.get("thinking"))
    if thinking:
        events.extend(("r", f"think{i} ") for i in range(min(3, mt)))
        if mt < 3:
            return Plan(events, "length", None, ptoks, faults, text.split())

    tools = body.get("tools")
    n_calls = 0
    if isinstance(tools, list) and tools and body.get("tool_choice") != "none" and not answered:
        m = _RE_TOOLS.findall(last_user)
        if m:
            n_calls = int(m[-1])
        elif _TOOL_MARK in last_user:
            n_calls = 1
    if n_calls:
        if thinking:  # qwen3's reasoning parser passes on the "\n\n" after </think> as content
            events.append(("c", "\n\n"))
        for i in range(n_calls):
            tool = tools[i] if i < len(tools) else tools[0]
            fn = tool.get("function") if isinstance(tool, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            events.append(("ts", i, f"chatcmpl-tool-{uuid.uuid4().hex}", name or "tool"))
            for frag in ('{"city": ', '"Paris"', ', "n": ', f"{i}}}"):
                events.append(("ta", i, frag))
        return Plan(events, "tool_calls", None, ptoks, faults, text.split())

    toks, finish, stop_reason = _content_tokens(
        text, mt - len(events), bool(body.get("ignore_eos")), _stops(body), _wants_json(body))
    events.extend(("c", t) for t in toks)
    return Plan(events, finish, stop_reason, ptoks, faults, text.split())


# --------------------------------------------------------------------------- token producer

_FOREVER = 10**9


async def produce(state: State, plan: Plan, seq: int):
    """Yield plan events with delays; yields ("fault", name) in place of the rest on a fault."""
    knobs = state.knobs
    if knobs.hang_after is not None and seq >= knobs.hang_after:
        await asyncio.sleep(_FOREVER)
    delay = 0.2 if "slow" in plan.faults else knobs.token_delay
    step = knobs.step_per_seq
    fault = next((f for f in ("reset", "garbage", "hang", "nullevent", "nofinish") if f in plan.faults), None)
    crash = knobs.crash_after is not None and seq == knobs.crash_after
    cut = min(2, len(plan.events))
    if "hangatend" in plan.faults:  # every token, then nothing until the client leaves (no finish, no [DONE])
        fault, cut = "hang", len(plan.events)
    last_tick = 0  # lockstep: one token per step (a timer may fire a little early, inside the step it waited for)
    for i, ev in enumerate(plan.events):
        if i == cut:
            if crash:
                yield ("crash",)
            if fault:
                yield ("fault", fault)
                return
        pause = delay + step * state.sched.running
        if pause > 0 and knobs.lockstep:
            loop = asyncio.get_running_loop()
            now = loop.time()
            tick = last_tick = max(int(now / pause) + 1, last_tick + 1)
            await asyncio.sleep(tick * pause - now)
            state.steps.add(tick)
        elif pause > 0:
            await asyncio.sleep(pause)
        else:
            await asyncio.sleep(0)
        state.generation_tokens_total += 1
        yield ev
    if cut == len(plan.events):
        if crash:
            yield ("crash",)
        if fault:
            yield ("fault", fault)


def die_now() -> None:
    log("ERROR", "EngineCore encountered a fatal error. (FAKE_VLLM_CRASH_AFTER)", "core.py:1")
    os._exit(3)


async def hang_forever() -> None:
    await asyncio.sleep(_FOREVER)


# --------------------------------------------------------------------------- handlers


class Tracker:
    """started/completed/aborted/failed/in_flight bookkeeping for one generation request."""

    def __init__(self, state: State, plan: Plan) -> None:
        self.state = state
        state.started += 1
        state.in_flight += 1
        state.prompt_tokens_total += plan.prompt_tokens
        state.prefix_cache.query(plan.words, plan.salt)
        self.seq = state.started
        self.done = False

    def finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        s = self.state
        s.in_flight -= 1
        setattr(s, outcome, getattr(s, outcome) + 1)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _start_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    return resp


async def _close_transport(request: web.Request) -> None:
    tr = request.transport
    if tr is not None:
        tr.close()
    await asyncio.sleep(0)


async def handle_generation(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    stream = False
    try:
        body = await read_body(request)
        model = check_model(state, body)
        stream = bool(body.get("stream"))
        plan = plan_chat(state, body) if chat else plan_completion(state, body)
        plan.salt = _cache_salt(body)
        plan.token_ids = state.knobs.token_ids and bool(body.get("return_token_ids"))
        so = body.get("stream_options")
        include_usage = stream and isinstance(so, dict) and bool(so.get("include_usage"))
    except GrammarError as e:
        if not stream:
            return error_response(e.status, e.message, e.err_type, e.param)
        # vLLM 0.26: the stream has begun (200) when xgrammar fails: one error event, then [DONE]
        resp = await _start_stream(request)
        err = {"error": {"message": e.message, "type": e.err_type, "param": e.param, "code": e.status}}
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    except ApiError as e:
        return error_response(e.status, e.message, e.err_type, e.param)

    await state.sched.acquire(body.get("priority", 0))  # a running slot (FAKE_VLLM_MAX_NUM_SEQS)
    try:
        tracker = Tracker(state, plan)
        try:
            if stream:
                return await _stream(request, state, plan, tracker, model, chat, include_usage)
            return await _non_stream(request, state, plan, tracker, model, chat)
        except asyncio.CancelledError:
            tracker.finish("aborted")
            raise
        except ConnectionResetError:
            # The client went away while we were writing; aiohttp swallows the failed write of this.
            tracker.finish("aborted")
            return web.Response(status=499)
        finally:
            # Any other exit (an unexpected exception) still leaves in_flight right.
            tracker.finish("failed")
    finally:
        state.sched.release()


async def _stream(request: web.Request, state: State, plan: Plan, tracker: Tracker, model: str,
                  chat: bool, include_usage: bool) -> web.StreamResponse:
    """vLLM 0.26's chunks: a role chunk (chat), one chunk per token, the finish in a chunk of its
    own with an empty delta (the end-of-sequence token; a ``length`` finish rides on the last
    token), then the usage chunk (``include_usage``) and ``[DONE]``. No ``usage`` key elsewhere."""
    created = int(time.time())
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    obj = "chat.completion.chunk" if chat else "text_completion"
    rfield = state.knobs.reasoning_field
    n = len(plan.events)
    merge_finish = plan.finish == "length" and n > 0
    resp = await _start_stream(request)
    sent_role = False
    count = 0
    ids = plan.token_ids

    def first_ids() -> list[int] | None:
        """The prompt's token ids, in the first chunk only (``return_token_ids``)."""
        nonlocal ids
        if not ids:
            return None
        ids = False
        return plan.ids

    def chunk(choice: dict[str, Any], **top: Any) -> bytes:
        return _sse({"id": rid, "object": obj, "created": created, "model": model,
                     "choices": [choice], **top})

    async def send_role() -> None:
        await resp.write(chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None},
                               prompt_token_ids=first_ids(), prompt_text=None))

    def finish_fields(last: bool) -> dict[str, Any]:
        if not last:
            return {"finish_reason": None} if chat else {"finish_reason": None, "stop_reason": None}
        return {"finish_reason": plan.finish, "stop_reason": plan.stop_reason}

    async for ev in produce(state, plan, tracker.seq):
        kind = ev[0]
        if kind == "crash":
            die_now()
        if kind == "fault":
            name = ev[1]
            if name == "hang":
                await hang_forever()
            tracker.finish("failed")
            if name == "reset":
                await _close_transport(request)
                return resp
            if name == "nofinish":
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            # garbage: an unparsable event, then the body ends without [DONE]
            await resp.write(b"data: null\n\n" if name == "nullevent" else b"data: {not json\n\n")
            await resp.write_eof()
            return resp
        count += 1
        last = merge_finish and count == n
        tid = [event_id(ev, count - 1)] if plan.token_ids else None
        if chat:
            if not sent_role:
                sent_role = True
                await send_role()
            if kind == "r":
                delta: dict[str, Any] = {rfield: ev[1]}
            elif kind == "c":
                delta = {"content": ev[1]}
            elif kind == "ts":  # hermes' tool start: no arguments key yet
                delta = {"content": None, "tool_calls": [{"id": ev[2], "type": "function", "index": ev[1],
                                                          "function": {"name": ev[3]}}]}
            else:
                delta = {"content": None, "tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}
            await resp.write(chunk({"index": 0, "delta": delta, "logprobs": None,
                                    **finish_fields(last), "token_ids": tid}))
        else:
            await resp.write(chunk({"index": 0, "text": ev[1], "logprobs": None, **finish_fields(last),
                                    "prompt_token_ids": first_ids(), "token_ids": tid}))
    if not merge_finish:
        if chat:
            if not sent_role:
                await send_role()
            await resp.write(chunk({"index": 0, "delta": {}, "logprobs": None,
                                    **finish_fields(True), "token_ids": [] if plan.token_ids else None}))
        else:
            await resp.write(chunk({"index": 0, "text": "", "logprobs": None, **finish_fields(True),
                                    "prompt_token_ids": first_ids(), "token_ids": [] if plan.token_ids else None}))
    if include_usage:
        p = plan.prompt_tokens
        await resp.write(_sse({
            "id": rid, "object": obj, "created": created, "model": model, "choices": [],
            # 0.32 adds the details to a chat stream's usage only (not to a completion stream's)
            "usage": (_details if chat else lambda u, *_: u)({"prompt_tokens": p, "total_tokens": p + n,
                                                              "completion_tokens": n}, chat, plan.events),
            "system_fingerprint": SYSTEM_FINGERPRINT}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    tracker.finish("completed")
    return resp


async def _non_stream(request: web.Request, state: State, plan: Plan, tracker: Tracker,
                      model: str, chat: bool) -> web.StreamResponse:
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    queued = time.monotonic()
    first = last = 0.0
    async for ev in produce(state, plan, tracker.seq):
        kind = ev[0]
        if kind in ("r", "c", "ts", "ta"):
            last = time.monotonic()
            first = first or last
        if kind == "crash":
            die_now()
        elif kind == "fault":
            name = ev[1]
            if name == "hang":
                await hang_forever()
            tracker.finish("failed")
            if name == "reset":
                await _close_transport(request)
                return web.Response(status=200)
            return web.Response(status=200, body=b"{not json", content_type="application/json")
        elif kind == "r":
            reasoning.append(ev[1])
        elif kind == "c":
            content.append(ev[1])
        elif kind == "ts":
            calls.append({"id": ev[2], "type": "function",
                          "function": {"name": ev[3], "arguments": ""}})
        else:
            calls[ev[1]]["function"]["arguments"] += ev[2]
    n = len(plan.events)
    p = plan.prompt_tokens
    usage = _details({"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n,
                      "prompt_tokens_details": None}, chat, plan.events)
    created = int(time.time())
    if chat:
        text = "".join(content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if (calls or (reasoning and not content)) else text,
            "refusal": None, "annotations": None, "audio": None, "function_call": None,
        }
        if calls:  # vLLM 0.26 leaves the key out when there are none
            message["tool_calls"] = calls
        message[state.knobs.reasoning_field] = "".join(reasoning) if reasoning else None
        out = {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion",
               "created": created, "model": model,
               "choices": [{"index": 0, "message": message, "logprobs": None,
                            "finish_reason": plan.finish, "stop_reason": plan.stop_reason,
                            "token_ids": None, "routed_experts": None}],
               "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
               "usage": usage, "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
               "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    else:
        out = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion",
               "created": created, "model": model,
               "choices": [{"index": 0, "text": "".join(content), "logprobs": None,
                            "finish_reason": plan.finish, "stop_reason": plan.stop_reason,
                            "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                            "routed_experts": None}],
               "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
               "usage": usage, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    if state.per_request_metrics:  # vLLM 0.26 --enable-per-request-metrics (build_per_request_timing_metrics)
        out["metrics"] = {
            "time_to_first_token_ms": (first - queued) * 1000 if first else None,
            "generation_time_ms": (last - first) * 1000 if first else None,
            "queue_time_ms": 0.0,
            "mean_itl_ms": (last - first) / (n - 1) * 1000 if first and n > 1 else None,
            "tokens_per_second": n / (last - queued) if first and last > queued else None,
        }
    tracker.finish("completed")
    return json_response(out)


def _cache_salt(body: dict[str, Any]) -> str | None:
    """The body's ``cache_salt``, checked as vLLM checks it (``validate_cache_salt``: 0.32's rule)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if V032 and (len(salt) > 128 or any(c in "@/\\\x00" for c in salt)):
        raise ApiError(400, "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
                            "'\\\\', or NUL.", param="cache_salt")
    return salt


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, chat=True)


def embed_vector(text: str, dim: int) -> list[float]:
    out: list[float] = []
    counter = 0
    while len(out) < dim:
        h = hashlib.sha256(f"{counter}:{text}".encode()).digest()
        for j in range(0, 32, 2):
            mag = 1.0 + 9.0 * h[j] / 255.0
            out.append(round(-mag if h[j + 1] & 1 else mag, 6))
        counter += 1
    return out[:dim]


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        body = await read_body(request)
        model = check_model(state, body)
        inp = body.get("input")
        items: list[tuple[str, int]] = []  # (text to hash, token count)

        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(inp, str):
            items.append((inp, len(inp.split())))
        elif isinstance(inp, list) and inp and is_ids(inp):
            items.append((" ".join(map(str, inp)), len(inp)))
        elif isinstance(inp, list) and inp:
            for x in inp:
                if isinstance(x, str):
                    items.append((x, len(x.split())))
                elif is_ids(x):
                    items.append((" ".join(map(str, x)), len(x)))
                else:
                    raise ApiError(400, "input must be a string, a list of strings or of token "
                                        "ids", param="input")
        else:
            raise ApiError(400, "input must be a non-empty string or list", param="input")
        faults: set[str] = set()
        for t, _ in items:
            faults.update(_RE_FAULT.findall(t))
        _fault_errors(faults)
        dim = state.knobs.embed_dim
        dims = body.get("dimensions")
        if dims is not None:
            if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
                raise ApiError(400, "dimensions must be a positive integer", param="dimensions")
            if dims > dim:
                raise ApiError(400, f"dimensions {dims} is larger than the model's hidden size "
                                    f"{dim}", param="dimensions")
            dim = dims
        for _, n in items:
            if n > state.max_model_len:
                _validate_len(state, n, None)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ApiError(400, f"unsupported encoding_format {fmt!r}", param="encoding_format")
    except ApiError as e:
        return error_response(e.status, e.message, e.err_type, e.param)
    data = []
    for i, (t, _) in enumerate(items):
        vec: Any = embed_vector(t, dim)
        if fmt == "base64":
            vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": vec})
    ptoks = sum(n for _, n in items)
    state.prompt_tokens_total += ptoks
    return json_response({"id": "embd-" + uuid.uuid4().hex, "object": "list",
                          "created": int(time.time()), "model": model, "data": data,
                          "usage": _details({"prompt_tokens": ptoks, "total_tokens": ptoks,
                                             "completion_tokens": 0, "prompt_tokens_details": None}, False, [])})


def _scored(texts: Any) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts):
        return texts
    raise ApiError(400, "inputs must be a string or a non-empty list of strings")


async def rerank_or_score(request: web.Request) -> web.Response:
    """``/v1/rerank`` (``query``, ``documents``, ``top_n``) and ``/v1/score`` (``text_1``/``text_2``,
    ``data_1``/``data_2``, ``queries`` with ``documents`` or ``items``): 1:1, 1:N or N:N pairs, each scored
    by the cosine of its texts' vectors; usage: the words of both texts of every pair (vLLM 0.32's
    ``RerankResponse``/``ScoreResponse``, ``entrypoints/pooling/scoring/protocol.py``)."""
    state = request.app[STATE_KEY]
    try:
        body = await read_body(request)
        model = check_model(state, body)
        rerank = request.path == "/v1/rerank"
        if rerank:
            first, second = _scored(body.get("query")), _scored(body.get("documents"))
        else:
            pair = next((p for p in (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
                                     ("queries", "items")) if p[0] in body and p[1] in body), None)
            if pair is None:
                raise ApiError(400, "text_1 and text_2 (or data_1/data_2, queries/documents, queries/items) are required")
            first, second = _scored(body[pair[0]]), _scored(body[pair[1]])
        if len(first) > 1 and len(first) != len(second):
            raise ApiError(400, "Input lengths must be either 1:1, 1:N or N:N")
    except ApiError as e:
        return error_response(e.status, e.message, e.err_type, e.param)
    pairs = [(first[0] if len(first) == 1 else first[i], t) for i, t in enumerate(second)]
    dim = state.knobs.embed_dim
    scores = []
    for a, b in pairs:
        va, vb = embed_vector(a, dim), embed_vector(b, dim)
        dot = sum(x * y for x, y in zip(va, vb))
        scores.append(dot / (math.sqrt(sum(x * x for x in va)) * math.sqrt(sum(y * y for y in vb))))
    ptoks = sum(len(a.split()) + len(b.split()) for a, b in pairs)
    state.prompt_tokens_total += ptoks
    if rerank:
        results = sorted(({"index": i, "document": {"text": t, "multi_modal": None}, "relevance_score": sc}
                          for i, ((_, t), sc) in enumerate(zip(pairs, scores))), key=lambda r: -r["relevance_score"])
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        return json_response({"id": "rerank-" + uuid.uuid4().hex, "model": model,
                              "usage": {"prompt_tokens": ptoks, "total_tokens": ptoks}, "results": results})
    return json_response({"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                          "model": model, "data": [{"index": i, "object": "score", "score": sc} for i, sc in enumerate(scores)],
                          "usage": {"prompt_tokens": ptoks, "total_tokens": ptoks, "completion_tokens": 0,
                                    "prompt_tokens_details": None}})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        body = await read_body(request)
        check_model(state, body)
        if "messages" in body:
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                raise ApiError(400, "messages must be a list", param="messages")
            parts = [_content_text(m.get("content") if isinstance(m, dict) else None)
                     for m in msgs]
            words = " ".join(t for t, _ in parts).split()
            extra = sum(x for _, x in parts)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string", param="prompt")
            words = prompt.split()
            extra = 0
    except ApiError as e:
        return error_response(e.status, e.message, e.err_type, e.param)
    tokens = [zlib.crc32(w.encode()) % 151936 for w in words] + [151655] * extra
    return json_response({"count": len(tokens), "max_model_len": state.max_model_len,
                          "tokens": tokens, "token_strs": None})


def _anthropic_prompt_tokens(body: dict[str, Any]) -> int:
    """An Anthropic request's prompt as the stand-in counts it: the words of ``system`` and of every
    message's text (a string, or ``text`` blocks)."""
    words = 0
    system = body.get("system")
    blocks = system if isinstance(system, list) else [{"text": system}] if isinstance(system, str) else []
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        blocks += content if isinstance(content, list) else [{"text": content}] if isinstance(content, str) else []
    for b in blocks:
        if isinstance(b, dict) and isinstance(b.get("text"), str):
            words += len(b["text"].split())
    return words


async def agent_api(request: web.Request) -> web.Response:
    """``/v1/messages`` and ``/v1/responses``, unstreamed only: vLLM's own agents' endpoints run on the
    real engine in tests/real_engine/test_real_agents.py; here only what vllama sends them (recorded)
    and a minimal answer with each API's usage (12 in, 8 out)."""
    state = request.app[STATE_KEY]
    try:
        body = await read_body(request)
        model = check_model(state, body)
    except ApiError as e:
        return error_response(e.status, e.message, e.err_type, e.param)
    if request.path == "/v1/messages/count_tokens":
        return json_response({"input_tokens": _anthropic_prompt_tokens(body)})
    if request.path == "/v1/messages":
        try:  # vLLM 0.26 refuses a max_tokens the prompt leaves no room for (recorded on the H200: 500,
            # "This model's maximum context length is 4096 tokens. However, you requested 4096 output tokens ...")
            _validate_len(state, _anthropic_prompt_tokens(body), _opt_int(body, "max_tokens"))
        except ApiError as e:
            return error_response(e.status, e.message, e.err_type, e.param)
        return json_response({"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                              "content": [{"type": "text", "text": "tok0 tok1 "}], "stop_reason": "end_turn",
                              "stop_sequence": None, "usage": {"input_tokens": 12, "output_tokens": 8}})
    return json_response({"id": "resp_fake", "object": "response", "status": "completed", "model": model,
                          "output": [{"type": "message", "id": "msg_fake", "role": "assistant", "status": "completed",
                                      "content": [{"type": "output_text", "text": "tok0 tok1 ", "annotations": []}]}],
                          "usage": {"input_tokens": 12, "output_tokens": 8, "total_tokens": 20}})


async def health(request: web.Request) -> web.Response:
    f = request.app[STATE_KEY].knobs.unhealthy_file
    if f and os.path.exists(f):
        return web.Response(status=503)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": VLLM_VERSION})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": state.created, "owned_by": "vllm",
         "root": state.model, "parent": None, "max_model_len": state.max_model_len,
         "permission": []}
        for name in state.served] + [
        {"id": name, "object": "model", "created": state.created, "owned_by": "vllm",
         "root": path, "parent": state.served[0], "max_model_len": None, "permission": []}
        for name, path in state.loras.items()]})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's runtime LoRA loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): plain text, 400 when loaded."""
    state = request.app[STATE_KEY]
    body = await request.json()
    name, path = body.get("lora_name"), body.get("lora_path")
    if name in state.loras:
        return web.Response(status=400, text=f"The lora adapter '{name}' has already been loaded.")
    state.loras[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    name = (await request.json()).get("lora_name")
    if state.loras.pop(name, None) is None:
        return web.Response(status=404, text=f"The lora adapter '{name}' cannot be found.")
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def metrics(request: web.Request) -> web.Response:
    s = request.app[STATE_KEY]
    if s.knobs.metrics_delay:
        s.metrics_asked += 1
        try:
            await asyncio.sleep(s.knobs.metrics_delay)
        finally:
            s.metrics_asked -= 1
    lbl = f'{{model_name="{s.served[0]}"}}'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{lbl} {float(s.in_flight + s.knobs.stale_pending)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{lbl} {float(s.sched.n_waiting)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{lbl} {min(1.0, s.in_flight / 256.0)}",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{lbl} {float(s.prompt_tokens_total)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{lbl} {float(s.generation_tokens_total)}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
        f"vllm:request_success_total{lbl} {float(s.completed)}",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{lbl} {float(s.prefix_cache.queries)}",
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{lbl} {float(s.prefix_cache.hits)}",
    ]
    return web.Response(text="\n".join(lines) + "\n",
                        content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def fake_requests(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if request.method == "DELETE":
        state.requests.clear()
        return json_response({"cleared": True})
    return json_response(list(state.requests))


async def sleep(request: web.Request) -> web.Response:
    """vLLM's POST /sleep?level=N (sleep mode + VLLM_SERVER_DEV_MODE=1): weights to CPU, KV cache freed."""
    s = request.app[STATE_KEY]
    s.sleeping = int(request.query.get("level", "1"))
    s.sleeps += 1
    await asyncio.sleep(s.knobs.sleep_seconds)
    while s.knobs.sleep_gate and not os.path.exists(s.knobs.sleep_gate):
        await asyncio.sleep(0.02)
    if s.ledger is not None:
        s.ledger.release(s.knobs.sleep_residue, "sleep")
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    s = request.app[STATE_KEY]
    await asyncio.sleep(s.knobs.wake_seconds)
    if s.ledger is not None and s.sleeping:
        error = s.ledger.claim(s.ledger.share, "wake")
        if error is not None:
            log("ERROR", f"torch.OutOfMemoryError: CUDA out of memory. {error}", "cumem.py:1")
            return json_response({"error": {"message": f"CUDA out of memory. {error}", "type": "InternalServerError", "code": 500}}, status=500)
    s.sleeping = 0
    s.wakes += 1
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    return json_response({"is_sleeping": bool(request.app[STATE_KEY].sleeping)})


async def fake_stats(request: web.Request) -> web.Response:
    s = request.app[STATE_KEY]
    return json_response({"started": s.started, "completed": s.completed, "aborted": s.aborted,
                          "failed": s.failed, "in_flight": s.in_flight,
                          "running": s.sched.running, "waiting": s.sched.n_waiting, "waited": s.sched.waited,
                          "sleeping": s.sleeping, "sleeps": s.sleeps, "wakes": s.wakes, "while_asleep": s.while_asleep,
                          "metrics_asked": s.metrics_asked,
                          "generation_tokens_total": s.generation_tokens_total,
                          "prompt_tokens_total": s.prompt_tokens_total, "steps": len(s.steps)})


@web.middleware
async def record_and_auth(request: web.Request, handler):
    state = request.app[STATE_KEY]
    if request.match_info.http_exception is not None:
        # Unknown route / method: FastAPI's body, like vLLM.
        exc = request.match_info.http_exception
        return json_response({"detail": exc.reason}, status=exc.status)
    if request.path.startswith("/v1/"):
        arrived = time.monotonic()  # the request's headers read: CLOCK_MONOTONIC, one clock for every process
        if state.api_key is not None and \
                request.headers.get("Authorization") != f"Bearer {state.api_key}":
            return json_response({"error": "Unauthorized"}, status=401)
        raw = await request.read() if request.can_read_body else b""
        parsed = _parse(raw) if request.method == "POST" else (True, None)
        request["fake_parsed"] = parsed
        ok, body = parsed
        state.requests.append({
            "method": request.method,
            "path": request.path,
            "body": body if ok else raw.decode("utf-8", "replace"),
            "headers": {str(k): v for k, v in request.headers.items()},
            "arrived": arrived,
        })
    return await handler(request)


def make_app(state: State) -> web.Application:
    middlewares = [record_and_auth]
    if os.environ.get("FAKE_VLLM_REPLAY"):  # real vLLM's recorded bytes for recorded requests
        import vllm_replay

        middlewares.append(vllm_replay.replay_middleware(os.environ["FAKE_VLLM_REPLAY"], state.served))
    app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
    app[STATE_KEY] = state
    r = app.router
    r.add_get("/health", health)
    r.add_get("/version", version)
    r.add_get("/v1/models", models)
    r.add_get("/metrics", metrics)
    if runtime_lora():
        r.add_post("/v1/load_lora_adapter", load_lora_adapter)
        r.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    # Like vLLM: a pooling model serves embeddings only; a generation model has no
    # /v1/embeddings route (FastAPI's 404 {"detail": "Not Found"}).
    if state.pooling:
        r.add_post("/v1/embeddings", embeddings)
        r.add_post("/v1/rerank", rerank_or_score)
        r.add_post("/v1/score", rerank_or_score)
    else:
        r.add_post("/v1/completions", completions)
        r.add_post("/v1/chat/completions", chat_completions)
        r.add_post("/v1/messages", agent_api)
        r.add_post("/v1/messages/count_tokens", agent_api)
        r.add_post("/v1/responses", agent_api)
    r.add_post("/tokenize", tokenize)
    r.add_get("/_fake/requests", fake_requests)
    r.add_delete("/_fake/requests", fake_requests)
    r.add_get("/_fake/stats", fake_stats)
    if state.sleep_mode:  # like vLLM: only with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1
        r.add_post("/sleep", sleep)
        r.add_post("/wake_up", wake_up)
        r.add_get("/is_sleeping", is_sleeping)
    return app


# --------------------------------------------------------------------------- process


def _parse_len(v: str) -> int:
    v = v.strip()
    mult = 1
    if v[-1:] in ("k", "m"):
        mult = 1000 if v[-1] == "k" else 1000_000
        v = v[:-1]
    elif v[-1:] in ("K", "M"):
        mult = 1024 if v[-1] == "K" else 1024 * 1024
        v = v[:-1]
    return int(float(v) * mult)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if argv and argv[0] == "serve":
        argv = argv[1:]
    model = None
    if argv and not argv[0].startswith("-"):
        model, argv = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog="vllm serve", allow_abbrev=False)
    p.add_argument("--model", dest="model_opt", default=None)
    p.add_argument("--host", default="127.0.0.1")  # loopback unless asked: a stand-in is no service (issue 26.9)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--max-model-len", type=_parse_len, default=4096)
    p.add_argument("--api-key", default=None)
    p.add_argument("--runner", default="auto")
    p.add_argument("--convert", default="auto")
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-modules", nargs="+", default=[])
    p.add_argument("--api-server-count", "-asc", type=int, default=1)
    args, unknown = p.parse_known_args(argv)
    rejected = [a for a in unknown if a.startswith("--fake-invalid")]
    if rejected:  # vLLM's argparse on an argument it does not take: usage + error on stderr, exit 2
        p.error(f"unrecognized arguments: {' '.join(rejected)}")
    args.model = model or args.model_opt or "fake-model"
    return args, unknown


class Grandchild:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def spawn(self, pidfile: str | None) -> None:
        # Same session and process group as the server (no start_new_session), stdio inherited.
        self.proc = subprocess.Popen(["VLLM::EngineCore", "-c", _GRANDCHILD_CODE],
                                     executable=sys.executable, stdin=subprocess.DEVNULL)
        if pidfile:
            _write_pid(pidfile, self.proc.pid)
        log("INFO", f"Started engine core process pid={self.proc.pid}", "core_client.py:1")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _write_pid(path: str, pid: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{pid}\n")
    os.replace(tmp, path)


async def serve(args: argparse.Namespace, unknown: list[str], knobs: Knobs) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    grandchild = Grandchild()
    served = args.served_model_name or [args.model]
    log("INFO", f"vLLM API server version {VLLM_VERSION}", "api_server.py:1839")
    log("INFO", f"args: model={args.model!r} served_model_name={served!r} host={args.host!r} "
                f"port={args.port} max_model_len={args.max_model_len} ignored={unknown!r}",
        "utils.py:233")
    if knobs.pidfile:
        _write_pid(knobs.pidfile + ".server", os.getpid())
    if knobs.grandchild:
        grandchild.spawn(knobs.pidfile)
    if knobs.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    try:
        # Loading: nothing is bound yet, so connections are refused.
        if knobs.start_delay > 0:
            t0 = time.monotonic()
            shards = 5
            while True:
                elapsed = time.monotonic() - t0
                if elapsed >= knobs.start_delay:
                    break
                try:
                    await asyncio.wait_for(stop.wait(), min(0.5, knobs.start_delay - elapsed))
                except asyncio.TimeoutError:
                    pass
                if stop.is_set():
                    log("INFO", "Interrupted while loading.", "api_server.py:1")
                    return 0
                elapsed = time.monotonic() - t0
                frac = min(1.0, elapsed / knobs.start_delay)
                done = int(frac * shards)
                raw_log(f"Loading safetensors checkpoint shards: {int(frac * 100):3d}% Completed "
                        f"| {done}/{shards} [00:{int(elapsed):02d}<00:00, 2.00it/s]")
                if frac < 1.0:
                    log("INFO", f"Loading model weights ({elapsed:.2f} s elapsed)",
                        "gpu_model_runner.py:2602")
            log("INFO", f"Loading weights took {time.monotonic() - t0:.2f} seconds",
                "default_loader.py:267")
        if knobs.start_gate:
            t0 = time.monotonic()
            while not os.path.exists(knobs.start_gate):
                try:
                    await asyncio.wait_for(stop.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass
                if stop.is_set():
                    log("INFO", "Interrupted while loading.", "api_server.py:1")
                    return 0
                if int((time.monotonic() - t0) * 10) % 5 == 0:
                    log("INFO", f"Loading model weights ({time.monotonic() - t0:.2f} s elapsed)", "gpu_model_runner.py:2602")
        if knobs.fail_at_start and knobs.fail_for in (None, served[0]):
            log("ERROR", knobs.fail_at_start, "core.py:708")
            raw_log("Traceback (most recent call last):")
            raw_log('  File "/usr/lib/python3/site-packages/vllm/v1/engine/core.py", line 699, '
                    "in run_engine_core")
            raw_log(f"RuntimeError: {knobs.fail_at_start}")
            raw_log("RuntimeError: Engine core initialization failed. See root cause above. "
                    "Failed core proc(s): {}")
            return 1

        if knobs.fail_tail and knobs.fail_for in (None, served[0]):
            with open(knobs.fail_tail) as tail:
                lines = tail.read().splitlines()
            for line in lines:
                raw_log(line)
            return 1

        if args.api_server_count > 1 and runtime_lora():  # vllm/entrypoints/cli/serve.py, before binding
            log("ERROR", "VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with api_server_count > 1", "serve.py:316")
            raw_log("ValueError: VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with api_server_count > 1")
            return 1
        state = State(args.model, served, args.max_model_len, args.api_key, knobs)
        if args.enable_lora:
            state.loras = dict(m.split("=", 1) for m in args.lora_modules)
        if knobs.gpu_ledger:
            state.ledger = gpu_claim(knobs.gpu_ledger, served[0], unknown)
            if state.ledger is None:
                return 1
        state.pooling = args.runner == "pooling" or args.convert == "embed"
        state.sleep_mode = args.enable_sleep_mode and os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
        state.per_request_metrics = "--enable-per-request-metrics" in unknown
        state.sched.by_priority = "priority" in unknown and unknown[unknown.index("priority") - 1] == "--scheduling-policy"
        app = make_app(state)
        if knobs.access_log:
            import logging

            alog = logging.getLogger("aiohttp.access")
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            alog.addHandler(handler)
            alog.setLevel(logging.INFO)
            alog.propagate = False
        log_kw: dict[str, Any] = (
            {"access_log_format": 'INFO:     %a - "%r" %s'} if knobs.access_log
            else {"access_log": None})
        runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                               shutdown_timeout=0.5, **log_kw)
        await runner.setup()
        log("INFO", f"Starting vLLM API server on http://{args.host}:{args.port}",
            "launcher.py:37")
        try:
            if knobs.accept_every > 0:
                accepting = asyncio.ensure_future(accept_slowly(runner, args.host, args.port, knobs))
                await asyncio.sleep(0)  # bound (or failed) before the start line below
                if accepting.done():
                    accepting.result()
            else:
                site = web.TCPSite(runner, args.host, args.port, reuse_address=True, backlog=knobs.backlog)
                await site.start()
        except OSError as e:
            log("ERROR", f"[Errno {e.errno}] error while attempting to bind on address "
                         f"({args.host!r}, {args.port}): {e.strerror}", "launcher.py:1")
            await runner.cleanup()
            return 1
        if state.ledger is not None:
            state.ledger.started()
        raw_log("INFO:     Application startup complete.")
        await stop.wait()
        log("INFO", "Shutting down FastAPI HTTP server.", "launcher.py:80")
        try:
            await asyncio.wait_for(runner.cleanup(), 5)
        except (asyncio.TimeoutError, Exception):  # pragma: no cover - best effort
            pass
        return 0
    finally:
        grandchild.stop()
        if state_ledger[0] is not None:
            state_ledger[0].release(0, "exit")


async def accept_slowly(runner: web.AppRunner, host: str, port: int, knobs: Knobs) -> None:
    """FAKE_VLLM_ACCEPT_EVERY: one connection accepted per ``accept_every`` s, handed to aiohttp's server. The
    accepts are made by a thread of their own, so their pace does not depend on how busy this server's event loop
    is (on a loaded machine the loop's turns grew past a second, and the queue stopped draining)."""
    import socket
    import threading

    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # an OSError here is raised before the first await
    sock.listen(knobs.backlog)
    assert runner.server is not None
    server = runner.server

    def hand_over(conn: socket.socket) -> None:
        conn.setblocking(False)
        loop.create_task(loop.connect_accepted_socket(server, conn))

    def accept() -> None:
        while True:
            conn, _ = sock.accept()
            loop.call_soon_threadsafe(hand_over, conn)
            time.sleep(knobs.accept_every)

    threading.Thread(target=accept, daemon=True).start()


def _arg(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


state_ledger: list[GpuLedger | None] = [None]


def gpu_claim(path: str, name: str, args: list[str]) -> GpuLedger | None:
    """Claim this server's GPU memory at start, as vLLM's memory profiling does; None when it does not fit."""
    share = float(_arg(args, "--gpu-memory-utilization") or 0.9)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    tp = int(_arg(args, "--tensor-parallel-size") or _arg(args, "-tp") or 1)
    gpus = [int(g) for g in visible.split(",")][:tp] if visible else list(range(tp))
    ledger = GpuLedger(path, name, gpus, share)
    error = ledger.claim(share, "start")
    if error is not None:
        log("ERROR", f"ValueError: {error}", "gpu_worker.py:240")
        raw_log("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
        return None
    state_ledger[0] = ledger
    return ledger


def main(argv: list[str] | None = None) -> int:
    args, unknown = parse_args(list(sys.argv[1:] if argv is None else argv))
    knobs = Knobs()
    try:
        import uvloop  # type: ignore
    except ImportError:
        uvloop = None
    if uvloop is not None and hasattr(uvloop, "run"):
        return uvloop.run(serve(args, unknown, knobs))
    return asyncio.run(serve(args, unknown, knobs))


if __name__ == "__main__":
    sys.exit(main())
