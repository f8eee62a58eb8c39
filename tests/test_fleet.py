"""A fleet on the stand-in: two ``vllama serve --model`` nodes (each supervising a stand-in vLLM),
the real ``vllm-router`` in front of them, and a ``vllama serve --upstream`` front in front of that,
driven by the real ``ollama`` client (docs/fleet.md).

What the stand-in shows here is vllama's side of the fleet: nodes join the router by themselves
(``--register-with``) and again after the router restarts, leave it on a clean stop; the front keeps
a conversation on one engine (its session key, read by ``consistent_hash``), stays ready and keeps
listing the model while one engine is down (the router's ``/health`` is then 503), a stream in flight
on a killed engine, or on a node killed or drained, goes on on another node (the front asks it again as token
ids: the stand-in answers them with FAKE_VLLM_TOKEN_IDS), new requests go to the other engine, and the restarted
engine takes traffic again. The real engines' version is ``tests/real_engine/test_real_fleet.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from ollama import Client, ResponseError

from conftest import Vllama, alive, free_port, log_events, start_proxy, stop, wait_http

pytest.importorskip("vllm_router")
ROUTER_BIN = Path(sys.executable).parent / "vllm-router"


class Router:
    """``vllm-router`` with no static workers (nodes register), health checked every second."""

    def __init__(self, log: Path, policy: str = "consistent_hash", port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port()),
             "--policy", policy, "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--health-success-threshold", "1", "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30",
             # a node whose engine died may have opened the router's circuit breaker (10 failed requests): it is
             # routed to again only after this timeout, whatever its health check says (60 s by default)
             "--cb-timeout-duration-secs", "2"],
            stdout=log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        wait_http(self.url + "/liveness", self.proc)

    def workers(self) -> dict[str, bool]:
        """Listed worker URL -> healthy."""
        return {w["url"]: w["is_healthy"] for w in httpx.get(self.url + "/workers").json()["workers"]}

    def wait_workers(self, expect: dict[str, bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while (seen := self.workers()) != expect:
            assert time.monotonic() < deadline, f"router workers {seen}, expected {expect}\n{self.log.read_text()[-2000:]}"
            time.sleep(0.1)


def node(tmp_path: Path, name: str, router: Router, env: dict[str, str] | None = None,
         flags: list[str] | None = None) -> Vllama:
    """A ``vllama serve --model tiny`` node joining ``router``; its stand-in vLLM on a known port (``vllm_port``)."""
    d = tmp_path / name
    d.mkdir()
    vllm_port = free_port()
    args = ["--register-with", router.url, "--register-interval", "0.5", "--vllm-port", str(vllm_port), *(flags or [])]
    v = Vllama(d, env=env, flags=args)
    v.vllm_url = f"http://127.0.0.1:{vllm_port}"  # type: ignore[attr-defined]
    return v


def sessions_seen(engine: Vllama) -> Counter:
    """X-Session-ID -> chat requests the engine's stand-in vLLM received with it."""
    log = httpx.get(engine.vllm_url + "/_fake/requests").json()  # type: ignore[attr-defined]
    return Counter({k.lower(): v for k, v in r["headers"].items()}.get("x-session-id")
                   for r in log if r["path"] == "/v1/chat/completions")


def chat(client: Client, turns: int, system: str, first: str) -> None:
    """A conversation as Ollama clients hold one: the whole history resent every turn."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    for turn in range(turns):
        reply = client.chat(model="tiny", messages=messages, stream=False)
        assert reply.message.content
        messages += [{"role": "assistant", "content": reply.message.content}, {"role": "user", "content": f"and {turn}?"}]


@pytest.fixture
def fleet(tmp_path):
    started: list = []

    def start(kind, *args, **kw):
        obj = kind(*args, **kw)
        started.append(obj)
        return obj

    yield start
    for obj in reversed(started):  # a test that failed midway leaves nothing running
        stop(obj.proc, timeout=20)
        pidfile = getattr(obj, "pidfile", None)
        for p in (pidfile, Path(f"{pidfile}.server")) if pidfile else ():
            if p.exists() and alive(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)


def test_sessions_keep_their_engine_and_nodes_rejoin(tmp_path, fleet):
    router = fleet(Router, tmp_path / "router.log")
    a, b = fleet(node, tmp_path, "a", router), fleet(node, tmp_path, "b", router)
    a.wait_state("ready"), b.wait_state("ready")
    router.wait_workers({a.url: True, b.url: True})  # both joined by themselves (no --worker-urls)
    front = fleet(start_proxy, router.url, vllm_args=[])
    client = Client(host=front.url)
    for s in range(12):
        chat(client, 3, system=f"You are assistant {s % 3}.", first=f"Hello from session {s}")
    on_a, on_b = sessions_seen(a), sessions_seen(b)
    # each conversation carried one key on all of its 3 turns, and was answered by one engine only
    assert sorted(on_a.values()) + sorted(on_b.values()) == [3] * 12 and None not in on_a | on_b
    assert not set(on_a) & set(on_b)
    assert on_a and on_b, "12 sessions all hashed to one engine"

    # the router restarts (added workers are forgotten): the nodes join again within --register-interval
    port = router.port
    stop(router.proc)
    router = fleet(Router, tmp_path / "router.log", port=port)
    router.wait_workers({a.url: True, b.url: True})
    chat(client, 1, system="You are assistant 0.", first="after the router's restart")

    # a clean stop: the node leaves the router before it drains, and leaves nothing running
    assert a.stop() == 0
    router.wait_workers({b.url: True}, timeout=5)
    assert not alive(a.server_pid())
    chat(client, 2, system="You are assistant 1.", first="with one node left")


def test_system_prompt_key_spreads_prompts_and_keeps_each_on_one_engine(tmp_path, fleet):
    """``--session-key system`` behind ``sticky_least_loaded``: the conversations sharing a system prompt
    reach one engine (its prefix is cached once), the distinct prompts are spread over both engines."""
    router = fleet(Router, tmp_path / "router.log", policy="sticky_least_loaded")
    a, b = fleet(node, tmp_path, "a", router), fleet(node, tmp_path, "b", router)
    a.wait_state("ready"), b.wait_state("ready")
    router.wait_workers({a.url: True, b.url: True})
    front = fleet(start_proxy, router.url, "--session-key", "system", vllm_args=[])
    client = Client(host=front.url)
    for s in range(12):  # 4 system prompts, 3 conversations each, interleaved
        chat(client, 2, system=f"You are assistant {s % 4}.", first=f"Hello from session {s}")
    on_a, on_b = sessions_seen(a), sessions_seen(b)
    # 4 keys (one per system prompt), each on one engine with its 3 conversations x 2 turns, 2 per engine
    assert sorted(on_a.values()) + sorted(on_b.values()) == [6] * 4 and None not in on_a | on_b
    assert not set(on_a) & set(on_b) and len(on_a) == len(on_b) == 2


def chats_answered(engine: Vllama) -> int:
    """Chat requests the engine's stand-in vLLM received."""
    log = httpx.get(engine.vllm_url + "/_fake/requests").json()  # type: ignore[attr-defined]
    return sum(r["path"] == "/v1/chat/completions" for r in log)


def test_distinct_prompts_are_placed_by_load_and_released(tmp_path, fleet):
    """Issue 43: behind ``sticky_least_loaded``, a ``--session-key system`` front sends each chat without a
    system prompt under a key of its own and releases it at the router when it ends, so the router counts
    requests in flight per engine: in a closed loop the engine that answers faster gets more of them (with
    a key per conversation that is never released, each engine got exactly half: the GPU run's drift), no
    key stays counted after the run, and the shared-prefix keys are still placed by count and kept."""
    # the policy's own lines at debug: each one-request key opened and released is seen in the log
    router = fleet(Router, tmp_path / "router.log", policy="sticky_least_loaded",
                   env={"RUST_LOG": "info,vllm_router_rs::policies::sticky_least_loaded=debug"})
    a = fleet(node, tmp_path, "a", router, env={"FAKE_VLLM_TOKEN_DELAY": "0.005"})
    b = fleet(node, tmp_path, "b", router, env={"FAKE_VLLM_TOKEN_DELAY": "0.05"})  # 10x slower per token
    a.wait_state("ready"), b.wait_state("ready")
    router.wait_workers({a.url: True, b.url: True})
    front = fleet(start_proxy, router.url, "--session-key", "system", vllm_args=[], log=tmp_path / "front.log")
    users, each = 6, 10
    failures: list[BaseException] = []

    def user(u: int) -> None:  # a closed-loop client: its next prompt once the last is answered
        client = Client(host=front.url)
        try:
            for i in range(each):
                client.chat(model="tiny", messages=[{"role": "user", "content": f"user {u}, prompt {i} [[tokens:30]]"}])
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    on_a, on_b = chats_answered(a), chats_answered(b)
    assert on_a + on_b == users * each
    assert on_a >= 2 * on_b, f"a (fast) answered {on_a}, b (10x slower) {on_b}: placed by count, not by load"
    keys = set(sessions_seen(a)) | set(sessions_seen(b))
    assert len(keys) == users * each and None not in keys  # a key per request

    # every key was released: the router logs each one it finishes (the event waited on), once
    # (its /finish_session asks each policy it holds, so another logs the key as unknown)
    deadline = time.monotonic() + 30
    while (done := router.log.read_text().count("SLL: finished session")) < users * each:
        assert time.monotonic() < deadline, f"{done} of {users * each} keys released\n{router.log.read_text()[-2000:]}"
        time.sleep(0.1)
    text = router.log.read_text()
    assert text.count("SLL: finished session") == text.count("SLL: new session") == users * each
    # the engines' counts stayed close: what each held when a key was placed. A user has at most one request
    # in flight and one release on its way (sent after its answer ended, racing its next request: a loaded
    # machine lets the next placement come first), so the two engines hold at most 2 x users keys between them
    # and the least loaded one, where a key goes, at most half of them (+1 as logged); keys never released (a
    # key per conversation, or releases lost) would reach users x each / 2 = 30 here
    held = [int(n) for n in re.findall(r"active sessions on replica: (\d+)", text)]
    assert max(held) <= users + 1, held
    # the other routes without a key to share: /api/generate, the relayed /v1 chat and completions
    client = Client(host=front.url)
    client.generate(model="tiny", prompt="no system prompt")
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), ("/v1/completions", {"prompt": "x"})):
        httpx.post(front.url + path, json={"model": "tiny", **body}, timeout=30).raise_for_status()
    # and a client that leaves mid-answer: its key is released as well
    with httpx.stream("POST", front.url + "/api/chat", timeout=30,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "long [[tokens:5000]]"}]}) as resp:
        next(resp.iter_lines())
    while (done := router.log.read_text().count("SLL: finished session")) < users * each + 4:
        assert time.monotonic() < deadline, f"{done} of {users * each + 4} keys released\n{router.log.read_text()[-2000:]}"
        time.sleep(0.1)
    # so nothing stale is counted: 4 shared system prompts, placed by count, split 2/2, each kept on one engine
    before_a, before_b = sessions_seen(a), sessions_seen(b)
    for s in range(8):
        chat(client, 1, system=f"You are assistant {s % 4}.", first=f"Hello from session {s}")
    new_a, new_b = sessions_seen(a) - before_a, sessions_seen(b) - before_b
    assert sorted(new_a.values()) == sorted(new_b.values()) == [2, 2] and not set(new_a) & set(new_b), (new_a, new_b)
    assert router.log.read_text().count("SLL: finished session") == users * each + 4  # the shared keys stay live


def test_a_tenants_own_session_key_neither_pins_the_fleet_nor_reaches_another_tenant(tmp_path, fleet):
    """Issue 43 follow-up (no tenant can harm another): behind ``sticky_least_loaded``, a client's own
    ``X-Session-ID`` is scoped to its API key and bounded in flight. A flood of 3 x ``IN_FLIGHT`` long answers
    under one constant value goes ``IN_FLIGHT`` under that tenant's key, on one engine, and the rest by load
    over both (passed on as it came, all of it went to one engine, which the router counted as one session,
    so another tenant's requests kept going there too); another tenant's requests, sent while the flood is
    in flight, land where the flood is no more than the bound heavier. Two tenants sending one value get two
    keys (neither the value), and one tenant's value keeps its engine."""
    from vllama_proxy.api.fleet.client_affinity import IN_FLIGHT

    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "alice"\nkey = "sk-alice"\n\n[[keys]]\nname = "bob"\nkey = "sk-bob"\n')
    router = fleet(Router, tmp_path / "router.log", policy="sticky_least_loaded")
    slow = {"FAKE_VLLM_TOKEN_DELAY": "0.05"}  # a long answer stays in flight until its client leaves
    a, b = fleet(node, tmp_path, "a", router, env=slow), fleet(node, tmp_path, "b", router, env=slow)
    a.wait_state("ready"), b.wait_state("ready")
    router.wait_workers({a.url: True, b.url: True})
    # one worker process: the bound is counted per process (docs/fleet.md)
    front = fleet(start_proxy, router.url, "--session-key", "system", "--api-key-file", str(keys), "--workers", "1",
                  vllm_args=[], log=tmp_path / "front.log")
    leave, started, failures = threading.Event(), threading.Semaphore(0), []

    def long_chat(token: str, marker: str, headers: dict[str, str]) -> None:
        """A streamed chat held open (its first line read) until ``leave`` is set."""
        try:
            with httpx.stream("POST", front.url + "/api/chat", timeout=60, headers={"Authorization": f"Bearer {token}", **headers},
                              json={"model": "tiny", "messages": [{"role": "user", "content": f"{marker} [[tokens:2000]]"}]}) as resp:
                assert resp.status_code == 200, resp.read()
                lines = resp.iter_lines()  # kept: a generator dropped closes the stream (the client leaves)
                next(lines)
                started.release()
                leave.wait(120)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)
            started.release()

    def held(marker: str, headers: dict[str, str], token: str = "sk-alice") -> threading.Thread:
        t = threading.Thread(target=long_chat, args=(token, marker, headers))
        t.start()
        return t

    def placed(marker: str) -> dict[str, Counter]:
        """Engine name -> X-Session-ID -> chat requests whose prompt has ``marker``, as the stand-ins received them."""
        out = {}
        for name, engine in (("a", a), ("b", b)):
            log = httpx.get(engine.vllm_url + "/_fake/requests").json()  # type: ignore[attr-defined]
            out[name] = Counter({k.lower(): v for k, v in r["headers"].items()}.get("x-session-id")
                                for r in log if r["path"] == "/v1/chat/completions" and marker in str(r["body"]))
        return out

    threads = []
    try:
        flood = 3 * IN_FLIGHT
        threads += [held(f"flood {i}", {"X-Session-ID": "flood"}) for i in range(flood)]
        for _ in range(flood):
            assert started.acquire(timeout=60), "the flood's answers did not start"
        assert not failures, failures
        on = placed("flood")
        tenant_key = {k for c in on.values() for k in c if not k.startswith("r")}
        assert len(tenant_key) == 1 and re.fullmatch(r"[0-9a-f]{32}", (key := tenant_key.pop())), on  # scoped, hashed
        pinned = "a" if on["a"][key] else "b"
        other = "b" if pinned == "a" else "a"
        assert on[pinned][key] == IN_FLIGHT and not on[other][key], on  # the bound, on one engine
        by_load = {e: sum(n for k, n in on[e].items() if k.startswith("r")) for e in on}
        assert sum(by_load.values()) == flood - IN_FLIGHT and min(by_load.values()) >= (flood - IN_FLIGHT) // 2 - 2, on
        flood_on = {e: sum(on[e].values()) for e in on}

        # another tenant, one request at a time, while the flood is in flight: never where the flood is heavier
        # than on the other engine by more than the bound (a flood pinned whole: 24 against 0)
        for i in range(3):
            threads.append(held(f"bob {i}", {}, token="sk-bob"))
            assert started.acquire(timeout=60) and not failures, failures
            landed = [e for e, c in placed(f"bob {i}").items() if c]
            assert len(landed) == 1 and flood_on[landed[0]] - flood_on[other if landed[0] == pinned else pinned] <= IN_FLIGHT, \
                (landed, flood_on)
    finally:
        leave.set()
        for t in threads:
            t.join(60)
    assert not failures, failures

    # one value, two tenants: two keys, neither the value; each tenant's turns keep one engine
    client = {name: Client(host=front.url, headers={"Authorization": f"Bearer sk-{name}", "X-Session-ID": "conv-1"})
              for name in ("alice", "bob")}
    for turn in range(3):
        for name in client:
            client[name].chat(model="tiny", messages=[{"role": "user", "content": f"conv {name} {turn}"}])
    seen = {name: placed(f"conv {name}") for name in client}
    sent = {name: {k for c in seen[name].values() for k in c} for name in client}
    assert all(len(s) == 1 for s in sent.values()) and sent["alice"] != sent["bob"], sent
    assert not {"conv-1", key} & (sent["alice"] | sent["bob"]), sent
    assert all(sorted(n for c in seen[name].values() for n in c.values()) == [3] for name in client), seen  # one engine


def test_one_engine_killed(tmp_path, fleet):
    """An engine killed under a stream of the front's: the node ends the stream at once (its client, the front,
    asked the token ids), the front continues it through the router on the other node, whole; meanwhile the router
    sees the engine down, the front stays ready, new chats go to the other engine; the restarted engine comes back."""
    router = fleet(Router, tmp_path / "router.log")
    env = {"FAKE_VLLM_TOKEN_DELAY": "0.02", "FAKE_VLLM_TOKEN_IDS": "1"}
    # a's restart takes 3 s: long enough for the router to see it unhealthy
    a = fleet(node, tmp_path, "a", router, env={**env, "FAKE_VLLM_START_DELAY": "3"})
    b = fleet(node, tmp_path, "b", router, env=env)
    a.wait_state("ready"), b.wait_state("ready")
    router.wait_workers({a.url: True, b.url: True})
    front = fleet(start_proxy, router.url, vllm_args=[])
    # a session key the router sends to a (consistent_hash), sent by the client itself (scoped by the front:
    # the router sees its hash for the open server's one caller)
    from vllama_proxy.api.fleet.affinity import client_key
    mine = next(k for k in (f"key-{i}" for i in range(64))
                if Client(host=front.url, headers={"X-Session-ID": k}).chat(model="tiny", messages=[{"role": "user", "content": "x"}])
                and sessions_seen(a)[client_key("-", k)])
    key = client_key("-", mine)
    on_a = Client(host=front.url, headers={"X-Session-ID": mine})
    stream = on_a.chat(model="tiny", messages=[{"role": "user", "content": "long [[tokens:500]]"}], stream=True)
    parts = [next(stream)]
    old = a.server_pid()
    os.kill(old, signal.SIGKILL)
    reader = threading.Thread(target=lambda: parts.extend(stream), daemon=True)  # it goes on, on b
    reader.start()

    # while a restarts: the router's /health is 503, the front stays ready and lists the model,
    # and new conversations are answered (by b)
    client = Client(host=front.url)
    deadline = time.monotonic() + 10
    while httpx.get(router.url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "the router never saw the killed engine"
        time.sleep(0.1)
    ready = httpx.get(front.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["router"]["healthy_workers"] == 1, ready.text
    assert httpx.get(front.url + "/health").status_code == 200
    assert [m.model for m in client.list().models] == ["tiny:latest"]
    before_b = sum(sessions_seen(b).values())
    for s in range(4):
        chat(client, 1, system="During the outage.", first=f"session {s}")
    assert sum(sessions_seen(b).values()) == before_b + 4
    reader.join(60)
    assert "".join(p.message.content for p in parts) == "".join(f"tok{i} " for i in range(500))
    assert parts[-1].done and parts[-1].eval_count == 500
    assert any(isinstance((r["body"] or {}).get("prompt"), list)  # continued on b, from the token ids sent
               for r in httpx.get(b.vllm_url + "/_fake/requests").json())  # type: ignore[attr-defined]

    # a's supervisor restarts its engine; the router takes it back; the key that hashed to a lands on a again
    a.wait_state("ready", restarts=1)
    assert a.server_pid() != old
    router.wait_workers({a.url: True, b.url: True}, timeout=10)
    # Healthy is not yet routed to: where a's failures opened the router's circuit breaker (on a busy machine the
    # front's tries of the cut stream can reach its 10), a rejoins the ring after the breaker's timeout and three
    # answers in its half-open state; until then the key's chats go to b, as a user's would.
    deadline = time.monotonic() + 60
    while not sessions_seen(a)[key]:
        assert time.monotonic() < deadline, f"the router never sent the key back to a\n{router.log.read_text()[-2000:]}"
        on_a.chat(model="tiny", messages=[{"role": "user", "content": "back"}])
        time.sleep(0.2)  # the next try (a poll's pause; the breaker's timeout is 2 s)
    assert sessions_seen(a)[key] == 1  # the new engine's log: the chat that landed there, only

    assert a.stop() == 0 and b.stop() == 0
    assert not any(alive(v.server_pid()) for v in (a, b))


def test_streams_of_a_node_killed_or_drained_continue_on_another_node(tmp_path, fleet):
    """The fleet's part of "what survives what" (docs/operations.md): node a, holding three streams of the front's
    (``/api/chat``, ``/api/generate``, ``/v1/chat/completions``) and a non-streamed request, is SIGKILLed whole (its vllama and its vLLM, as a
    host that dies); the front asks each again through the router as its prompt's token ids and those already sent
    (``api/request/resume.py``), the router places it on node b, and each client gets its whole answer, every token
    once, in order, its counts covering the whole answer. Then b, drained past its ``--drain-timeout`` under a
    stream of the front's, stops its engine: the stream continues on node c. The stand-in answers
    ``return_token_ids`` (``FAKE_VLLM_TOKEN_IDS``) and continues a token-id prompt where it ends."""
    import openai

    router = fleet(Router, tmp_path / "router.log")
    env = {"FAKE_VLLM_TOKEN_DELAY": "0.02", "FAKE_VLLM_TOKEN_IDS": "1"}
    a = fleet(node, tmp_path, "a", router, env=env)
    b = fleet(node, tmp_path, "b", router, env=env, flags=["--drain-timeout", "1"])
    a.wait_state("ready"), b.wait_state("ready")
    router.wait_workers({a.url: True, b.url: True})
    log = tmp_path / "front.log"
    front = fleet(start_proxy, router.url, vllm_args=[], log=log)
    from vllama_proxy.api.fleet.affinity import client_key
    mine = next(k for k in (f"key-{i}" for i in range(64))  # a key of the client's own that the router hashes to a
                if Client(host=front.url, headers={"X-Session-ID": k}).generate(model="tiny", prompt="x")
                and client_key("-", k) in {r["headers"].get("x-session-id") or r["headers"].get("X-Session-ID")
                                           for r in httpx.get(a.vllm_url + "/_fake/requests").json()})  # type: ignore[attr-defined]
    n = 200
    whole = "".join(f"tok{i} " for i in range(n))
    ask = f"long [[tokens:{n}]]"
    client = Client(host=front.url, headers={"X-Session-ID": mine})
    chat = client.chat(model="tiny", messages=[{"role": "user", "content": ask}], stream=True)
    gen = client.generate(model="tiny", prompt=ask, stream=True)
    oa = openai.OpenAI(base_url=front.url + "/v1", api_key="-", default_headers={"X-Session-ID": mine})
    v1 = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ask}], stream=True,
                                    stream_options={"include_usage": True})
    pool = ThreadPoolExecutor(1)
    whole_v1 = pool.submit(oa.chat.completions.create, model="tiny", messages=[{"role": "user", "content": ask}])
    firsts = [next(chat), next(gen), next(v1)]
    deadline = time.monotonic() + 30
    while sum(ask in str(r["body"]) for r in httpx.get(a.vllm_url + "/_fake/requests").json()) < 4:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline and not whole_v1.done(), "the three streams and the whole answer are on a"
        time.sleep(0.05)
    node_a = psutil.Process(a.proc.pid)
    for p in [*node_a.children(recursive=True), node_a]:  # the whole node dies at once
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()

    chat_parts = [firsts[0], *chat]
    gen_parts = [firsts[1], *gen]
    v1_parts = [firsts[2], *v1]
    assert "".join(p.message.content for p in chat_parts) == whole
    assert chat_parts[-1].done and chat_parts[-1].eval_count == n and chat_parts[-1].done_reason == "stop"
    assert "".join(p.response for p in gen_parts) == whole
    assert gen_parts[-1].done and gen_parts[-1].eval_count == n
    assert "".join(c.choices[0].delta.content or "" for c in v1_parts if c.choices) == whole
    assert v1_parts[-1].usage.completion_tokens == n
    # non-streamed: nothing had reached its client; the router asks it again of b (it retries a request whose node
    # failed before its answer began, and such an answer begins at its end): whole, once
    answer = whole_v1.result(timeout=60)
    pool.shutdown()
    assert answer.choices[0].message.content == whole and answer.usage.completion_tokens == n
    resumed = [e for e in log_events(log) if e.get("event") == "stream_resumed" and e["tokens_sent"] > 0]
    assert len(resumed) == 3, resumed
    continued = [r for r in httpx.get(b.vllm_url + "/_fake/requests").json()  # type: ignore[attr-defined]
                 if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]
    assert len(continued) == 3, "b continued each stream as token ids"

    # b drained past its --drain-timeout (1 s) under a stream of the front's: the stream goes on on c
    c = fleet(node, tmp_path, "c", router, env=env)
    c.wait_state("ready")
    router.wait_workers({a.url: False, b.url: True, c.url: True})  # a, killed, could not leave: listed, unhealthy
    on_b = next(k for k in (f"key-b{i}" for i in range(64))
                if Client(host=front.url, headers={"X-Session-ID": k}).generate(model="tiny", prompt="y")
                and client_key("-", k) in {r["headers"].get("x-session-id") or r["headers"].get("X-Session-ID")
                                           for r in httpx.get(b.vllm_url + "/_fake/requests").json()})  # type: ignore[attr-defined]
    drained = Client(host=front.url, headers={"X-Session-ID": on_b}).chat(
        model="tiny", messages=[{"role": "user", "content": ask}], stream=True)
    parts = [next(drained)]
    b.proc.send_signal(signal.SIGTERM)
    parts += list(drained)
    assert "".join(p.message.content for p in parts) == whole and parts[-1].eval_count == n
    assert b.proc.wait(30) == 0
    assert any(isinstance((r["body"] or {}).get("prompt"), list)  # c continued it as token ids
               for r in httpx.get(c.vllm_url + "/_fake/requests").json())  # type: ignore[attr-defined]
    assert len([e for e in log_events(log) if e.get("event") == "stream_resumed" and e["tokens_sent"] > 0]) == 4


def test_router_child_mode(tmp_path, fleet):
    """``vllama serve --router POLICY``: the front starts vllm-router itself, nodes join it, it is
    restarted when it dies (the nodes join again), and it stops with the front."""
    import psutil

    router_port = free_port()
    log = tmp_path / "front.log"
    cmd = [sys.executable, "-m", "vllama_proxy", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--router", "sticky_least_loaded", "--router-port", str(router_port),
           (f"--router-args=--prometheus-port {free_port()} --health-check-interval-secs 1 --health-failure-threshold 1 "
            "--health-success-threshold 1 --worker-startup-check-interval 1")]
    proc = subprocess.Popen(cmd, env={**os.environ, "VLLAMA_LOG_FORMAT": "json", "VLLAMA_CPUS": "2",
                                      "VLLAMA_STATE_DIR": str(tmp_path / "front-state")},
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    front_url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    front = type("Front", (), {"proc": proc, "url": front_url})()
    fleet(lambda: front)
    wait_http(front_url + "/", proc)

    router = Router.__new__(Router)  # the front's child, seen from outside
    router.url, router.log = f"http://127.0.0.1:{router_port}", log

    def child() -> psutil.Process:
        # vllm-router retitles itself (its process name and command line: vllm::router)
        kids = [c for c in psutil.Process(proc.pid).children() if "vllm::router" in c.name() or "vllm-router" in " ".join(c.cmdline())]
        assert len(kids) == 1, kids
        return kids[0]

    first = child()
    a, b = fleet(node, tmp_path, "a", router), fleet(node, tmp_path, "b", router)
    a.wait_state("ready"), b.wait_state("ready")
    router.wait_workers({a.url: True, b.url: True})
    client = Client(host=front_url)
    for s in range(4):
        chat(client, 1, system=f"You are assistant {s}.", first="hi")
    assert sessions_seen(a) and sessions_seen(b)

    # its sessions are not logged one by one (two lines per request with --request-sessions): RUST_LOG
    assert "SLL: new session" not in log.read_text()
    decided = [e for e in log_events(log) if e.get("event") == "request_sessions"]
    assert [(e["on"], e["source"]) for e in decided] == [(True, "--router sticky_least_loaded")], decided

    first.kill()  # the router dies: the front starts another, the nodes join it again
    deadline = time.monotonic() + 20
    while True:
        try:
            second = child()
            if second.pid != first.pid and httpx.get(router.url + "/liveness").status_code == 200:
                break
        except (AssertionError, psutil.Error, httpx.HTTPError):
            pass
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    router.wait_workers({a.url: True, b.url: True})
    chat(client, 1, system="After the router's restart.", first="hi")

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not psutil.pid_exists(second.pid) or second.status() == psutil.STATUS_ZOMBIE


def test_router_needs_no_upstream():
    from vllama_proxy.settings import Settings

    s = Settings(router="sticky_least_loaded", router_port=30001)
    assert s.upstream_url == "http://127.0.0.1:30001" and s.upstream is None  # derived, --upstream not rewritten
    with pytest.raises(ValueError, match="without --model"):
        Settings(router="round_robin", model="m")
    with pytest.raises(ValueError, match="without --upstream"):
        Settings(router="round_robin", upstream="http://127.0.0.1:8000")


def test_session_key_is_the_conversations():
    from vllama_proxy.api.fleet import affinity
    from vllama_proxy.api.ollama.types import Message

    first = [Message(role="system", content="sys"), Message(role="user", content="hi")]
    later = [*first, Message(role="assistant", content="hello"), Message(role="user", content="more")]
    key = affinity.chat_key("m", first)
    assert key and key == affinity.chat_key("m", later)  # every turn of one conversation: one key
    assert key != affinity.chat_key("m", [first[0], Message(role="user", content="hi!")])
    assert key != affinity.chat_key("other", first) and affinity.chat_key("m", first[:1]) is None
    assert affinity.headers("X-Session-ID", None, key)["X-Session-ID"] == key
    assert affinity.headers("X-Session-ID", "mine", key)["X-Session-ID"] == "mine"  # the client's (scoped) key first
    assert "X-Session-ID" not in affinity.headers("", None, key)
    assert affinity.generate_key("m", None) is None and affinity.generate_key("m", "s") == affinity.generate_key("m", "s")


def test_session_key_system_scope():
    """``--session-key system``: one key per model and system prompt, whatever the conversation."""
    from vllama_proxy.api.fleet import affinity
    from vllama_proxy.api.ollama.types import Message

    sys_a, sys_b = Message(role="system", content="a"), Message(role="system", content="b")
    one, two = Message(role="user", content="hi"), Message(role="user", content="hello")
    key = affinity.chat_key("m", [sys_a, one], "system")
    assert key and key == affinity.chat_key("m", [sys_a, two, Message(role="assistant", content="x"), one], "system")
    assert key != affinity.chat_key("m", [sys_b, one], "system") and key != affinity.chat_key("n", [sys_a, one], "system")
    assert key != affinity.chat_key("m", [sys_a, one])  # the conversation's key is another
    # no system prompt: the conversation's key (a key of the model alone would send every such chat to one engine)
    assert affinity.chat_key("m", [one], "system") == affinity.chat_key("m", [one])
    assert affinity.chat_key("m", [one], "system") != affinity.chat_key("m", [two], "system")
    assert affinity.chat_key("m", [sys_a], "system") is None  # no user message yet


def test_one_request_keys():
    """``--request-sessions on`` (issue 43): a request with no key to share goes under a key of its own,
    which is released at the router; a shared system prompt keeps its key, a client's own key is its own."""
    from vllama_proxy.api.fleet import affinity
    from vllama_proxy.api.ollama.types import Message

    sys_a, one = Message(role="system", content="a"), Message(role="user", content="hi")
    shared = affinity.chat_key("m", [sys_a, one], "system", per_request=True)
    assert shared == affinity.chat_key("m", [sys_a, one], "system")
    assert affinity.chat_key("m", [one], "system", per_request=True) is None  # placed by load, every turn
    assert affinity.chat_key("m", [one], "conversation", per_request=True) == affinity.chat_key("m", [one])

    sent, release = affinity.placement("X-Session-ID", None, None, True)
    again, other = affinity.placement("X-Session-ID", None, None, True)
    assert release and other and release != other and sent == {"X-Session-ID": release} and again == {"X-Session-ID": other}
    assert affinity.placement("X-Session-ID", None, shared, True) == ({"X-Session-ID": shared}, None)  # kept, never released
    assert affinity.placement("X-Session-ID", "mine", None, True) == ({"X-Session-ID": "mine"}, None)  # the client's own
    assert affinity.placement("X-Session-ID", None, None, False) == ({}, None)
    assert affinity.placement("", "mine", None, True) == ({}, None)

    # a relayed OpenAI chat shares /api/chat's key for the same system prompt; without one it has none
    body = {"messages": [{"role": "system", "content": [{"type": "text", "text": "a"}]}, {"role": "user", "content": "x"}]}
    assert affinity.openai_key("m", body, "system") == shared
    assert affinity.openai_key("m", {"messages": [{"role": "user", "content": "hi"}]}, "system") is None
    assert affinity.openai_key("m", {"prompt": "p"}, "system") is None


def test_request_sessions_decided_at_start(tmp_path, fake):
    """``--request-sessions auto``: on before a vllm-router (it answers ``/list_workers``) and with
    ``--router sticky_least_loaded``; off before a plain vLLM (404), another ``--router`` policy, no header."""
    import asyncio

    from vllama_proxy.front.fleet import resolve_request_sessions
    from vllama_proxy.settings import Settings

    def decide(**kw) -> str:
        return asyncio.run(resolve_request_sessions(Settings(**kw))).request_sessions

    router = Router(tmp_path / "router.log", policy="sticky_least_loaded")
    try:
        assert decide(upstream=router.url) == "on"
        assert decide(upstream=fake.url) == "off"
        assert decide(upstream=router.url, session_header="") == "off"
        assert decide(upstream=fake.url, request_sessions="on") == "on"
        assert decide(upstream=router.url, request_sessions="off") == "off"
        assert decide(router="sticky_least_loaded") == "on" and decide(router="round_robin") == "off"
    finally:
        stop(router.proc)


@contextlib.asynccontextmanager
async def _router_stub(finish_session):
    """A stand-in router answering ``POST /finish_session`` with ``finish_session``; yields an
    :class:`~vllama_proxy.upstream.Upstream` started against it (both closed after)."""
    from aiohttp import web

    from vllama_proxy.upstream import Upstream

    app = web.Application()
    app.router.add_post("/finish_session", finish_session)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    upstream = Upstream(f"http://127.0.0.1:{port}")
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.close()
        await runner.cleanup()


async def test_releases_are_bounded_when_the_router_hangs():
    """A router that takes the releases and answers none (issue 43 review): at most ``limit`` releases are in
    flight per process, one more is not sent (counted as failed: its key expires at the router), and none is
    started once the app's upstream session is closing; the ones in flight are released when it answers."""
    import asyncio

    from aiohttp import web

    from vllama_proxy.api.fleet.router_release import RouterRelease

    seen: list[str] = []
    all_in, answer = asyncio.Event(), asyncio.Event()

    async def finish_session(request: web.Request) -> web.Response:
        seen.append(request.query["session_id"])
        if len(seen) == 4:
            all_in.set()
        await answer.wait()
        return web.json_response({"status": "ok", "session_id": request.query["session_id"]})

    async with _router_stub(finish_session) as upstream:
        releases = RouterRelease(limit=4)
        for i in range(10):
            releases.release(upstream, f"r{i}")
        await asyncio.wait_for(all_in.wait(), 30)
        assert releases.failed == 6 and sorted(seen) == [f"r{i}" for i in range(4)]
        answer.set()
        await releases.close()
        assert releases.released == 4
        releases.release(upstream, "late")  # the app is closing: nothing started on a closing session
        assert releases.failed == 7 and not releases._pending and len(seen) == 4


async def test_releases_keep_a_few_connections_of_their_own():
    """A wave of answers ending together (issue 43: closed-loop streams placed evenly by load end in step) sends
    a wave of releases: each took the requests' pool and, finding no idle connection there (the answers' own
    still waited for their body's end), opened one, so every wave was a burst of connects to a router whose
    listen queue holds 128 (vllm-router 0.1.17). They go on at most 16 kept-alive connections of their own,
    waiting for one, and none is lost."""
    import asyncio

    from aiohttp import web

    from vllama_proxy.api.fleet.router_release import RouterRelease

    ports: set[int] = set()
    seen: list[str] = []
    first = asyncio.Event()

    async def finish_session(request: web.Request) -> web.Response:
        ports.add(request.transport.get_extra_info("peername")[1])
        seen.append(request.query["session_id"])
        if len(seen) >= 16:
            first.set()
        await asyncio.wait_for(first.wait(), 10)  # the first ones answer once 16 are in: a burst at once
        return web.json_response({"status": "ok", "session_id": request.query["session_id"]})

    async with _router_stub(finish_session) as upstream:
        releases = RouterRelease()
        for i in range(64):
            releases.release(upstream, f"r{i}")
        await releases.close()
        assert releases.released == 64 and releases.failed == 0 and sorted(seen) == sorted(f"r{i}" for i in range(64))
        assert len(ports) <= 16, f"{len(ports)} connections opened for 64 releases"


def test_request_sessions_off_where_no_router_reads_them(tmp_path, fleet, fake):
    """``--request-sessions on`` is overridden, with a warning, where no router can read the keys (issue 43
    review): a node (no ``--upstream``: vllama sends to its own vLLM, which would answer each release 404)
    and ``--session-header ''`` (nothing sent, only released)."""
    import asyncio

    from vllama_proxy.front.fleet import resolve_request_sessions
    from vllama_proxy.settings import Settings

    def decide(**kw) -> str:
        return asyncio.run(resolve_request_sessions(Settings(**kw))).request_sessions

    assert decide(request_sessions="on") == "off" and decide(request_sessions="auto") == "off"
    assert decide(upstream=fake.url, request_sessions="on", session_header="") == "off"
    assert decide(upstream=fake.url, request_sessions="on") == "on"  # a front's own word is kept

    vllm_port = free_port()
    v = fleet(Vllama, tmp_path, env={"VLLAMA_REQUEST_SESSIONS": "on"}, flags=["--vllm-port", str(vllm_port)])
    v.wait_state("ready")
    Client(host=v.url).generate(model="tiny", prompt="no system prompt")
    log = httpx.get(f"http://127.0.0.1:{vllm_port}/_fake/requests").json()
    sent = [{k.lower(): x for k, x in r["headers"].items()}.get("x-session-id") for r in log if r["path"] in ("/v1/chat/completions", "/v1/completions")]
    assert sent == [None], sent  # no one-request key, so nothing to release at a vLLM
    decided = [e for e in log_events(v.log) if e.get("event") == "request_sessions"]
    assert [(e["on"], e["level"]) for e in decided] == [(False, "warning")], decided


def test_a_clients_own_key_is_scoped_hashed_and_bounded():
    """A client's own ``X-Session-ID`` before a router (issue 43 follow-up): the key sent is its value scoped to
    its caller and hashed to vllama's shape (same caller and value: same key; another caller, or the same
    string among vllama's own keys: another), at most ``IN_FLIGHT`` requests are under it at once (the next is
    placed as if no key had been sent), ``X-User-ID`` counts as its key when there is no ``X-Session-ID``; a node
    (not scoped) keeps the header as it came, and ``--session-header ''`` sends nothing."""
    from vllama_proxy.api.fleet import affinity
    from vllama_proxy.api.fleet.client_affinity import IN_FLIGHT, ClientAffinity

    alice, bob = affinity.client_key("alice", "conv-1"), affinity.client_key("bob", "conv-1")
    assert re.fullmatch(r"[0-9a-f]{32}", alice) and alice == affinity.client_key("alice", "conv-1")
    assert len({alice, bob, affinity.client_key("alice", "conv-2"), affinity.client_key("-", "conv-1")}) == 4
    # no key of vllama's, whatever the client puts where vllama's keys come from
    assert alice not in (affinity.generate_key("alice", "conv-1"), affinity.generate_key("client", "alice\0conv-1"))
    assert re.fullmatch(r"[0-9a-f]{32}", affinity.client_key("alice", "\udcff" + "x" * 10_000))  # any header bytes

    clients = ClientAffinity("X-Session-ID", scoped=True)
    with contextlib.ExitStack() as held:
        keys = [held.enter_context(clients.hold("alice", {"X-Session-ID": "conv-1"})) for _ in range(IN_FLIGHT)]
        assert keys == [alice] * IN_FLIGHT and clients.in_flight(alice) == IN_FLIGHT
        with clients.hold("alice", {"X-Session-ID": "conv-1"}) as beyond:
            assert beyond is None and clients.beyond == 1  # placed as if no key had been sent
        with clients.hold("bob", {"X-Session-ID": "conv-1"}) as other:
            assert other == bob  # another caller's bound is its own
        with clients.hold("alice", {"X-User-ID": "conv-1"}) as by_user:
            assert by_user is None  # X-User-ID is the same client key, bounded alike
    assert clients.in_flight(alice) == 0
    with clients.hold("alice", {"X-User-ID": "conv-1"}) as by_user, clients.hold("alice", {}) as none:
        assert by_user == alice and none is None
    with ClientAffinity("X-Session-ID", scoped=False).hold("alice", {"X-Session-ID": "mine"}) as node:
        assert node == "mine"  # a node: the front's key as it came, uncounted
    with ClientAffinity("", scoped=True).hold("alice", {"X-Session-ID": "mine"}) as unsent:
        assert unsent is None


def test_relayed_request_sends_the_clients_key_scoped(fake):
    """A relayed ``/v1`` request or an agent's that carries the client's own router key (``X-Session-ID``, or
    ``X-User-ID``, which vllm-router reads next) goes under that key scoped to its caller, and neither header
    is forwarded as it came (issue 43 follow-up: no tenant steers the router with a raw string); no one-request
    key of vllama's over it; a request with neither gets a key of its own."""
    from vllama_proxy.api.fleet import affinity

    front = start_proxy(fake.url, "--request-sessions", "on", "--session-key", "system", vllm_args=[])
    try:
        def sent(marker: str, headers: dict[str, str], path: str = "/v1/chat/completions") -> dict[str, str]:
            body = {"model": "fake:7b", "messages": [{"role": "user", "content": marker}], "max_tokens": 2}
            httpx.post(front.url + path, json=body, headers=headers, timeout=30).raise_for_status()
            log = httpx.get(fake.url + "/_fake/requests").json()
            seen = [r for r in log if r["path"] == path and marker in str(r["body"])]
            assert len(seen) == 1, seen
            return {k.lower(): v for k, v in seen[0]["headers"].items()}

        scoped = affinity.client_key("-", "u1")  # an open server: one caller
        by_user = sent("review13 user key", {"X-User-ID": "u1"})
        assert by_user["x-session-id"] == scoped and "x-user-id" not in by_user, by_user
        by_session = sent("review13 session key", {"X-Session-ID": "u1", "X-User-ID": "u2"})
        assert by_session["x-session-id"] == scoped and "x-user-id" not in by_session, by_session
        assert sent("review13 agent", {"X-Session-ID": "u1"}, "/v1/messages")["x-session-id"] == scoped
        assert re.fullmatch(r"r[0-9a-f]{32}", sent("review13 no key", {})["x-session-id"])
    finally:
        stop(front.proc)


def test_relayed_chats_keep_their_conversation_key():
    """``--session-key conversation`` with ``--request-sessions on`` (issue 43 review): a relayed
    ``/v1/chat/completions`` gets its conversation's key, the one ``/api/chat`` gets for the same messages,
    on every turn (a one-request key would place each turn of a ``/v1`` conversation by load, against
    docs/fleet.md's "keep them sticky with --session-key conversation"); no user message: none."""
    from vllama_proxy.api.fleet import affinity
    from vllama_proxy.api.ollama.types import Message

    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    later = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    key = affinity.openai_key("m", {"messages": first}, "conversation")
    assert key and key == affinity.openai_key("m", {"messages": later}, "conversation")
    assert key == affinity.chat_key("m", [Message(role="system", content="sys"), Message(role="user", content="hi")])
    other = [first[0], {"role": "user", "content": "hi!"}]
    assert affinity.openai_key("m", {"messages": other}, "conversation") not in (key, None)
    image = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:a"}}]}]
    assert affinity.openai_key("m", {"messages": image}, "conversation") != affinity.openai_key("m", {"messages": first[1:]}, "conversation")
    assert affinity.openai_key("m", {"messages": first[:1]}, "conversation") is None
    assert affinity.openai_key("m", {"prompt": "p"}, "conversation") is None


def test_stand_in_prefix_cache_counts_as_vllm():
    """The stand-in's ``vllm:prefix_cache_*`` (what loadgen's cluster hit rate reads in dry runs)."""
    from fake_vllm import PrefixCache

    cache = PrefixCache(capacity=4)
    words = [f"w{i}" for i in range(40)]  # 2 full blocks of 16, 8 words left over
    cache.query(words)
    assert (cache.queries, cache.hits) == (40, 0)
    cache.query(words[:20] + ["other"] * 20)  # the first block is shared, the second is not
    assert (cache.queries, cache.hits) == (80, 16)
    cache.query([f"x{i}" for i in range(64)])  # 4 new blocks: the least recently used leave
    cache.query(words)
    assert cache.hits == 16, "evicted blocks are no hits"



def test_fleet_secret_and_a_node_replaced_under_load(tmp_path, fleet):
    """``--fleet-secret`` (here ``VLLAMA_FLEET_SECRET``, as the recipes give it): the front serves its
    users' keys; a node, and the router (which passes the caller's ``Authorization`` on to the node),
    refuse a user's key and no key, so the front's keys, allow-lists and fair share cannot be walked
    around. Then node a is replaced under load: on SIGTERM it leaves the router, answers new requests
    and ``/health`` 503 while its stream in flight finishes, and stops; a new node joins; no turn is
    lost. A node past its ``--drain-timeout`` ends its open stream with an error line."""
    router = fleet(Router, tmp_path / "router.log", policy="sticky_least_loaded")
    secret = {"VLLAMA_FLEET_SECRET": "fleet-s3cret", "FAKE_VLLM_TOKEN_DELAY": "0.01"}
    a = fleet(node, tmp_path, "a", router, env=secret, flags=["--drain-timeout", "30"])
    b = fleet(node, tmp_path, "b", router, env=secret)
    a.wait_state("ready"), b.wait_state("ready")
    router.wait_workers({a.url: True, b.url: True})  # the router's health checks carry no key: /health stays open
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "alice"\nkey = "alice-key"\n')
    front = fleet(start_proxy, router.url, "--api-key-file", str(keys), vllm_args=[], env=secret)
    user, fleet_key = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer fleet-s3cret"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    for s in range(6):  # 6 conversations: both nodes answer the front
        assert Client(host=front.url, headers=user).chat(
            model="tiny", messages=[{"role": "user", "content": f"hi from {s}"}]).message.content
    assert sessions_seen(a) and sessions_seen(b)
    assert httpx.post(front.url + "/api/chat", json=body).status_code == 401
    openai_body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for around in (a.url, b.url, router.url):
        for headers in ({}, user):
            for path, payload in (("/v1/chat/completions", openai_body), ("/api/chat", body)):
                r = httpx.post(around + path, json=payload, headers=headers, timeout=10)
                assert r.status_code == 401, (around, path, headers, r.status_code, r.text)
        assert httpx.get(around + "/v1/models", headers=user).status_code == 401
    # a request without a key to share goes under a one-request key (the front found the router: auto), and its
    # release, sent with the front's bearer like every upstream request, is taken by the router (no key of its own)
    Client(host=front.url, headers=user).generate(model="tiny", prompt="no system prompt")
    deadline = time.monotonic() + 30
    while "SLL: finished session 'r" not in router.log.read_text():
        assert time.monotonic() < deadline, router.log.read_text()[-2000:]
        time.sleep(0.1)

    # load: 4 users chatting through the front, each turn a new conversation (the router places its key)
    stop_load, turns, lost = threading.Event(), Counter(), []

    def user_load(u: int) -> None:
        client = Client(host=front.url, headers=user)
        while not stop_load.is_set():
            try:
                parts = list(client.chat(model="tiny", stream=True, messages=[
                    {"role": "user", "content": f"user {u} turn {turns[u]} [[tokens:20]]"}]))
                assert parts[-1].done, parts[-1]
                turns[u] += 1
            except Exception as e:  # noqa: BLE001 - every failure is a lost turn, counted
                lost.append(repr(e))
                turns[u] += 1

    load = [threading.Thread(target=user_load, args=(u,), daemon=True) for u in range(4)]
    for t in load:
        t.start()
    long = Client(host=a.url, headers=fleet_key).chat(model="tiny", stream=True,
                                                    messages=[{"role": "user", "content": "long [[tokens:300]]"}])
    next(long)
    a.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while a.url in router.workers():  # a left the router
        assert time.monotonic() < deadline, router.workers()
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while True:  # a drains: readiness false, new requests 503 (a router retries them elsewhere), listener open
        try:
            if httpx.get(a.url + "/health").status_code == 503:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "a draining node must answer /health 503"
        time.sleep(0.05)
    r = httpx.post(a.url + "/api/chat", json=body, headers=fleet_key)
    assert r.status_code == 503 and "Retry-After" in r.headers, r.text
    # its replacement, started once a is seen draining: a process start takes seconds on a busy host,
    # and a's stream (3 s) may end meanwhile, a then stopped, its /health never seen
    a2 = fleet(node, tmp_path, "a2", router, env=secret, flags=["--drain-timeout", "1"])
    a2.wait_state("ready")
    router.wait_workers({b.url: True, a2.url: True})
    parts = list(long)  # a's stream in flight finished whole
    assert parts[-1].done and len(parts) > 250
    assert a.proc.wait(30) == 0
    done_before, deadline = sum(turns.values()), time.monotonic() + 20
    while sum(turns.values()) < done_before + 8 and time.monotonic() < deadline:  # the load goes on over b and a2
        time.sleep(0.1)
    stop_load.set()
    for t in load:
        t.join(30)
    assert not lost, lost
    assert sessions_seen(a2), "the new node takes new conversations"

    # past its --drain-timeout (1 s), a node stops its engine: the open stream ends with an error line
    cut = Client(host=a2.url, headers=fleet_key).chat(model="tiny", stream=True,
                                                    messages=[{"role": "user", "content": "long [[tokens:1000]]"}])
    next(cut)
    a2.proc.send_signal(signal.SIGTERM)
    with pytest.raises(ResponseError):
        for _ in cut:
            pass
    assert a2.proc.wait(30) == 0
