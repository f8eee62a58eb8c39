"""One request's own record, from the outermost middleware to its settling: who asked, what the gate
parsed, where it went, what it holds and what it used.

Every inference request has one :class:`Call` (``request[CALL]``, made by ``app.py``'s outermost
middleware): the gate (``gate/``) fills in the typed body, admission (``admission.py``) what it
reserved and holds, the route the model it resolved, the relay the usage vLLM reported; the settler
(``settler.py``) is its one consumer, once, at the end however the request ends. Nothing else reads
or writes a request's charge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..policy.keys import OPEN, Key

#: Request key: the request's :class:`Call`.
CALL = "vllama.call"


@dataclass(slots=True)
class Held:
    """What admission took for a request, given back by the settler (``settler.py``), each once.

    Attributes:
        worker: this process's index among the workers (its slot in the shared counts).
        key_counter: the key's per-key counter (``api/policy/keys.py``'s ``Key.counter``).
        user_counter: an end user's counter (``policy/end_users.counter_of``; -1: the request is its key's own).
        user_tpm, user_budget, user_entered: what the end user's own limits hold (as ``tpm``, ``budget`` and
            ``entered`` for the key).
        inputs: an embeddings, rerank or score request's inputs (each one output token's worth of cost).
        budget: tokens reserved against the key's ``budget_tokens`` (``budgets.Reservations``; with
            ``shared_budget``, in the shared store too).
        tpm: tokens reserved in the key's ``tpm`` minute ``minute`` (``rate_limits.py``; with ``shared_tpm``,
            in the shared store's minute too).
        entered: whether it holds a place in the server's in-flight bound.
        counted_shared: whether the shared store (``--state-url``) counts it in flight.
        estimate: the fair queue's charge for the prompt at dispatch (cost units), settled by vLLM's count.
        dispatched: whether the request left the fair queue (its place upstream is given back).
    """

    worker: int
    key_counter: int
    user_counter: int = -1
    user_tpm: int = 0
    user_minute: int = 0
    user_budget: int = 0
    user_entered: bool = False
    inputs: int = 0
    budget: int = 0
    shared_budget: bool = False
    tpm: int = 0
    minute: int = 0
    shared_tpm: bool = False
    entered: bool = False
    counted_shared: bool = False
    estimate: float = 0.0
    dispatched: bool = False


@dataclass(slots=True)
class Call:
    """One request's record (see the module docstring).

    Attributes:
        key: the key it came with (``api/policy/keys.py``'s ``OPEN`` without one).
        body: its raw body, once read within its limits (``api/request/body_reader.py``'s ``read_body``).
        typed: the gate's typed request (a model of ``api/ollama/types.py`` or ``request/bodies.py``), ``None`` for a
            route without one (a form, a route the gate does not parse).
        end_user: the end user a trusted front named (``end_users.py``, read once by the gate; ``None``: the
            key is not a trusted front, the request is the key's own).
        asked: the model as the client named it (``None``: none named).
        model: the served model the request is charged to (resolved by the route; the default model
            for a relayed body that named none).
        usage: ``(prompt tokens, output tokens)`` once known: vLLM's count, or what was relayed before
            the client left.
        held: what admission holds for it (``None``: not admitted, or not an inference route).
        priority: its vLLM ``priority`` with fair sharing (``None``: none set by vllama).
        rate_headers: the ``x-ratelimit-*`` headers of a key with ``rpm``/``tpm``.
        error: the error text it was answered with, if any.
        stream_error: an upstream error that ended its answer after the answer began.
        drop_usage: vllama asked vLLM for a stream's usage the client did not ask for: its chunk is dropped.
        settled: whether the settler has charged it (it runs once).
    """

    key: Key = OPEN
    body: bytes | None = None
    typed: Any = None
    end_user: str | None = None
    asked: str | None = None
    model: str | None = None
    usage: tuple[int, int] | None = None
    held: Held | None = None
    priority: int | None = None
    rate_headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    stream_error: Any = None
    drop_usage: bool = False
    settled: bool = False


def call_of(request: web.Request) -> Call:
    """The request's :class:`Call` (a detached one for a request the middleware did not see)."""
    call = request.get(CALL)
    if call is None:
        call = request[CALL] = Call()
    return call
