"""Kill a vLLM process once vLLM has made a number of tokens (``test_real_resume.py``, ``test_real_supervisor.py``).

With ``slow_steps.py`` (every engine step at least ``VLLAMA_TEST_STEP_S``) a stream of a few hundred tokens lasts
seconds whatever the machine's load, and the kill is placed by what vLLM made, read off its own
``vllm:generation_tokens_total``, not by what a client read: on a busy machine a client read its 50th token after
vLLM had made all 200, and streams of 30,000 tokens that kept a kill mid-way cost minutes of both CPUs.
"""

from __future__ import annotations

import os
import signal
import threading

import psutil

from .conftest import counter


class Killer:
    """``victim`` SIGKILLed from a thread once vLLM has made ``kill_after`` tokens since this was made, read off
    vLLM's own ``vllm:generation_tokens_total`` (on ``root``'s port) every 10 ms: the kill is placed by what vLLM
    made, not by what a client has read (a client on a busy machine read its 50th token after vLLM had made all 200).
    vLLM makes a token per step at most (``slow_steps.py``), so a few steps pass between a read and the
    kill."""

    def __init__(self, root: psutil.Process, victim: psutil.Process, kill_after: int) -> None:
        (port,) = {c.laddr.port for c in root.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        self.url = f"http://127.0.0.1:{port}"
        self.victim = victim
        self.kill_at = self._made() + kill_after
        self.done, self.killed = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _made(self) -> float:
        return counter(self.url, "vllm:generation_tokens_total")

    def _run(self) -> None:
        while not self.done.wait(0.01):
            if self._made() >= self.kill_at:
                os.kill(self.victim.pid, signal.SIGKILL)
                self.killed.set()
                return

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
