"""The settler: the one place where a request is charged, once, at its end however it ends.

``app.py``'s outermost middleware calls :meth:`Settler.settle` for every request after its answer,
error or client's leaving. Invariant: from the request's :class:`~.call.Call` every token vLLM
reported (or, for an answer its client left, what was relayed) is charged exactly once to the fair
queue (place given back, estimate settled), the key's ``tpm`` minute and ``budget_tokens``
(reservations replaced by use), a fleet's shared store (``--state-url``), the server's in-flight
bound, and the key's Prometheus counters and ledger row. A request the gate or a limit refused is
recorded for its key too; one with no known key (401) only in the metrics.
"""

from __future__ import annotations

from aiohttp import web

from .admission import SHARED_USER, AdmissionBound, SharedUser, is_inference
from ..policy.keys import KEY, KeyRing, key_of
from .call import Call
from ..policy.fair_queue import FairQueue, prompt_tokens_guess
from ..usage.ledger import Ledger
from ..usage.store import Row
from ..metrics import IN_FLIGHT, observe_key_usage
from ..policy.fleet_counters import KeyState

#: The key label of a request that came with no known key (401).
NO_KEY = "(none)"


class Settler:
    """Charges each request once (see the module docstring).

    Args:
        bound: the server's admission bound (its places, the keys' minutes and budget reservations).
        queue: the fair queue when fair sharing is on, else ``None``.
        shared: the store several fronts share (``--state-url``), else ``None``.
        ledger: this process's usage ledger (``None``: ``--usage-db off``).
        keys: the keys (a request with none is charged to none when some are configured).
    """

    def __init__(self, bound: AdmissionBound, queue: FairQueue | None, shared: KeyState | None, ledger: Ledger | None,
                 keys: KeyRing) -> None:
        self.keys = keys
        self.bound = bound
        self.queue = queue
        self.shared = shared
        self.ledger = ledger

    async def settle(self, request: web.Request, call: Call, status: int, duration_s: float, route: str) -> None:
        """Charge ``call`` (answered with ``status`` after ``duration_s`` s, on the route pattern ``route``); a
        second call does nothing."""
        if call.settled:
            return
        call.settled = True
        key = call.key = key_of(request)
        usage = call.usage
        inference = call.body is not None or call.model is not None or is_inference(request)
        known = KEY in request or not self.keys.configured  # a 401 came with no known key
        if inference:
            observe_key_usage(key.name if known else NO_KEY, call.model or "-", status, usage)
            if known and self.ledger is not None:
                error = call.stream_error.message if call.stream_error is not None else call.error
                prompt, output = usage or (0, 0)
                self.ledger.record(Row(self.ledger.clock(), self.ledger.host, key.name, call.model or "-", route, status,
                                       int(prompt or 0), int(output or 0), round(duration_s * 1000, 2),
                                       error[:300] if error else None, call.end_user))  # positional: the cheapest tuple
        held = call.held
        if held is None:
            return
        bound = self.bound
        used = usage[0] + usage[1] if usage else 0
        served = None  # with a shared store: the request's service, for the key's counter on every front
        queue = self.queue
        if held.dispatched and queue is not None:
            # the inputs' charge stays: only the prompt's estimate is settled by vLLM's count
            queue.done(held.worker, held.user_counter if held.user_counter >= 0 else held.key_counter, queue.prompt_weight * usage[0] - held.estimate if usage else 0.0,
                       usage[1] if usage else None)
            prompt, output = usage or (prompt_tokens_guess(call.body), 0)
            served = queue.service(prompt, output + held.inputs, key.weight)
        if held.tpm:
            bound.limits.settle(held.key_counter, held.tpm, held.minute, used)
        bound.budgets.release(key, held.budget)  # after the ledger's row: never neither counted
        if held.user_counter >= 0:  # an end user's own limits (end_users.py)
            if held.user_tpm:
                bound.limits.settle(held.user_counter, held.user_tpm, held.user_minute, used)
            bound.budgets.give(held.user_counter, held.user_budget)
            if held.user_entered:
                bound.leave_user(held.worker, held.user_counter)
        if held.entered:
            bound.leave_key(held.worker, held.key_counter)
            IN_FLIGHT.dec()
        shared = self.shared
        if shared is not None and held.shared_budget:
            await shared.reserve_budget(key.name, -held.budget)
        if shared is not None and (held.counted_shared or held.shared_tpm or served is not None):
            elsewhere = await shared.finish(key.name, leave=held.counted_shared, tokens=used if held.shared_tpm else 0,
                                            reserved=held.tpm if held.shared_tpm else 0, minute=held.minute, served=served)
            if elsewhere is not None and queue is not None:
                queue.absorb(held.key_counter, elsewhere)
        mine: SharedUser | None = request.get(SHARED_USER)  # an end user's limits over every front
        if shared is not None and mine is not None:
            if mine.budget:
                await shared.reserve_budget(mine.name, -mine.budget)
            if mine.counted or mine.tpm:
                await shared.finish(mine.name, leave=mine.counted, tokens=used if mine.tpm else 0, reserved=mine.tpm,
                                    minute=mine.minute)
