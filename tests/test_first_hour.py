"""What a new user meets in the first hour (issue 19, items 4-9): one clear line instead of a
traceback, plain validation messages, truthful answers in --upstream mode, vLLM's usage
errors as configuration errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from conftest import ROOT, free_port


def serve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "VLLAMA_CPUS": "2", **(env or {})})


def test_port_in_use_is_one_line_naming_the_port():
    """Ollama still running on the port: a traceback ending in OSError [Errno 98] plus two
    "Unclosed client session" lines, before."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = serve("--upstream", "http://127.0.0.1:9", "--port", str(port), "--log-format", "json")
    assert r.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr and "--port" in r.stderr and "OLLAMA_HOST" in r.stderr
    assert "Traceback" not in r.stderr and "Unclosed" not in r.stderr and "Errno" not in r.stderr, r.stderr
