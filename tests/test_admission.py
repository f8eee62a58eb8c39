"""One admission bound for the whole server, and the shared counters under contention (issue 12).

The contention tests run real processes (spawned, as ``--workers`` are) hammering the same
shared memory; a violation is counted in shared memory by whoever sees it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

import httpx

from conftest import SERVED, start_proxy, stop
from vllama_proxy.api.request.admission import AdmissionBound, default_max_num_seqs, running_capacity
from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.ipc.lock import SharedLock
from vllama_proxy.supervisor.states import State
from vllama_proxy.supervisor.status import StatusBoard

CTX = multiprocessing.get_context("spawn")
ROUNDS = 3000


def _enter_leave(bound: AdmissionBound, slot: int, inside, over, go) -> None:
    go.wait()
    for _ in range(ROUNDS):
        if bound.enter(slot, 0) >= 0:
            with inside.get_lock():
                inside.value += 1
                if inside.value > bound.limit:
                    over.value += 1
            with inside.get_lock():
                inside.value -= 1
            bound.leave_key(slot, 0)


def test_bound_holds_under_contention():
    bound = AdmissionBound(limit=3, workers=4, ctx=CTX)
    inside, over, go = CTX.Value("i", 0), CTX.Value("i", 0), CTX.Event()
    procs = [CTX.Process(target=_enter_leave, args=(bound, i, inside, over, go)) for i in range(4)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert over.value == 0 and bound.in_flight == 0


def _hold_and_die(lock) -> None:
    with lock.held():
        os._exit(0)  # killed inside a critical section


def test_a_holder_that_dies_releases_the_lock():
    lock = SharedLock()
    p = CTX.Process(target=_hold_and_die, args=(lock,))
    p.start()
    p.join(30)
    t0 = time.monotonic()
    with lock.held():
        pass
    assert time.monotonic() - t0 < 1.0  # the kernel released it with the process


def test_a_worker_is_capped_by_its_own_share_of_files():
    bound = AdmissionBound(limit=10, workers=2, ctx=CTX, per_worker=3)
    assert [bound.enter(0, 0) >= 0 for _ in range(4)] == [True, True, True, False]
    assert bound.enter(1, 0) >= 0


def test_dead_worker_gives_its_places_back():
    bound = AdmissionBound(limit=2, workers=2, ctx=CTX)
    assert bound.enter(1, 0) >= 0 and bound.enter(1, 1) >= 0 and bound.enter(0, 0) < 0
    bound.reset_worker(1)
    assert bound.enter(0, 0) >= 0 and bound.in_flight == 1 and bound.key_in_flight(1) == 0


def _requests(board: StatusBoard, slot: int, violations, go, stop_) -> None:
    go.wait()
    while not stop_.is_set():
        if board.try_begin(slot):
            if board._closing.value:  # closed while this request is in flight: the race issue 12 named
                violations.value += 1
            board.end(slot)


def _supervisor(board: StatusBoard, violations, closes, go, stop_) -> None:
    go.wait()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if board.try_close():
            closes.value += 1
            for _ in range(50):  # "putting vLLM to sleep": nothing may be in flight meanwhile
                if board.in_flight:
                    violations.value += 1
            board.reopen()
    stop_.set()


def test_close_and_begin_exclude_each_other_across_processes():
    board = StatusBoard("m", CTX, workers=3)
    board.publish(State.READY, since=time.time(), restarts=0, pid=None, last_error=None, last_output="")
    violations, closes, go, stop_ = CTX.Value("i", 0), CTX.Value("i", 0), CTX.Event(), CTX.Event()
    procs = [CTX.Process(target=_requests, args=(board, i, violations, go, stop_)) for i in range(3)]
    procs.append(CTX.Process(target=_supervisor, args=(board, violations, closes, go, stop_)))
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert closes.value > 0  # it did get idle moments to close in
    assert violations.value == 0 and board.in_flight == 0


def test_running_capacity_counts_data_parallel_and_gpu_defaults():
    specs = [ModelConfig(model="/a", name="a", vllm_args=["--data-parallel-size", "2"]),
             ModelConfig(model="/b", name="b", vllm_args=["--max-num-seqs", "64"])]
    assert running_capacity(specs, default_max_num_seqs(141 * 1024**3, "NVIDIA H200")) == 1024 * 2 + 64
    assert default_max_num_seqs(80 * 1024**3, "NVIDIA A100-SXM4-80GB") == 256
    assert default_max_num_seqs(24 * 1024**3, "NVIDIA L4") == 256
    assert default_max_num_seqs(None) == 1024  # --upstream: unknown, so the larger


def test_bound_is_shared_by_every_worker(fake):
    # 4 running + 3 queued over 3 workers: exactly 7 held streams get in, wherever the kernel sends
    # them (a per-worker split, ceil(7/3) = 3 each, would admit up to 9)
    p = start_proxy(fake.url, "--workers", "3", "--max-running", "4", "--max-queue", "3", "--retry-after", "5")
    try:
        async def scenario():
            async with httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                async def one():
                    cm = c.stream("POST", p.url + "/api/generate", json={"model": SERVED, "prompt": "x [[fault:hang]]"})
                    r = await cm.__aenter__()
                    return cm, r

                got = await asyncio.gather(*(one() for _ in range(14)))
                statuses = sorted(r.status_code for _, r in got)
                retry = {r.headers.get("Retry-After") for _, r in got if r.status_code == 503}
                for cm, _ in got:
                    await cm.__aexit__(None, None, None)
                return statuses, retry

        statuses, retry = asyncio.run(scenario())
        assert statuses == [200] * 7 + [503] * 7
        assert retry == {"5"}
    finally:
        stop(p.proc)


def test_fair_shares_and_a_dead_workers_requests_leave_their_keys_counts_too():
    from vllama_proxy.api.request.admission import FULL, KEY_LIMIT, OVER_SHARE, AdmissionBound
    bound = AdmissionBound(8, workers=2)  # 7 of 8 places for a key alone, 1 kept for a newcomer
    assert [bound.enter(1, 7, fair=True) for _ in range(8)] == [0, 1, 2, 3, 4, 5, 6, OVER_SHARE]  # worker 1, key 7
    assert bound.enter(0, 9, fair=True) == 0  # a newcomer finds room
    assert bound.enter(0, 9, fair=True) == FULL
    bound.reset_worker(1)  # worker 1 died with key 7's seven requests
    assert bound.in_flight == 1 and bound.key_in_flight(7) == 0 and bound.enter(0, 7, fair=True) == 0
    assert bound.enter(0, 7, key_max=1) == KEY_LIMIT
    bound.leave_key(0, 7)
    bound.leave_key(0, 9)
    assert bound.in_flight == 0 and [bound.enter(0, 9, fair=True) for _ in range(7)] == list(range(7))  # key 9 alone again: 7
