"""The fair queue in front of vLLM's running slots (issue 38): VTC's order, counted by dispatch.

Unit tests drive :class:`FairQueue` in-process (deterministic: the order in which requests are let
upstream, never wall time); one spawned process shows that a place freed in one worker wakes a
waiter in another through its FIFO, with no polling.
"""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest

from vllama_proxy.api.policy.fair_queue import W_IN, W_OUT, FairQueue

CTX = multiprocessing.get_context("spawn")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_key_alone_uses_every_place_and_nothing_waits_while_there_is_room():
    async def run() -> None:
        q = FairQueue(4, workers=1, keys=16)
        for _ in range(4):  # returns at once: the key alone takes every place
            await asyncio.wait_for(q.turn(0, 3), 1)
        fifth = asyncio.ensure_future(q.turn(0, 3))
        await _settle()
        assert not fifth.done() and q.stats() == {"capacity": 4, "upstream": 4, "waiting": 1, "dispatched": 4}
        q.done(0, 3)
        await asyncio.wait_for(fifth, 1)  # the freed place goes to it at once
        assert q.stats()["upstream"] == 4 and q.stats()["waiting"] == 0

    asyncio.run(run())


def test_a_light_key_goes_ahead_of_a_flood_already_waiting():
    async def run() -> None:
        q = FairQueue(2, workers=1, keys=16)
        order: list[str] = []

        async def req(name: str, key: int) -> None:
            await q.turn(0, key, cost=W_IN * 100)
            order.append(name)

        heavy = [asyncio.ensure_future(req(f"heavy{i}", 1)) for i in range(10)]
        await _settle()
        light = asyncio.ensure_future(req("light", 2))
        await _settle()
        assert order == ["heavy0", "heavy1"]
        q.done(0, 1, output=50)  # one heavy request ends: its place goes to the light key, not heavy2
        await _settle()
        assert order == ["heavy0", "heavy1", "light"]
        for _ in range(9):
            q.done(0, 1, output=50)
            await _settle()
        await asyncio.gather(light, *heavy)
        assert order[3:] == [f"heavy{i}" for i in range(2, 10)]

    asyncio.run(run())


@pytest.mark.parametrize("places", [1, 8])
@pytest.mark.parametrize("prompt_weight", [W_IN, 0.5])
@pytest.mark.parametrize("light", [0, 4])
def test_backlogged_keys_get_their_weighted_shares_and_a_late_key_its_share_at_once(places, prompt_weight, light):
    """Four keys with weights 1, 1, 2, 4, different prompt and answer lengths, ``places`` places
    (requests end in the order they went): every key's service (``prompt_weight`` x prompt +
    W_OUT x output tokens: the default counts output tokens only, 0.5 is VTC's own ratio) is within
    10 % of its weighted share; a fifth key arriving late is served from its first request on at
    its share, not after the others' credit. Every key asks more than its share: none is light, so
    ``light_running`` changes nothing."""
    W_IN = prompt_weight  # the prompt weight under its name in fair_queue.py
    keys = {10: (1.0, 40, 200), 11: (1.0, 400, 20), 12: (2.0, 100, 100), 13: (4.0, 10, 300)}  # weight, prompt, output

    async def run() -> None:
        q = FairQueue(places, workers=1, keys=32, light_running=light, prompt_weight=prompt_weight)
        ended = 0
        served: list[int] = []

        async def client(key: int, n: int) -> None:
            weight, prompt, _ = keys[key]
            waiting = [asyncio.ensure_future(q.turn(0, key, weight=weight, cost=W_IN * prompt)) for _ in range(n)]
            for w in waiting:
                await w
                served.append(key)

        tasks = [asyncio.ensure_future(client(k, 400)) for k in keys]
        await _settle()

        def step() -> int:  # the oldest request upstream ends; the next goes
            nonlocal ended
            k = served[ended]
            ended += 1
            q.done(0, k, output=keys[k][2])
            return k

        async def run_for(n: int) -> list[int]:
            start = len(served)
            for _ in range(n):
                step()
                await _settle()
            return served[start:]

        await run_for(20)  # all four backlogged from here on
        window = await run_for(300)
        service = {k: sum(W_IN * keys[k][1] + W_OUT * keys[k][2] for x in window if x == k) for k in keys}
        total, weights = sum(service.values()), sum(w for w, _, _ in keys.values())
        for k, (w, _, _) in keys.items():
            share = service[k] / total
            assert abs(share - w / weights) <= 0.1 * w / weights, (k, share, w / weights, service)
        # a fifth key (weight 2) arrives late: lifted to the backlog's smallest counter, it gets
        # its share from the start (no starving of the others to catch up, no waiting behind them)
        keys[14] = (2.0, 100, 100)
        tasks.append(asyncio.ensure_future(client(14, 400)))
        await _settle()
        late = await run_for(100)
        first = late.index(14)
        assert first <= 8 + places, late[:12]
        s14 = sum(W_IN * 100 + W_OUT * 100 for x in late if x == 14)
        s_all = sum(W_IN * keys[x][1] + W_OUT * keys[x][2] for x in late)
        assert abs(s14 / s_all - 2 / 10) <= 0.2 * 2 / 10, (s14 / s_all, late)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def test_priority_goes_first_and_a_cancelled_waiter_gives_its_place_back():
    async def run() -> None:
        q = FairQueue(1, workers=1, keys=16)
        await q.turn(0, 1)
        low = asyncio.ensure_future(q.turn(0, 2))
        gone = asyncio.ensure_future(q.turn(0, 3, priority=5))
        high = asyncio.ensure_future(q.turn(0, 4, priority=5))
        await _settle()
        gone.cancel()  # leaves the queue while waiting
        await _settle()
        q.done(0, 1)
        await asyncio.wait_for(high, 1)
        assert not low.done() and q.stats()["waiting"] == 1
        q.done(0, 4)
        await asyncio.wait_for(low, 1)
        q.done(0, 2)
        assert q.stats() == {"capacity": 1, "upstream": 0, "waiting": 0, "dispatched": 3}

    asyncio.run(run())


def _other_worker(q: FairQueue, ready, go, got) -> None:
    async def run() -> None:
        waiter = asyncio.ensure_future(q.turn(1, 7))
        for _ in range(5):
            await asyncio.sleep(0)
        ready.set()
        await asyncio.wait_for(waiter, 30)  # woken through its FIFO by worker 0's done()
        got.value = 1
        q.done(1, 7)

    asyncio.run(run())


def test_a_place_freed_in_one_worker_wakes_a_waiter_in_another():
    async def run() -> None:
        q = FairQueue(1, workers=2, keys=16)
        await q.turn(0, 3)
        ready, got = CTX.Event(), CTX.Value("i", 0)
        p = CTX.Process(target=_other_worker, args=(q, ready, None, got))
        p.start()
        try:
            assert await asyncio.to_thread(ready.wait, 30)
            assert q.stats()["waiting"] == 1
            q.done(0, 3)
            await asyncio.to_thread(p.join, 30)
            assert got.value == 1 and p.exitcode == 0
            assert q.stats()["upstream"] == 0
        finally:
            p.kill()

    asyncio.run(run())


def test_a_dead_workers_places_and_waiters_are_given_back():
    q = FairQueue(2, workers=2, keys=16)

    async def fill() -> None:
        await q.turn(1, 5)
        await q.turn(1, 5)

    asyncio.run(fill())
    # worker 1 also has one waiting (counted directly: its process is gone)
    with q._lock.held():
        q._enqueue(1, 5, 0.0)
    assert q.stats()["upstream"] == 2 and q.stats()["waiting"] == 1
    q.reset_worker(1)
    assert q.stats()["upstream"] == 0 and q.stats()["waiting"] == 0


def test_a_key_alone_takes_the_reserve_too_and_beside_another_key_leaves_it_free():
    async def run() -> None:
        q = FairQueue(8, workers=1, keys=16, reserve=2, linger=3600)  # the last 2 places: for light keys
        for _ in range(8):
            await asyncio.wait_for(q.turn(0, 1), 1)  # the heavy key alone: every place, the reserve too
        ninth = asyncio.ensure_future(q.turn(0, 1))
        light = asyncio.ensure_future(q.turn(0, 2))
        await _settle()
        assert not ninth.done() and not light.done()  # every place is taken: the first light request waits ...
        q.done(0, 1)
        await asyncio.wait_for(light, 1)  # ... for one heavy request to end, and goes ahead of the ninth
        q.done(0, 2)  # the light key is idle, and still active (linger): the heavy key leaves the reserve free
        await _settle()
        assert not ninth.done() and q.stats()["upstream"] == 7
        q.done(0, 1)
        await _settle()
        assert not ninth.done() and q.stats()["upstream"] == 6
        q.done(0, 1)  # 3 free: one more than the reserve
        await asyncio.wait_for(ninth, 1)
        assert q.stats() == {"capacity": 8, "upstream": 6, "waiting": 0, "dispatched": 10}
        tenth = asyncio.ensure_future(q.turn(0, 1))
        await asyncio.wait_for(q.turn(0, 2), 1)  # a light request goes at once, into the reserve
        await asyncio.wait_for(q.turn(0, 3), 1)  # and a third key's (below its share: 8 / 3)
        again = asyncio.ensure_future(q.turn(0, 2))  # the light key again while its first runs (2 < 8 / 3): no room
        await _settle()
        assert not tenth.done() and q.stats() == {"capacity": 8, "upstream": 8, "waiting": 2, "dispatched": 12}
        q.done(0, 2)  # a light key's place: to the light key waiting, not to the heavy one
        await asyncio.wait_for(again, 1)
        assert not tenth.done() and q.stats()["waiting"] == 1
        tenth.cancel()
        await asyncio.gather(tenth, return_exceptions=True)

    asyncio.run(run())


def test_while_a_light_key_is_active_the_heavy_keys_run_at_most_light_running():
    """A light request's first token waits for vLLM's engine steps, longer the more sequences run:
    while a light key is active (a request upstream, or one that ended less than ``linger`` ago) the
    keys above their share run at most ``light_running`` together; the light key's requests go at
    once; once it has been idle for ``linger`` the heavy key takes every place again."""
    async def run() -> None:
        q = FairQueue(16, workers=1, keys=16, reserve=1, light_running=4, linger=3600)
        heavy = [asyncio.ensure_future(q.turn(0, 1)) for _ in range(30)]
        await _settle()
        assert q.stats()["upstream"] == 16  # alone: every place
        light = asyncio.ensure_future(q.turn(0, 2))
        await _settle()
        assert not light.done()
        q.done(0, 1)
        await asyncio.wait_for(light, 1)
        for _ in range(11):  # 15 heavy upstream down to 4: none of its waiting requests goes meanwhile
            q.done(0, 1)
            await _settle()
        assert q.stats() == {"capacity": 16, "upstream": 5, "waiting": 14, "dispatched": 17}
        q.done(0, 1)  # 3 heavy upstream: one more may go
        await _settle()
        assert q.stats() == {"capacity": 16, "upstream": 5, "waiting": 13, "dispatched": 18}
        await asyncio.wait_for(q.turn(0, 2), 1)  # the light key's second request: at once
        q.done(0, 2)
        q.done(0, 2)  # the light key is idle, still active (linger): the heavy key stays at 4
        q.done(0, 1)
        await _settle()
        assert q.stats() == {"capacity": 16, "upstream": 4, "waiting": 12, "dispatched": 20}
        q.linger = 0.0  # (in this process: the light key's linger has passed)
        q.done(0, 1)  # alone again: every place
        await _settle()
        assert q.stats() == {"capacity": 16, "upstream": 15, "waiting": 0, "dispatched": 32}
        await asyncio.gather(*heavy)

    asyncio.run(run())


def test_a_waiter_cancelled_as_its_place_is_granted_gives_it_on():
    async def run() -> None:
        q = FairQueue(1, workers=1, keys=16)
        await q.turn(0, 1)
        a = asyncio.ensure_future(q.turn(0, 2))
        b = asyncio.ensure_future(q.turn(0, 2))
        await _settle()
        q.done(0, 1)  # the place is granted to this worker's waiters of key 2 (woken soon) ...
        a.cancel()  # ... and the first of them is cancelled before that wake-up runs
        await asyncio.wait_for(b, 1)  # the place goes on to the next waiter of the key
        await asyncio.gather(a, return_exceptions=True)
        assert q.stats() == {"capacity": 1, "upstream": 1, "waiting": 0, "dispatched": 2}
        c = asyncio.ensure_future(q.turn(0, 3))
        await _settle()
        q.done(0, 2)  # granted to c's worker ...
        c.cancel()  # ... c is gone before it learns: the place is given back, nothing leaks
        await asyncio.gather(c, return_exceptions=True)
        await _settle()
        assert q.stats() == {"capacity": 1, "upstream": 0, "waiting": 0, "dispatched": 3}
        await asyncio.wait_for(q.turn(0, 4), 1)

    asyncio.run(run())


def test_a_new_key_is_charged_the_first_answer_the_server_saw_not_a_quarter_of_it():
    """Every key's expected answer (a new key's charge at dispatch) is seeded by the first answer
    that ends, as a key's own is: an average started from 0 charged the first requests of keys
    new to a fresh server a quarter of it, and a key of long answers paid that back later (on the
    stand-in: 10 s of a 20 s window at 0.03 of its share)."""
    async def run() -> None:
        q = FairQueue(4, workers=1, keys=16)
        await q.turn(0, 1)
        q.done(0, 1, output=200)  # the first answer the server sees
        before = q.counter(2)
        await q.turn(0, 2)  # key 2 is new: charged everyone's usual answer at dispatch
        assert q.counter(2) - before == W_OUT * 200
        q.done(0, 2, output=200)
        assert q.counter(2) - before == W_OUT * 200  # nothing left to settle

    asyncio.run(run())


def test_more_users_than_places_each_with_one_request_fill_every_place():
    """A team larger than the capacity: every active key's share is below one place, so the keys
    between two turns (nothing asked, still active for ``linger``) were the only light ones and
    every user's one request counted heavy, held to ``light_running`` with places free. One request
    is never heavy: the users fill every place, and a user back from between turns goes at once."""
    async def run() -> None:
        q = FairQueue(4, workers=1, keys=16, reserve=1, light_running=2, linger=3600)
        for k in (1, 2, 3):  # three users between turns (active: their request ended just now)
            await asyncio.wait_for(q.turn(0, k), 1)
            q.done(0, k)
        for k in (4, 5, 6, 7):  # four more users, one request each: 7 active keys, a share of 4/7 each
            await asyncio.wait_for(q.turn(0, k), 1)
        assert q.stats() == {"capacity": 4, "upstream": 4, "waiting": 0, "dispatched": 7}
        back = asyncio.ensure_future(q.turn(0, 1))  # a user between turns asks again
        flood = [asyncio.ensure_future(q.turn(0, 8)) for _ in range(3)]
        await _settle()
        q.done(0, 4)
        await asyncio.wait_for(back, 1)  # the freed place: to the one request, not to the flood
        assert not any(f.done() for f in flood)
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)

    asyncio.run(run())


def test_a_heavy_key_takes_the_free_places_once_the_light_key_has_lingered_with_no_request_ending():
    """The light key's linger ends while the heavy key's requests still run: its waiters go then,
    not when one of its (maybe minutes long) requests next ends and runs the queue again."""
    async def run() -> None:
        q = FairQueue(4, workers=1, keys=16, reserve=1, light_running=2, linger=2.0)
        heavy = [asyncio.ensure_future(q.turn(0, 1)) for _ in range(6)]
        await _settle()
        light = asyncio.ensure_future(q.turn(0, 2))
        await _settle()
        q.done(0, 1)
        await asyncio.wait_for(light, 1)
        q.done(0, 2)  # the light key is idle: the heavy key stays at 3 upstream for its linger
        await _settle()
        assert q.stats() == {"capacity": 4, "upstream": 3, "waiting": 2, "dispatched": 5}
        # nothing ends from here on: the linger's end alone lets the heavy key fill every place
        await asyncio.wait_for(heavy[4], 10)
        assert q.stats() == {"capacity": 4, "upstream": 4, "waiting": 1, "dispatched": 6}
        heavy[5].cancel()
        await asyncio.gather(*heavy, return_exceptions=True)

    asyncio.run(run())


def test_a_lower_priority_light_key_holds_back_no_higher_priority_flood():
    """Priority goes first: a key of priority 1 flooding is neither held to ``light_running`` nor
    kept out of the reserve for a key of priority -1 (a background job's one request); that key's
    request waits for the flood, as it would in VTC order. A light key of the same priority still
    gets both (the tests above)."""
    async def run() -> None:
        q = FairQueue(8, workers=1, keys=16, reserve=1, light_running=4, linger=3600)
        flood = [asyncio.ensure_future(q.turn(0, 1, priority=1)) for _ in range(12)]
        await _settle()
        background = asyncio.ensure_future(q.turn(0, 2, priority=-1))
        await _settle()
        for _ in range(4):  # four of the flood end: each place goes to the flood's next request
            q.done(0, 1)
            await _settle()
        assert not background.done() and q.stats() == {"capacity": 8, "upstream": 8, "waiting": 1, "dispatched": 12}
        for _ in range(8):
            q.done(0, 1)
        await asyncio.wait_for(background, 1)
        await asyncio.gather(*flood)

    asyncio.run(run())
