"""The Supervisor in-process against the stand-in vllm: waiting for ready (on its status board, as requests do) and the startup deadline."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from conftest import TESTS, free_port
from vllama_proxy.errors import UpstreamUnavailable
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.launch import NO_MEDIA_DOMAIN
from vllama_proxy.supervisor.lifecycle import Supervisor
from vllama_proxy.supervisor.room import MakeRoom
from vllama_proxy.supervisor.states import State
from vllama_proxy.supervisor.status import StatusBoard


@pytest.fixture
def knobs(monkeypatch):
    monkeypatch.setenv("PATH", f"{TESTS / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_VLLM_PYTHON", sys.executable)
    return monkeypatch


def settings(tmp_path, **kw) -> Settings:
    (tmp_path / "m").mkdir(exist_ok=True)
    base = dict(model=str(tmp_path / "m"), gpu_check=False, startup_poll_interval=0.1, health_interval=0.2,
                stop_grace=2, restart_backoff_initial=0.1, crash_loop_limit=2, failed_retry_interval=60)
    return Settings(**{**base, **kw})


async def run(s: Settings) -> Supervisor:
    sup = Supervisor(s, s.configured_models()[0], port=free_port(), board=StatusBoard("m"))
    await sup.start()
    return sup


async def test_ready_is_awaited_on_the_board_through_startup(tmp_path, knobs):
    knobs.setenv("FAKE_VLLM_START_DELAY", "1.5")
    sup = await run(settings(tmp_path))
    try:
        assert sup.state is State.STARTING
        await sup.board.wait_ready(20)
        assert sup.state is State.READY and sup.board.ready
    finally:
        await sup.stop()
    assert sup.state is State.STOPPED
    with pytest.raises(UpstreamUnavailable, match="stopped"):
        await sup.board.wait_ready(1)


async def test_progress_pushes_the_startup_deadline(tmp_path, knobs):
    # loading takes 8 s, the deadline is 4 s, but every 0.5 s vLLM logs loading progress. The deadline
    # leaves the stand-in's interpreter room to start on a busy machine (its first progress line came
    # after 1 s there, beside a CPU hog), so that only the loading outlasts it.
    knobs.setenv("FAKE_VLLM_START_DELAY", "8")
    sup = await run(settings(tmp_path, startup_timeout=4.0, startup_progress_extension=3.0))
    try:
        await sup.board.wait_ready(20)
        assert sup.restarts == 0
    finally:
        await sup.stop()


async def test_deadline_without_progress_allowance_fails(tmp_path, knobs):
    knobs.setenv("FAKE_VLLM_START_DELAY", "3")
    sup = await run(settings(tmp_path, startup_timeout=1.0, startup_progress_extension=0.0))
    try:
        with pytest.raises(UpstreamUnavailable, match="failed to load"):
            await sup.board.wait_ready(20)
        assert sup.state is State.FAILED and "not ready after" in sup.last_error
    finally:
        await sup.stop()


# --- the pool's accounting of GPU memory shares (no process started) ---------------------------

def test_pool_fits_per_gpu_and_picks_the_least_recently_used_idle_victim(tmp_path):
    from vllama_proxy.models.launch_spec import ModelConfig
    from vllama_proxy.supervisor.pool import Hold, ModelPool

    specs = [
        ModelConfig(model="/a", name="a", gpu_memory_utilization=0.5, gpus=[0]),
        ModelConfig(model="/b", name="b", gpu_memory_utilization=0.3, gpus=[0]),
        ModelConfig(model="/big", name="big", gpu_memory_utilization=0.6, tensor_parallel_size=2, gpus=[0, 1]),
        ModelConfig(model="/c", name="c", gpu_memory_utilization=0.7, gpus=[1]),
        ModelConfig(model="/p", name="p", gpu_memory_utilization=0.2, gpus=[0], pin=True),
    ]
    pool = ModelPool(Settings(workers=1, gpu_check=False, gpu_context_share=0), specs, [free_port() for _ in specs])
    a, b, big, c, p = pool.supervisors
    assert pool.fits(a) and pool.fits(big)
    pool.holds[a] = pool.holds[b] = Hold.SHARE  # 0.8 of GPU 0 taken
    assert pool.fits(c)  # GPU 1 is free
    assert not pool.fits(big)  # 0.6 more on GPU 0 does not fit, whatever GPU 1 has
    assert pool.fits(p)  # 0.2 still fits beside 0.8: exactly 1.0
    pool.holds[c] = Hold.SHARE
    for sup in (a, b, c):
        sup.state = State.READY
    a.board.touch(60)
    time.sleep(0.01)
    b.board.touch(60)
    time.sleep(0.01)
    c.board.touch(60)
    assert pool.victim(big) is a  # least recently used among those sharing a GPU with it
    a.board.publish(State.READY, since=time.time(), restarts=0, pid=None, last_error=None, last_output="")
    assert a.board.try_begin(0)  # a request in flight: not evictable
    assert pool.victim(big) is b
    a.board.end(0)
    a.board.wait_begin(0)  # a request waiting for it (it just became ready): not evictable
    assert pool.victim(big) is b
    a.board.wait_end(0)
    b.board.request_wake()  # wanted by waiting requests: not evictable either
    assert pool.victim(big) is a
    pool.holds[p], p.state = Hold.SHARE, State.READY
    p.board._last_used.value = 0.0  # the oldest of all, but pinned
    assert pool.victim(big) is a
    assert pool.victim(c) is None  # c fits: nothing to evict for it
    del pool.holds[c]
    pool.holds[big], big.state = Hold.SHARE, State.READY
    big.board.touch(60)  # the most recently used of all
    assert pool.victim(c) is big  # short on GPU 1 only: a and b, on GPU 0, would free nothing there


async def test_the_pool_answers_with_verdicts_and_keeps_its_own_record(tmp_path):
    """Issue 29: the pool decides (a room.py verdict), records who holds what, and writes nothing
    of a supervisor's; the supervisor acts on the verdict."""
    from vllama_proxy.models.launch_spec import ModelConfig
    from vllama_proxy.supervisor.pool import Hold, ModelPool
    from vllama_proxy.supervisor.room import Admitted, Waiting

    specs = [ModelConfig(model="/a", name="a", gpu_memory_utilization=0.5), ModelConfig(model="/b", name="b", gpu_memory_utilization=0.6)]
    pool = ModelPool(Settings(workers=1, gpu_check=False, gpu_context_share=0), specs, [free_port() for _ in specs])
    a, b = pool.supervisors
    assert await pool.admit(a, check_fit=True) == Admitted() and pool.holds == {a: Hold.SHARE}
    verdict = await pool.admit(b, check_fit=True)  # a is starting (admitted, not yet ready): starts take turns
    assert verdict == Waiting("waiting for a to finish loading on the same GPU", neighbour_loading=True)
    a.state = State.READY
    a.board.touch(60)
    verdict = await pool.admit(b, check_fit=False)
    assert verdict == Waiting("no room: needs 0.6 of GPU 0, held by a (0.5, ready)", neighbour_loading=False, victim=a)
    assert b not in pool.holds and b.last_error is None and b.board.last_error is None  # nothing of b's written
    a.evict(MakeRoom("b"))
    assert (await pool.admit(b, check_fit=False)).victim is None  # a is on its way out: nobody else is asked
    pool.slept(a)
    a.state = State.SLEEPING
    assert await pool.admit(b, check_fit=False) == Admitted() and pool.holds == {a: Hold.CONTEXT, b: Hold.SHARE}
    pool.released(a)
    assert pool.holds == {b: Hold.SHARE}


def test_pool_counts_each_vllm_context_and_stops_a_sleeping_one_only_when_no_ready_one_helps(tmp_path):
    from vllama_proxy.models.launch_spec import ModelConfig
    from vllama_proxy.supervisor.pool import Hold, ModelPool

    specs = [ModelConfig(model=f"/{n}", name=n, gpu_memory_utilization=u) for n, u in (("a", 0.5), ("b", 0.5), ("z", 0.45), ("c", 0.45))]
    pool = ModelPool(Settings(workers=1, gpu_check=False), specs, [free_port() for _ in specs])  # context share 0.01
    a, b, z, c = pool.supervisors
    pool.holds[a] = Hold.SHARE
    assert not pool.fits(b)  # 0.5 + 0.01 twice is over the GPU: vLLM's own check would refuse b
    assert pool.fits(z)  # 0.51 + 0.46
    pool.holds[z], z.state, a.state = Hold.SHARE, State.READY, State.READY
    z.board.touch(60)
    assert not pool.fits(c) and pool.victim(c) is a  # the least recently used ready one
    pool.holds[a], a.state = Hold.CONTEXT, State.SLEEPING  # asleep: only its context, 0.01
    assert pool.fits(c)  # 0.01 + 0.46 + 0.46
    big = ModelConfig(model="/big", name="big", gpu_memory_utilization=0.99)
    pool2 = ModelPool(Settings(workers=1, gpu_check=False), [specs[0], big], [free_port(), free_port()])
    sleeper, wanted = pool2.supervisors
    pool2.holds[sleeper], sleeper.state = Hold.CONTEXT, State.SLEEPING
    assert not pool2.fits(wanted) and pool2.victim(wanted) is sleeper  # no ready model to evict: stop the sleeping one


@pytest.mark.parametrize("allowed,vllm_args,expected", [
    ([], [], ["--allowed-media-domains", NO_MEDIA_DOMAIN]),
    (["images.example.com", "cdn.example.com"], [], ["--allowed-media-domains", "images.example.com", "cdn.example.com"]),
    (["*"], [], []),
    ([], ["--allowed-media-domains", "mine.example"], []),  # the user's own flag after -- wins
    ([], ["--allowed-media-domains=mine.example"], []),
])
def test_vllm_fetches_no_media_urls_unless_allowed(tmp_path, allowed, vllm_args, expected):
    """Issue 19: /v1/* passthrough can name image URLs, which vLLM would fetch from any host."""
    s = settings(tmp_path, allowed_media_domains=allowed, vllm_args=vllm_args)
    argv = Supervisor(s, s.configured_models()[0], port=1, board=StatusBoard("m")).argv()
    flags = argv[argv.index("--served-model-name") + 2:]
    assert flags[:len(expected)] == expected
    assert flags.count("--allowed-media-domains") + sum(a.startswith("--allowed-media-domains=") for a in flags) == (1 if expected or vllm_args else 0)


async def test_vllm_is_launched_with_media_redirects_off(tmp_path, knobs):
    sup = await run(settings(tmp_path))
    try:
        await sup.board.wait_ready(20)
        environ = open(f"/proc/{sup.child.pid}/environ", "rb").read().split(b"\0")
        assert b"VLLM_MEDIA_URL_ALLOW_REDIRECTS=0" in environ
    finally:
        await sup.stop()


async def test_rejected_arguments_are_failed_at_once_with_vllms_message(tmp_path, knobs):
    sup = await run(settings(tmp_path, vllm_args=["--fake-invalid-option"], crash_loop_limit=5))
    try:
        # the event is FAILED with no restart ("at once": never retried); 120 s only ends a hang: in CI this
        # supervisor's launch waited 33 s for the CPU beside the real-engine tier's vLLM start (nice -5, 2 cores)
        t0 = time.monotonic()
        while sup.state is not State.FAILED and time.monotonic() - t0 < 120:
            await asyncio.sleep(0.05)
        assert sup.state is State.FAILED and sup.restarts == 0
        assert sup.last_error == "vLLM rejected its arguments: vllm serve: error: unrecognized arguments: --fake-invalid-option"
        with pytest.raises(UpstreamUnavailable, match="unrecognized arguments"):
            await sup.board.wait_ready(1)
        await asyncio.sleep(1.0)
        assert sup.state is State.FAILED and sup.restarts == 0  # not retried: only a new configuration helps
    finally:
        await sup.stop()


async def test_the_load_check_reads_what_prometheus_clients_parser_reads():
    """``probes.load`` scans vLLM's ``/metrics`` for three samples instead of parsing the whole text
    (worker 0 serves requests too): it must agree with prometheus_client's parser, on two engines'
    samples, a histogram, a label value with a brace, and a sample with a timestamp."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from vllama_proxy.supervisor import probes
    from vllama_proxy.upstream import Upstream

    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="a}b"} 4.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0 1700000000000',
        "# TYPE vllm:generation_tokens counter",
        'vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0',
        'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e+09',
        'vllm:generation_tokens_total{engine="1",model_name="m"} 1e3',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        *(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{b}",model_name="m"}} 7.0' for b in ("0.001", "0.1", "+Inf")),
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0',
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5',
        "",
    ])
    pending = tokens = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                pending += s.value
            elif s.name == "vllm:generation_tokens_total":
                tokens += s.value
    assert (pending, tokens) == (9.0, 2234.0)

    app = web.Application()
    app.router.add_get("/metrics", lambda _r: web.Response(text=text, content_type="text/plain"))
    async with TestServer(app) as server:
        up = Upstream(str(server.make_url("")))
        await up.start()
        try:
            assert await probes.load(up) == probes.Load(pending, tokens)
        finally:
            await up.close()


# -- the port each vLLM listens on ---------------------------------------------------------------


def test_a_vllms_port_is_one_the_kernel_never_gives_an_outgoing_connection(monkeypatch):
    """A vLLM's port is kept for vllama's life and bound again at every restart: taken from the
    ephemeral range (``bind(0)``), a client socket could hold it while vLLM is down."""
    import socket
    from vllama_proxy.supervisor import ports
    low, high = map(int, ports.EPHEMERAL_RANGE.read_text().split())
    picked = [ports.free_loopback_port() for _ in range(40)]
    assert len(set(picked)) == 40 and all(1024 <= p < low for p in picked)
    # one of two ports in use (a listener, or a connection's local end): the other is given
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        held = taken.getsockname()[1]
        free = free_port()
        monkeypatch.setattr(ports, "listen_ports", lambda: range(min(held, free), max(held, free) + 1, abs(free - held)))
        monkeypatch.setattr(ports, "_given", set())
        assert ports.free_loopback_port() == free


async def test_a_create_waits_for_the_owners_news_that_its_model_left_ready_not_a_poll():
    """The create route, once it asked for a restart, waits on the owner's news (each status it
    publishes rings every process) until the model leaves READY: told at once, no 0.2 s poll."""
    board = StatusBoard("m")
    board.publish(State.READY, since=time.time(), restarts=0, pid=1, last_error=None, last_output="")
    assert await board.wait_left_ready(0.3) is False  # still ready: False after the timeout
    waiting = asyncio.ensure_future(board.wait_left_ready(60))
    await asyncio.sleep(0)  # it looked, and waits on its news
    assert not waiting.done()
    board.publish(State.RESTARTING, since=time.time(), restarts=1, pid=1, last_error=None, last_output="")
    assert await asyncio.wait_for(waiting, 5) is True


def test_vllm_takes_as_many_stop_strings_as_vllama_lets_through(monkeypatch, tmp_path):
    """vLLM 0.32 refuses more than VLLM_MAX_STOP_STRINGS (4) stop strings; vllama bounds them itself
    (ollama_types.MAX_STOPS) and launches vLLM with the same bound; an operator's own value wins."""
    from vllama_proxy.api.ollama.types import MAX_STOPS
    from vllama_proxy.models.adapters import LoraPlan
    from vllama_proxy.supervisor.launch import MAX_STOP_STRINGS, vllm_env
    assert MAX_STOP_STRINGS == MAX_STOPS
    monkeypatch.delenv("VLLM_MAX_STOP_STRINGS", raising=False)
    s = Settings(model=str(tmp_path), state_dir=tmp_path, gpu_check=False)
    spec = s.configured_models()[0]
    assert vllm_env(s, spec, sleep_mode=False, lora=LoraPlan())["VLLM_MAX_STOP_STRINGS"] == str(MAX_STOPS)
    monkeypatch.setenv("VLLM_MAX_STOP_STRINGS", "8")
    assert vllm_env(s, spec, sleep_mode=False, lora=LoraPlan())["VLLM_MAX_STOP_STRINGS"] == "8"
