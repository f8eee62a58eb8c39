"""A fair share that holds under a flood, and per-key rpm/tpm (issue 38), through ``vllama serve``.

The stand-in vLLM runs ``FAKE_VLLM_MAX_NUM_SEQS`` requests at once and queues the rest as vLLM
does without KV pressure (a running request is never preempted), so one key's flood holds every
running slot. vllama's fair queue (``api/policy/fair_queue.py``) keeps the queue itself: the order in
which requests reach the stand-in (``/_fake/requests``) is the order vllama dispatched them.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import threading
import time

import httpx
from conftest import in_one_minute, place

KEYS = """
[[keys]]
name = "heavy"
key = "sk-heavy"

[[keys]]
name = "light"
key = "sk-light"
"""


def _sent(s) -> list[dict]:
    argv = s.launched()[0]
    port = argv[argv.index("--port") + 1]
    return [r for r in httpx.get(f"http://127.0.0.1:{port}/_fake/requests").json() if isinstance(r.get("body"), dict)]


def _stats(s) -> dict:
    argv = s.launched()[0]
    return httpx.get(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/_fake/stats").json()


def _ask(s, key: str, prompt: str, n: int) -> httpx.Response:
    return httpx.post(s.url + "/api/generate", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": "prod", "prompt": prompt, "stream": False, "options": {"num_predict": n}})


def _wait(cond, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _two_workers_with_keys(serve, hub, tmp_path, places: int):
    """The served model behind the keys file, vLLM (the stand-in) running ``places`` at most and vllama
    sending no more, two workers sharing the fair queue; returned once both listen."""
    place(hub, "acme/tiny-prod")
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(keys),
              "--max-running", str(places), "--max-queue", "32", "--workers", "2",
              env={"FAKE_VLLM_TOKEN_DELAY": "0.05", "FAKE_VLLM_MAX_NUM_SEQS": str(places)})
    s.wait_ready()
    _wait(lambda: "worker_listening" in s.log.read_text(), "worker 1 did not start")
    return s


def test_a_light_key_is_dispatched_ahead_of_a_flood_and_a_key_alone_uses_every_slot(serve, hub, tmp_path):
    s = _two_workers_with_keys(serve, hub, tmp_path, places=4)
    with cf.ThreadPoolExecutor(16) as ex:
        # lengths 3 to 7.5 s, 0.5 s apart: requests that start together must not end together, or
        # the light request, granted the first place freed, could reach vLLM a moment after the
        # heavy one granted the second (two workers, each sending as soon as it learns)
        heavy = [ex.submit(_ask, s, "sk-heavy", f"flood {i} [[tokens:{60 + 10 * i}]]", 60 + 10 * i) for i in range(10)]
        # the key alone takes every one of vLLM's 4 running slots ...
        _wait(lambda: _stats(s)["running"] == 4, "the heavy key alone did not fill the 4 running slots")
        ended = _stats(s)["completed"]  # 0 unless the machine stalled for a heavy request's 3 s
        light = _ask(s, "sk-light", "light [[tokens:2]]", 2)
        assert light.status_code == 200
        assert all(f.result().status_code == 200 for f in heavy)
    order = [r["body"]["messages"][0]["content"].split()[0] for r in _sent(s)]
    # ... the light request went upstream as soon as the next heavy request ended, ahead of the
    # heavy ones waiting (vLLM's own queue would have put it last, after all 10) ...
    assert order.index("light") <= 4 + ended, (order, ended)
    # ... and vLLM's queue was never used: vllama sent no more than it runs
    assert _stats(s)["waited"] == 0 and _stats(s)["completed"] == 11


def test_beside_a_light_key_a_flood_runs_a_smaller_batch_and_leaves_it_a_place(serve, hub, tmp_path):
    """While a light key has a request running, the heavy key runs at most half of the 8 places
    (``--fair-light-running``'s default) and leaves the reserve free: the light key's next request
    is answered while every heavy request still runs (each 100 s long), not after one of them ends."""
    s = _two_workers_with_keys(serve, hub, tmp_path, places=8)
    assert '"fair_light_running":4,' in s.log.read_text()  # chosen (half the places) and logged
    stop = threading.Event()

    def stream(key: str, prompt: str) -> int:
        body = {"model": "prod", "prompt": f"{prompt} [[tokens:2000]]", "options": {"num_predict": 2000}}
        with httpx.stream("POST", s.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break
            return r.status_code

    with cf.ThreadPoolExecutor(12) as ex:
        try:
            held = ex.submit(stream, "sk-light", "hold")  # the light key: one long request running
            _wait(lambda: _stats(s)["running"] == 1, "the light key's first request did not start")
            heavy = [ex.submit(stream, "sk-heavy", f"flood{i}") for i in range(10)]
            _wait(lambda: _stats(s)["running"] >= 5, "the heavy key did not start")
            light = _ask(s, "sk-light", "light [[tokens:2]]", 2)
            assert light.status_code == 200
            after = _stats(s)
            # answered before any 100 s heavy request ended (on a flood holding every place it waits for one) ...
            assert after["completed"] == 1, after
            # ... and the heavy key runs 4 of the 8 places beside the light key's one (not 7)
            assert after["running"] == 5 and after["waited"] == 0, after
        finally:
            stop.set()
        assert held.result() == 200 and all(f.result() == 200 for f in heavy)


def _in_flight(s) -> float:
    text = httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sk-scrape"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllama_requests_in_flight"))


def _queued_behind_a_hold(s, asks: list[tuple[str, str, int]]) -> list[str]:
    """One request of key ``sk-hold`` takes the one running slot; ``asks`` (key, prompt, output
    tokens) are sent meanwhile; once every one waits in vllama (its in-flight gauge, read with
    ``sk-scrape``) the holder leaves, and the order in which the stand-in then received them (each
    prompt's first word) is returned: the fair queue's order, whatever the machine's load while
    they arrived (a holder of fixed length ended before all had arrived at load 16)."""
    arrived = threading.Event()

    def hold() -> int:
        body = {"model": "prod", "prompt": "hold [[tokens:4000]]", "options": {"num_predict": 4000}}
        with httpx.stream("POST", s.url + "/api/generate", json=body, headers={"Authorization": "Bearer sk-hold"},
                          timeout=120) as r:
            for _ in r.iter_lines():
                if arrived.is_set():
                    break
            return r.status_code

    with cf.ThreadPoolExecutor(len(asks) + 1) as ex:
        held = ex.submit(hold)
        _wait(lambda: len(_sent(s)) == 1, "the holding request did not start")
        futures = [ex.submit(_ask, s, key, text, out) for key, text, out in asks]
        _wait(lambda: _in_flight(s) == 1 + len(asks), "the requests did not all arrive", timeout=60)
        arrived.set()
        assert held.result() == 200
        assert all(f.result().status_code == 200 for f in futures)
    order = [r["body"]["messages"][0]["content"].split()[0] for r in _sent(s)][1:]
    assert len(order) == len(asks)
    return order


WEIGHTED = """
[[keys]]
name = "hold"
key = "sk-hold"

[[keys]]
name = "scrape"
key = "sk-scrape"
role = "metrics"
""" + "".join(f"""
[[keys]]
name = "k{i}"
key = "sk-k{i}"
weight = {w}
""" for i, w in enumerate((1, 1, 2, 4)))


def test_backlogged_keys_are_dispatched_by_their_weights(serve, hub, tmp_path):
    """Four keys with weights 1, 1, 2, 4, each with 24 requests waiting behind one running slot:
    of the first 32 dispatched, each key has its weighted share (4, 4, 8, 16), +-1 (count of
    dispatches, not wall time: the requests are alike)."""
    place(hub, "acme/tiny-prod")
    keys = tmp_path / "keys.toml"
    keys.write_text(WEIGHTED)
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(keys),
              "--max-running", "1", "--max-queue", "200", env={"FAKE_VLLM_TOKEN_DELAY": "0.01", "FAKE_VLLM_MAX_NUM_SEQS": "1"})
    s.wait_ready()
    order = _queued_behind_a_hold(s, [(f"sk-k{i}", f"k{i} a b c d [[tokens:4]]", 4) for _ in range(24) for i in range(4)])
    first = order[:32]
    counts = [first.count(f"k{i}") for i in range(4)]
    for got, want in zip(counts, (4, 4, 8, 16)):
        assert abs(got - want) <= 1, (counts, order)


LIMITED = """
[[keys]]
name = "capped"
key = "sk-capped"
rpm = 3

[[keys]]
name = "tokens"
key = "sk-tokens"
tpm = 30
"""


def test_rpm_and_tpm_answer_429_with_retry_after_and_ratelimit_headers(serve, hub, tmp_path):
    place(hub, "acme/tiny-prod")
    keys = tmp_path / "keys.toml"
    keys.write_text(LIMITED)
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(keys), "--workers", "2")
    s.wait_ready()
    # rpm 3: three requests a minute, over both workers (new connections: the kernel spreads them); the minute's
    # window is the wall clock's: what follows fits in one (a busy machine took 0.4 s a request)
    in_one_minute(25)
    answers = [_ask(s, "sk-capped", "x", 1) for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["2", "1", "0"]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    over = _ask(s, "sk-capped", "x", 1)
    assert over.status_code == 429, over.text
    assert "rpm" in over.json()["error"] and "capped" in over.json()["error"]
    assert 1 <= int(over.headers["Retry-After"]) <= 60
    assert over.headers["x-ratelimit-remaining-requests"] == "0" and over.headers["x-ratelimit-reset-requests"].endswith("s")
    # /v1 too, in OpenAI's own header names
    v1 = httpx.post(s.url + "/v1/completions", headers={"Authorization": "Bearer sk-capped"},
                    json={"model": "prod", "prompt": "x", "max_tokens": 1})
    assert v1.status_code == 429 and v1.headers["x-ratelimit-limit-requests"] == "3"
    # tpm 30: tokens (prompt + output) are counted when a request ends; once spent, 429
    first = _ask(s, "sk-tokens", "one two three [[tokens:40]]", 40)
    assert first.status_code == 200 and first.headers["x-ratelimit-limit-tokens"] == "30"
    assert first.headers["x-ratelimit-remaining-tokens"] == "30"  # what was left when it was admitted
    spent = _ask(s, "sk-tokens", "x", 1)
    if spent.status_code == 200:  # the minute turned over between the two: spend it again
        spent = _ask(s, "sk-tokens", "one two three [[tokens:40]]", 40) and _ask(s, "sk-tokens", "x", 1)
    assert spent.status_code == 429 and "tpm" in spent.json()["error"], spent.text
    assert spent.headers["x-ratelimit-remaining-tokens"] == "0" and int(spent.headers["Retry-After"]) >= 1



def test_a_run_spends_one_of_the_keys_rpm(serve, hub, tmp_path):
    """``vllama run`` sends Ollama's load request (an empty prompt, as Ollama's CLI does) before the prompt: it
    generates nothing and counts against no rpm, so a key with rpm 3 runs three prompts a minute, not one and a
    half. Driven by the real CLI, ``OLLAMA_API_KEY`` its key."""
    place(hub, "acme/tiny-prod")
    keys = tmp_path / "keys.toml"
    keys.write_text(LIMITED)
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(keys))
    s.wait_ready()
    env = {**os.environ, "OLLAMA_HOST": s.url, "OLLAMA_API_KEY": "sk-capped"}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vllama_proxy", "run", "prod", "x"], env=env, capture_output=True,
                              text=True, timeout=120)

    for _ in range(3):  # counted again when the key's minute turned over meanwhile (then all are in the next)
        minute = int(time.time() // 60)
        runs = [run() for _ in range(3)]
        over = _ask(s, "sk-capped", "x", 1)
        if int(time.time() // 60) == minute:
            break
        time.sleep(60 - time.time() % 60)
    assert [r.returncode for r in runs] == [0, 0, 0], [r.stderr for r in runs]
    assert over.status_code == 429 and "rpm" in over.json()["error"], over.text


def test_backlogged_keys_share_the_output_tokens_by_weight_whatever_their_prompts(serve, hub, tmp_path):
    """Issue 38's goal on the stand-in, counted by dispatch: four backlogged keys with weights 1,
    1, 2, 4 and different prompt and answer lengths, one running slot (a request's output tokens
    are its time in the slot), so the output tokens each key is sent are its share of the slot.
    Key k1's prompts are long and its answers short (VTC's prompt + 2 x output charged it for
    its prompts: 0.3x its share of the output tokens); each key's output tokens over the first
    56 requests dispatched are its weighted share, within 10 % (or one of its requests)."""
    place(hub, "acme/tiny-prod")
    keys = tmp_path / "keys.toml"
    keys.write_text(WEIGHTED)
    # key: (prompt words, output tokens, requests): counted so that all four stay backlogged past the window
    load = {0: (8, 8, 8), 1: (300, 2, 26), 2: (2, 6, 18), 3: (60, 10, 22)}
    s = serve("--model", "acme/tiny-prod", "--served-model-name", "prod", "--api-key-file", str(keys),
              "--max-running", "1", "--max-queue", "200", "--workers", "1",
              env={"FAKE_VLLM_TOKEN_DELAY": "0.01", "FAKE_VLLM_MAX_NUM_SEQS": "1"})
    s.wait_ready()
    asks = [(f"sk-k{i}", f"k{i} " + "w " * (words - 1) + f"[[tokens:{out}]]", out)
            for n in range(max(r for _, _, r in load.values())) for i, (words, out, r) in load.items() if n < r]
    order = _queued_behind_a_hold(s, asks)
    window = order[:56]
    out = {i: window.count(f"k{i}") * load[i][1] for i in load}
    total = sum(out.values())
    for i, w in enumerate((1, 1, 2, 4)):
        want = total * w / 8
        assert abs(out[i] - want) <= max(0.1 * want, load[i][1]), (i, out, window)  # 10 %, or one request
