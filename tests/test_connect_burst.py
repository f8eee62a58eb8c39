"""A burst is held, not failed: more requests at once than vLLM's listen queue takes wait in vllama for their
turn to connect (``upstream/pool.py``, ``--connect-concurrency``), and a connect fails only when vLLM accepted none of
them for ``--connect-timeout``.

5,000 non-streamed requests at once through ``vllama serve --upstream`` beside a CPU hog answered 4 of 5,000: the
rest failed the 10 s connect budget, every connect opened at once (``benchmarks/RESULTS.md``). Here the stand-in
accepts one connection per 10 ms behind a listen queue of 8 whatever the machine's load, and the connect timeout
is 0.8 s, under the kernel's 1 s before it sends a dropped SYN again (the code before bounded connects failed 64 of
400): 400 requests cannot all connect within it (4 s of accepts), and each must still be answered. With 0.5 s a CPU
hog beside the suite starved the stand-in's accepts or vllama's loop past the budget (40 of 400 failed beside
``stress-ng --cpu 2``), and with 0.8 s too (175 of 400): a test of the machine, not of vllama. A budget of 1 s or
more no longer tells the code before from today's (checked: 2 s passes on it), so both processes run at nice -10
where that is allowed (root, as in CI): neither a hog at nice 0 nor the real-engine tier's vLLMs at nice -5 starve
them for the budget (at -5, beside the hog, the tier and a second test run, 99 of 400 failed at once: the stand-in
accepted nothing for 0.8 s).
"""

from __future__ import annotations

import asyncio
import contextlib

import ollama
import psutil
import pytest

from conftest import SERVED, start_fake, start_proxy, stop

BURST = 400
ACCEPT_EVERY_S = 0.01  # 400 connections take 4 s to accept: five times the connect timeout


@pytest.fixture
def slow_accepting(model_dir):
    fake = start_fake(model_dir, env={"FAKE_VLLM_BACKLOG": "8", "FAKE_VLLM_ACCEPT_EVERY": str(ACCEPT_EVERY_S)})
    proxy = start_proxy(fake.url, "--workers", "1", "--connect-timeout", "0.8")
    for proc in (fake.proc, proxy.proc):
        with contextlib.suppress(psutil.AccessDenied):  # not root: as it is
            psutil.Process(proc.pid).nice(-10)
    yield proxy
    stop(proxy.proc)
    stop(fake.proc)


def test_a_burst_beyond_the_listen_queue_is_answered_whole(slow_accepting):
    async def burst() -> list:
        client = ollama.AsyncClient(host=slow_accepting.url, timeout=120)
        return await asyncio.gather(*(client.generate(model=SERVED, prompt=f"burst {i}", stream=False)
                                      for i in range(BURST)), return_exceptions=True)

    answers = asyncio.run(burst())
    failed = [a for a in answers if isinstance(a, BaseException)]
    assert not failed, f"{len(failed)} of {BURST} failed, e.g. {failed[0]!r}"
    assert all(a.done and a.eval_count == 8 for a in answers)
