"""The supervisor is told, not polled (issue 41.1): requests, evictions and room are messages to a
model's owner loop (``supervisor/inbox.py``), and waiters wait on its news.

In-process against the stand-in vLLM (``tests/bin/vllm``). Every ``asyncio.sleep`` that vllama's own
code awaits is recorded: before the inbox, the owner loop, the waiters and the pool each polled
(``lifecycle.py`` every 20 and 100 ms, ``status.py`` every 20 ms, ``pool.py`` every 50 ms).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
from conftest import ROOT, TESTS, free_port

from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.pool import ModelPool
from vllama_proxy.supervisor.states import State

#: Waits on something outside vllama (vLLM's process tree going away), not polling between its parts.
EXTERNAL = {"vllama_proxy.supervisor.child"}


@pytest.fixture
def polls(monkeypatch):
    """The sleeps vllama's own modules await from now on: ``[(module, seconds)]``."""
    monkeypatch.setenv("PATH", f"{TESTS / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_VLLM_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_VLLM_START_DELAY", "0.3")
    seen: list[tuple[str, float]] = []
    real = asyncio.sleep

    async def sleep(delay, *args, **kwargs):
        module = sys._getframe(1).f_globals.get("__name__", "")
        if module.startswith("vllama_proxy.") and module not in EXTERNAL:
            seen.append((module, delay))
        return await real(delay, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return seen


def pool_of(tmp_path, *shares: float, **kw) -> ModelPool:
    s = Settings(**{"workers": 1, "gpu_check": False, "gpu_context_share": 0, "startup_poll_interval": 0.1, "health_interval": 30,
                    "stop_grace": 2, "load_timeout": 30, "state_dir": tmp_path / "state", **kw})
    specs = [ModelConfig(model=f"/m{i}", name=f"m{i}", gpu_memory_utilization=share, preload=False) for i, share in enumerate(shares)]
    return ModelPool(s, specs, [free_port() for _ in specs])


async def test_a_request_loads_a_model_by_message_and_every_waiter_is_answered_once(tmp_path, polls):
    pool = pool_of(tmp_path, 0.5)
    (sup,) = pool.supervisors
    await pool.start()
    try:
        assert sup.state is State.UNLOADED
        await asyncio.sleep(0.3)  # the test's own: an owner loop that polled would have slept by now
        waiters = [asyncio.ensure_future(sup.board.wait_ready(timeout=30)) for _ in range(5)]
        answered = []
        for w in waiters:
            w.add_done_callback(lambda f: answered.append(f))
        await asyncio.gather(*waiters)
        assert sup.state is State.READY and len(answered) == 5 and len(set(map(id, answered))) == 5
    finally:
        await pool.stop()
    assert polls == []


async def test_a_model_waiting_for_room_is_told_when_its_neighbour_made_it(tmp_path, polls):
    """The handshake: b's request asks b's owner (WANT); the pool answers b Waiting with a as the
    victim; b asks a to make room (EVICT); a stops (its transition tells b: ROOM); b is admitted."""
    pool = pool_of(tmp_path, 0.6, 0.6)
    a, b = pool.supervisors
    told: list[tuple[State, str | None]] = []
    a.listeners.append(lambda state, reason: told.append((state, reason)))
    await pool.start()
    try:
        await a.board.wait_ready(timeout=30)
        a.board.touch(60)
        await b.board.wait_ready(timeout=30)
        assert b.state is State.READY and a.state is State.UNLOADED
        assert told[-1][0] is State.UNLOADED and told[-1][1].startswith("evicted to make room for m1")
    finally:
        await pool.stop()
    assert polls == []


async def test_the_inbox_keeps_one_unread_message_of_a_kind_and_drops_what_the_step_does_not_ask():
    from vllama_proxy.supervisor.inbox import Inbox, Kind

    inbox = Inbox()
    for kind in (Kind.WANT, Kind.IDLE, Kind.WANT, Kind.ROOM, Kind.WANT):
        inbox.post(kind)
    assert await inbox.next({Kind.ROOM}) is Kind.ROOM  # WANT and IDLE before it: dropped (the board holds them)
    assert await inbox.next({Kind.WANT}, timeout=0) is None
    inbox.post(Kind.STOP)
    assert await inbox.next({Kind.WANT}) is Kind.STOP  # stop is always heard


async def test_a_ready_model_reads_its_created_adapters_only_when_a_create_tells_it(tmp_path, polls, monkeypatch):
    """Issue 42.3: a ready vLLM's watch read ``created.json`` and each adapter's config at every health
    check of every model (``--health-interval``), to find an adapter created since it started. Now the
    created models are read when it starts and when a create tells it (``StatusBoard.adapters_changed``:
    an ``ADAPTERS`` message); an adapter it already declares restarts nothing."""
    from vllama_proxy.models.created import CreatedModel, CreatedStore
    from vllama_proxy.supervisor import lifecycle, probes

    lora = str(ROOT / "tests" / "assets" / "tool-lora")
    CreatedStore(tmp_path / "state" / "created.json").put(CreatedModel(name="mango", base="m0", parent="m0", adapters={"mango": lora}))
    reads: list[float] = []
    read_again = asyncio.Event()
    plan = lifecycle.Supervisor.lora_plan

    def counted_plan(self):
        reads.append(time.monotonic())
        if len(reads) == 2:
            loop.call_soon_threadsafe(read_again.set)  # read on a thread
        return plan(self)

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(lifecycle.Supervisor, "lora_plan", counted_plan)
    probed = 0
    checks = asyncio.Event()
    health = probes.health

    async def counted_health(upstream):
        nonlocal probed
        probed += 1
        if probed >= 10:
            checks.set()
        return await health(upstream)

    pool = pool_of(tmp_path, 0.5, health_interval=0.05)
    (sup,) = pool.supervisors
    await pool.start()
    try:
        await sup.board.wait_ready(timeout=30)
        assert "--lora-modules" in sup.argv() and len(reads) == 1  # read once, for the start
        monkeypatch.setattr(probes, "health", counted_health)
        await asyncio.wait_for(checks.wait(), 30)  # ten health checks of the ready vLLM
        assert len(reads) == 1, f"created.json read {len(reads) - 1} times over {probed} health checks"
        pid = sup.child.pid
        sup.board.adapters_changed()  # as a create in any worker does
        await asyncio.wait_for(read_again.wait(), 30)
        assert len(reads) == 2
        probed, checks = 0, asyncio.Event()
        await asyncio.wait_for(checks.wait(), 30)  # the watch went on: declared already, no restart
        assert sup.state is State.READY and sup.child.pid == pid and len(reads) == 2
    finally:
        await pool.stop()
    assert polls == []


def idle_worker(index: int, parent: int, *args: object) -> None:
    """A worker process that serves nothing (``WorkerPool``'s target in the test below): it waits for SIGTERM."""
    import signal

    signal.sigwait({signal.SIGTERM})


class CountedBound:
    """The admission bound's one call a dead worker makes (its slot given back), counted."""

    def __init__(self) -> None:
        self.reset: list[int] = []

    def reset_worker(self, index: int) -> None:
        self.reset.append(index)


async def test_a_dead_worker_is_replaced_as_it_dies_and_a_stop_waits_on_exits_not_a_timer(polls):
    """The front's extra workers (``front/workers.py``): a worker's death is told by its sentinel (the loop
    reads it), not found by a look every second; the stop returns when the last exit is told, not by a
    look every 50 ms (main: ``_watch`` slept 1 s per look, ``stop`` 50 ms)."""
    import signal

    from vllama_proxy.front.workers import WorkerPool

    bound = CountedBound()
    pool = WorkerPool(Settings(workers=3, gpu_check=False), None, [], None, bound, target=idle_worker)  # type: ignore[arg-type]
    await pool.start(2)
    first = pool._procs[1]
    os.kill(first.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (pool._procs.get(1) in (None, first)) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # the test's own wait for the event (not vllama's: not recorded)
    assert pool._procs.get(1) not in (None, first), "worker 1 was not replaced"
    assert bound.reset == [1]  # its places given back once
    alive = list(pool._procs.values())
    await pool.stop(120)
    assert pool._procs == {}
    assert all(p.exitcode is not None for p in alive), [(p.pid, p.exitcode) for p in alive]
    assert first.exitcode == -signal.SIGKILL
    assert [s for s in polls if s[0] == "vllama_proxy.front.workers"] == []


def end_requests(bound: object, slot: int, key: int, count: int) -> None:
    """In another process (a worker): ``count`` requests of ``slot`` and ``key`` end."""
    for _ in range(count):
        bound.leave_key(slot, key)  # type: ignore[attr-defined]


async def test_a_drain_is_told_by_the_last_request_to_end_in_any_worker(polls):
    """A stop waits for the requests in flight in every worker (``front/server.py`` ``wait_idle``): the last one
    to end rings the admission bound's bell, in whichever process it ends; main looked at the count every 0.1 s."""
    import multiprocessing

    from vllama_proxy.api.request.admission import AdmissionBound
    from vllama_proxy.front.server import wait_idle

    bound = AdmissionBound(16, 2)
    for slot in (0, 1, 1):
        assert bound.enter(slot, 7) >= 0
    bound.start_draining()
    hurry = asyncio.Event()
    waiting = asyncio.ensure_future(wait_idle(bound, 120, hurry))
    bound.leave_key(0, 7)  # this process's request ends: two are left in worker 1
    await asyncio.sleep(0)
    assert not waiting.done()
    worker = multiprocessing.get_context("spawn").Process(target=end_requests, args=(bound, 1, 7, 2))
    worker.start()
    assert await asyncio.wait_for(waiting, 120) is True  # told by the worker's last end
    await asyncio.to_thread(worker.join, 60)
    assert bound.in_flight == 0
    assert [s for s in polls if s[0] in ("vllama_proxy.front.server", "vllama_proxy.api.request.admission")] == []
    # a request in flight that does not end: the wait ends at its timeout, or at once when hurried
    assert bound.enter(0, 7) >= 0
    assert await asyncio.wait_for(wait_idle(bound, 0.2, asyncio.Event()), 60) is False
    hurry.set()
    assert await asyncio.wait_for(wait_idle(bound, 120, hurry), 60) is False
