"""The Supervisor in-process against the stand-in vllm: ensure_ready and the startup deadline."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import TESTS, free_port
from vllama_proxy.errors import UpstreamUnavailable
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.core import Supervisor
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
    sup = Supervisor(s, s.model_specs()[0], port=free_port(), board=StatusBoard("m"))
    await sup.start()
    return sup


async def test_ensure_ready_waits_for_startup(tmp_path, knobs):
    knobs.setenv("FAKE_VLLM_START_DELAY", "1.5")
    sup = await run(settings(tmp_path))
    try:
        assert sup.state is State.STARTING
        await sup.ensure_ready(timeout=20)
        assert sup.state is State.READY and sup.board.ready
    finally:
        await sup.stop()
    assert sup.state is State.STOPPED
    with pytest.raises(UpstreamUnavailable, match="stopped"):
        await sup.ensure_ready(timeout=1)


async def test_progress_pushes_the_startup_deadline(tmp_path, knobs):
    # loading takes 3 s, the deadline is 1 s, but every 0.5 s vLLM logs loading progress
    knobs.setenv("FAKE_VLLM_START_DELAY", "3")
    sup = await run(settings(tmp_path, startup_timeout=1.0, startup_progress_extension=2.0))
    try:
        await sup.ensure_ready(timeout=20)
        assert sup.restarts == 0
    finally:
        await sup.stop()


async def test_deadline_without_progress_allowance_fails(tmp_path, knobs):
    knobs.setenv("FAKE_VLLM_START_DELAY", "3")
    sup = await run(settings(tmp_path, startup_timeout=1.0, startup_progress_extension=0.0))
    try:
        with pytest.raises(UpstreamUnavailable, match="failed to load"):
            await sup.ensure_ready(timeout=20)
        assert sup.state is State.FAILED and "not ready after" in sup.last_error
    finally:
        await sup.stop()
