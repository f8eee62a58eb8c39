"""A streamed token resumes the relay's loop, not the request's middlewares (issue 42, item 1).

Every ``await`` that suspends resumes, when its future is done, each coroutine frame of the chain
awaiting it: a read inside a handler went back through aiohttp's request task, ``_handle``, its
``_fix_request_current_app``, each of vllama's middlewares, the route and ``answer.py`` on every token
(``relay.in_own_task`` runs the loop in a task of its own). ``sys.setprofile`` sees each resumption of a
coroutine frame as a ``call`` event: a real ``vllama serve`` over the stand-in vLLM counts those of its
outermost middleware (``api/app.py`` ``errors_and_access_log``) and writes the count when it exits.
A request resumes it a few times (the body, the model, the upstream request); a token, never.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from conftest import ALIAS, ROOT, free_port, start_fake, stop, wait_http

#: ``vllama serve`` with the outermost middleware's resumptions counted, written to $FRAMES_OUT at exit.
_COUNTING = """
import atexit, os, sys
from vllama_proxy.api.app import errors_and_access_log
code = errors_and_access_log.__code__
count = 0
def prof(frame, event, arg):
    global count
    if event == "call" and frame.f_code is code:
        count += 1
def dump():
    with open(os.environ["FRAMES_OUT"], "w") as f:
        f.write(str(count))
atexit.register(dump)
sys.setprofile(prof)
from vllama_proxy.cli import main
sys.argv[0] = "vllama"
sys.exit(main())
"""

TOKENS = 200


@pytest.fixture(scope="module")
def slow_fake(tmp_path_factory):
    """The stand-in with 2 ms between tokens: each token is a read of its own, as on a GPU."""
    from conftest import write_model_dir

    s = start_fake(write_model_dir(tmp_path_factory.mktemp("model") / "fake-model"), env={"FAKE_VLLM_TOKEN_DELAY": "0.002"})
    yield s
    stop(s.proc)


def _resumes(fake_url: str, tmp_path: Path, send) -> int:
    """The outermost middleware's resumptions over the life of one ``vllama serve`` (``--workers 1``: the
    main process serves) that answered ``send(url)``."""
    out = tmp_path / "frames"
    port = free_port()
    env = {**os.environ, "FRAMES_OUT": str(out), "HF_HUB_OFFLINE": "1", "VLLAMA_STATE_DIR": tempfile.mkdtemp(prefix="vllama-state-")}
    proc = subprocess.Popen([sys.executable, "-c", _COUNTING, "serve", "--upstream", fake_url, "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1", "--alias", f"{ALIAS}=fake-model"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/", proc)
        send(url)
    finally:
        stop(proc, timeout=30)
    assert proc.returncode == 0
    return int(out.read_text())


def _ndjson_tokens(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return sum(1 for line in resp.text.splitlines() if '"done":false' in line.replace(" ", ""))


@pytest.mark.parametrize("route", ["generate", "chat", "unstreamed", "v1"])
def test_a_token_does_not_resume_the_middlewares(route, slow_fake, tmp_path):
    prompt = f"[[tokens:{TOKENS}]] hello"

    def send(url: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(3):
                if route == "generate":
                    r = c.post("/api/generate", json={"model": ALIAS, "prompt": prompt, "options": {"num_predict": TOKENS}})
                    assert _ndjson_tokens(r) == TOKENS
                elif route == "chat":
                    r = c.post("/api/chat", json={"model": ALIAS, "messages": [{"role": "user", "content": prompt}],
                                                  "options": {"num_predict": TOKENS}})
                    assert _ndjson_tokens(r) == TOKENS
                elif route == "unstreamed":  # vLLM still streams it: an event per token
                    r = c.post("/api/generate", json={"model": ALIAS, "prompt": prompt, "stream": False,
                                                      "options": {"num_predict": TOKENS}})
                    assert r.status_code == 200 and r.json()["eval_count"] == TOKENS
                else:
                    r = c.post("/v1/chat/completions", json={"model": ALIAS, "messages": [{"role": "user", "content": prompt}],
                                                             "max_tokens": TOKENS, "stream": True})
                    assert r.status_code == 200 and r.text.count("data: ") == TOKENS + 3  # the role, the tokens, the finish, [DONE]

    resumes = _resumes(slow_fake.url, tmp_path, send)
    # 3 answers of 200 tokens and wait_http's GET /: each token resumed it (591-612 in all on main); now each
    # request does a few times (its connection, vLLM's headers, the loop's end: 12-14 in all here), bound at 10
    assert resumes < 10 * 4, f"{resumes} resumptions of the outermost middleware for 3 answers of {TOKENS} tokens"
