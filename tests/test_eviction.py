"""The one eviction rule (``supervisor/eviction.py``), alone: a table of targets and snapshots.

Before it, the pool (``ModelPool.victim``) and the on-demand slots (``SlotTable.evict_idle``) each
had their own least-recently-used rule; where they differed is the case "a slot: the older sleeper
goes" below (the slots' rule had no preference for a loaded model, the pool's had: both kept).
"""

from __future__ import annotations

import pytest

from vllama_proxy.supervisor.eviction import Candidate, Held, Need, victim

LOADED, ASLEEP = Held.LOADED, Held.ASLEEP
GPU, SLOT = Need.GPU_MEMORY, Need.SLOT


def c(name: str, held: Held = LOADED, used: float = 0.0, **kw) -> Candidate[str]:
    return Candidate(name, held, used, **kw)


CASES = [
    # (case, need, candidates, victim)
    ("nothing loaded", GPU, [], None),
    ("the least recently used idle one", GPU, [c("a", used=3), c("b", used=1), c("c", used=2)], "b"),
    ("a request in flight (or waiting, or asking to wake) keeps it", GPU, [c("a", used=1, busy=True), c("b", used=2)], "b"),
    ("every one busy: the target waits", GPU, [c("a", busy=True), c("b", busy=True)], None),
    ("pinned never goes, however old", GPU, [c("pinned", used=0, protected=True), c("b", used=5)], "b"),
    ("an operator's model for an on-demand one (--protect-models)", SLOT, [c("op", used=0, protected=True)], None),
    ("not on the GPU the target lacks: frees nothing", GPU, [c("other-gpu", used=0, in_the_way=False), c("b", used=9)], "b"),
    ("not enough even after evicting: nobody in the way may go", GPU,
     [c("pinned", protected=True), c("busy", busy=True), c("elsewhere", in_the_way=False)], None),
    ("GPU memory: a loaded one before an older sleeper (a sleeper frees only its context)", GPU,
     [c("sleeper", ASLEEP, used=1), c("loaded", LOADED, used=2)], "loaded"),
    ("GPU memory: only sleepers: the least recently used sleeper", GPU,
     [c("s1", ASLEEP, used=2), c("s2", ASLEEP, used=1)], "s2"),
    ("GPU memory: the loaded one busy: a sleeper", GPU, [c("sleeper", ASLEEP, used=5), c("loaded", busy=True)], "sleeper"),
    ("a slot: the older sleeper goes (either frees the slot whole)", SLOT,
     [c("sleeper", ASLEEP, used=1), c("loaded", LOADED, used=2)], "sleeper"),
    ("keep_alive -1 does not protect an idle model: it is in the way", GPU, [c("forever", used=1), c("b", used=2)], "forever"),
    ("never used (last_used 0) goes first", SLOT, [c("a", used=5), c("never", used=0)], "never"),
]


@pytest.mark.parametrize("case,need,candidates,expected", CASES, ids=[case[0] for case in CASES])
def test_the_eviction_rule(case, need, candidates, expected):
    assert victim(need, candidates) == expected


def test_the_pool_and_the_slots_ask_the_same_rule(monkeypatch):
    """Neither keeps a rule of its own: both answer what ``eviction.victim`` says."""
    import time

    from conftest import free_port

    from vllama_proxy.models.launch_spec import ModelConfig
    from vllama_proxy.settings import Settings
    from vllama_proxy.supervisor import eviction
    from vllama_proxy.supervisor.pool import Hold, ModelPool
    from vllama_proxy.supervisor.slots import SlotTable
    from vllama_proxy.supervisor.states import State

    asked: list[tuple[Need, list[str]]] = []
    rule = eviction.victim

    def spy(need, candidates):
        candidates = list(candidates)
        asked.append((need, sorted(str(getattr(x.model, "served_name", x.model)) for x in candidates)))
        return rule(need, candidates)

    monkeypatch.setattr(eviction, "victim", spy)
    specs = [ModelConfig(model="/a", name="a", gpu_memory_utilization=0.5), ModelConfig(model="/b", name="b", gpu_memory_utilization=0.6)]
    pool = ModelPool(Settings(workers=1, gpu_check=False, gpu_context_share=0), specs, [free_port() for _ in specs])
    a, b = pool.supervisors
    pool.holds[a], a.state = Hold.SHARE, State.READY
    assert pool.victim(b) is a and asked == [(GPU, ["a"])]

    table = SlotTable(2, [free_port(), free_port()], workers=1, keep_alive=300)
    for i, (name, state) in enumerate((("x", State.SLEEPING), ("y", State.READY))):
        table.claim(ModelConfig(model=f"/{name}", name=name))
        table.boards[i].publish(state, since=time.time(), restarts=0, pid=None, last_error=None, last_output="")
        table.boards[i].touch(60)
        time.sleep(0.01)
    assert table.evict_idle() == "x" and asked[1] == (SLOT, ["x", "y"])  # the older sleeper: a slot's rule
