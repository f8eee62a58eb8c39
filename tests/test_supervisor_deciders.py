"""The supervisor's pure deciders (``supervisor/hang.py``, ``lora_restart.py``, ``respec.py``,
``warm.why_not_asleep``): each decision from the state it is given, no process, no clock."""

from __future__ import annotations

from vllama_proxy.models.adapters import LoraPlan
from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.supervisor.hang import EngineWatch, Load
from vllama_proxy.supervisor.lora_restart import lora_restart
from vllama_proxy.supervisor.respec import respec
from vllama_proxy.supervisor.warm import HOST_RAM_SHORT, NO_SLEEP_MODE, SLEEP_FAILED, why_not_asleep


def test_a_stall_is_asked_at_half_the_timeout_and_hung_at_the_timeout():
    w = EngineWatch(hang_timeout=10, health_interval=1, now=0)
    w.saw(Load(pending=2, generation_tokens=5), 0)  # tokens seen: the clock of the stall starts
    assert w.judge(Load(2, 5), 1, asking=False, answer=None).ask is False  # the stall begins
    assert not w.judge(Load(2, 5), 5.9, asking=False, answer=None).ask  # stalled since 1: 4.9 s
    assert w.judge(Load(2, 5), 6, asking=False, answer=None).ask  # half of 10 s
    assert w.judge(Load(2, 5), 10, asking=True, answer=None).hung is None
    hung = w.judge(Load(2, 5), 11, asking=True, answer=None).hung
    assert hung and "no answer in 5 s" in hung


def test_an_answered_check_is_a_stale_gauge_and_tokens_cancel_the_check():
    w = EngineWatch(hang_timeout=10, health_interval=1, now=0)
    w.saw(Load(3, 7), 0)
    w.judge(Load(3, 7), 1, asking=False, answer=None)
    look = w.judge(Load(3, 7), 7, asking=False, answer=(True, "ok"))
    assert look.stale == {"pending": 3, "no_token_s": 7.0, "answer": "ok"} and look.first and not look.ask
    again = w.judge(Load(3, 7), 8, asking=False, answer=(True, "ok"))
    assert again.stale is not None and not again.first  # the same stall: at info from now
    assert w.judge(Load(3, 7), 13, asking=False, answer=None).ask  # counted again from the answer (8)
    failed = w.judge(Load(3, 7), 14, asking=False, answer=(False, "500"))
    assert failed.hung and failed.hung.endswith("request failed: 500")
    w.saw(Load(3, 9), 15)  # tokens moved: no stall, the check in flight is cancelled
    assert w.judge(Load(3, 9), 15, asking=True, answer=None).cancel


def test_an_idle_model_may_be_put_away_despite_a_standing_gauge():
    w = EngineWatch(hang_timeout=0, health_interval=5, now=0)
    w.saw(Load(6, 100), 0)
    assert not w.idle(Load(6, 100), 4) and w.idle(Load(6, 100), 5)  # an H200 gauge that stood at 6
    assert w.idle(Load(0, 100), 1) and not w.idle(None, 10)


def test_lora_restart_at_once_in_launch_mode_and_when_idle_in_runtime_mode():
    running = LoraPlan({"a": "/a"}, max_rank=16, max_loras=4)
    more = LoraPlan({"a": "/a", "b": "/b"}, max_rank=16, max_loras=4)
    assert lora_restart(running, more, read=True, mode="launch", in_use=True).now
    waits = lora_restart(running, more, read=True, mode="runtime", in_use=True)
    assert waits.now is False and waits.wanted is None  # runtime mode loads b without a restart
    bigger = LoraPlan({"a": "/a", "b": "/b"}, max_rank=64, max_loras=4)
    held = lora_restart(running, bigger, read=True, mode="runtime", in_use=True)
    assert held.wanted == bigger and held.waits and not held.now
    later = lora_restart(running, held.wanted, read=False, mode="runtime", in_use=True)
    assert later.wanted == bigger and not later.waits and not later.now  # logged once, kept
    assert lora_restart(running, held.wanted, read=False, mode="runtime", in_use=False).now
    assert lora_restart(running, None, read=False, mode="launch", in_use=False) == lora_restart(running, running, read=True,
                                                                                              mode="launch", in_use=False)


def test_respec_reads_the_slot_only_when_it_took_another_model():
    reads = []

    def read():
        reads.append(1)
        return ModelConfig(model="Qwen/Q", name="q")

    assert respec(3, 3, read) is None and not reads
    new = respec(3, 4, read, prepare=lambda s: s.model_copy(update={"vllm_args": ["--x"]}))
    assert new is not None and new.generation == 4 and new.spec.vllm_args == ["--x"] and reads == [1]
    assert respec(3, 5, lambda: None) is None  # moved but empty (a claim undone)


def test_why_an_idle_model_stops_rather_than_sleeps():
    assert why_not_asleep(False, False, None, None, 0) == NO_SLEEP_MODE
    assert why_not_asleep(True, True, None, None, 0) == SLEEP_FAILED
    assert why_not_asleep(True, False, 10, 13, 4) == HOST_RAM_SHORT
    assert why_not_asleep(True, False, 10, 14, 4) is None


def test_a_sleeping_model_is_stopped_for_an_eviction_its_slot_or_its_time_asleep():
    from vllama_proxy.supervisor.room import MakeRoom, SleepOver, SlotWanted
    from vllama_proxy.supervisor.warm import leave_sleep

    asked = MakeRoom("other")
    assert leave_sleep(asked, True, 0, 99) is asked  # what was asked first stays the reason
    assert leave_sleep(None, True, 60, 0) == SlotWanted()
    assert leave_sleep(None, False, 60, 59.9) is None and leave_sleep(None, False, 60, 60) == SleepOver(60)
    assert leave_sleep(None, False, -1, 10**9) is None  # --sleep-unload-after negative: never


def test_restarts_back_off_then_a_crash_loop_retries_slowly():
    from vllama_proxy.supervisor.restarts import Backoff, backoff, failures_before

    knobs = dict(crash_loop_limit=4, initial=1.0, cap=3.0, failed_retry=300.0)
    assert [backoff(n, **knobs) for n in (1, 2, 3, 4, 9)] == [
        Backoff(False, 1.0), Backoff(False, 2.0), Backoff(False, 3.0), Backoff(True, 300.0), Backoff(True, 300.0)]
    assert failures_before(3, ran=299.9, reset_after=300) == 3 and failures_before(3, ran=300, reset_after=300) == 0
