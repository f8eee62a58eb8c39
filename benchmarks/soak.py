#!/usr/bin/env python3
"""A soak of ``vllama serve`` supervising the stand-in vLLM (``tests/bin/vllm`` = ``tests/fake_vllm.py``).

What it runs, for ``--duration`` seconds:

- ``vllama serve --model DIR --workers 2 --api-key-file KEYS`` (so: a front process and its workers),
  the stand-in vLLM behind it with ``FAKE_VLLM_TOKEN_DELAY`` (default 0.01 s a token);
- ``--concurrency`` client loops in this process, each picking at random: ``/api/chat`` and
  ``/api/generate`` with the real ``ollama`` client, ``/v1/chat/completions`` with the real ``openai``
  client, streamed or not, from several keys (one with ``max_in_flight = 2``, so it meets 429s, and now
  and then a wrong key: 401); and clients that leave mid-stream (aiohttp: a few lines read, then the
  connection closed);
- a keys-file rewrite and SIGHUP every ``--hup-every`` seconds (a key added and the previous one removed);
- one vLLM restart (SIGKILL of the stand-in server at ``--restart-at`` of the duration; the supervisor
  restarts it) and one SIGHUP storm (``--storm`` SIGHUPs within a second at ``--storm-at``);
- every ``--sample-every`` s: RSS and open files (psutil) of every vllama process (front and workers; not
  the stand-in).

Each request has a deadline (``--deadline`` s). Its outcome is one of: ``ok`` (a full answer: a last
``done: true`` / a ``finish_reason``), ``error_line`` (a stream that ended with an Ollama ``{"error"}`` line
or an OpenAI error event), ``http_4xx``/``http_5xx`` (an HTTP error with a JSON error body), ``left`` (the
client left on purpose), and the failures: ``truncated`` (a stream that ended with neither a last answer nor
an error), ``hang`` (past its deadline), ``bad_body`` (an HTTP error without a JSON error), ``conn_error``
(vllama refused or reset the connection), ``http_500``.

Flat, for each vllama process: the growth = the last third's maximum minus the first sample after the warm-up
(``--warmup`` s). RSS is flat when growth <= ``--rss-bound`` MiB; open files when growth <=
2 x concurrency + 16 (each request in flight holds at most a client socket and an upstream one; a leak of one
descriptor per request grows by thousands).

Prints a table; ``--json PATH`` writes the full result (every sample, every failure). Exit 0 when every check
passed, 1 otherwise. Used by ``tests/test_soak.py`` (a short run) and recorded in ``benchmarks/RESULTS.md`` (30 min):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/soak.py --duration 1800 --hup-every 60 --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import ollama
import openai
import psutil

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
MODEL = "tiny"
#: Outcomes that are not failures.
GOOD = ("ok", "error_line", "http_4xx", "http_5xx", "left")
#: The supervisor's timings as the tests set them (tests/conftest.py FAST): a restart within seconds.
FAST = ["--no-gpu-check", "--health-interval", "0.2", "--startup-poll-interval", "0.1", "--restart-backoff-initial", "0.2",
        "--restart-backoff-max", "1", "--crash-loop-limit", "3", "--failed-retry-interval", "30", "--stop-grace", "2",
        "--drain-timeout", "10"]


def keys_toml(generation: int) -> str:
    """The keys file: three stable keys and one that changes at each reload (``sk-rot-N``)."""
    keys = [
        {"name": "alice", "key": "sk-alice", "role": "user"},
        {"name": "bob", "key": "sk-bob", "role": "user", "max_in_flight": 2},
        {"name": "carol", "key": "sk-carol", "role": "admin"},
        {"name": f"rot{generation}", "key": f"sk-rot-{generation}", "role": "user"},
    ]
    return "\n".join("[[keys]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in key.items()) for key in keys)


@dataclass
class Result:
    kind: str
    outcome: str
    seconds: float
    detail: str = ""
    t: float = 0.0  # its end, seconds after the traffic began


@dataclass
class Soak:
    args: argparse.Namespace
    work: Path
    url: str = ""
    proc: "subprocess.Popen | None" = None  # noqa: F821
    results: list[Result] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    generation: int = 0
    t0: float = 0.0
    clients: dict = field(default_factory=dict)

    # -- vllama ---------------------------------------------------------------------------------------

    def start(self) -> None:
        import subprocess

        from vllama_proxy.supervisor.ports import free_loopback_port

        port = free_loopback_port()
        self.url = f"http://127.0.0.1:{port}"
        (self.work / "tiny").mkdir(exist_ok=True)
        self.keys = self.work / "keys.toml"
        self.keys.write_text(keys_toml(0))
        self.log = self.work / "vllama.log"
        root = self.args.root
        tests = root / "tests"
        env = {**os.environ, "PYTHONPATH": str(root), "PATH": f"{tests / 'bin'}:{os.environ['PATH']}", "FAKE_VLLM_PIDFILE": str(self.work / "pids"),
               "FAKE_VLLM_PYTHON": sys.executable, "VLLAMA_LOG_FORMAT": "json", "VLLAMA_STATE_DIR": str(self.work / "state"),
               "VLLAMA_CPUS": "2", "HF_HOME": str(self.work / "hf"), "HF_HUB_OFFLINE": "1",
               "VLLAMA_VLLM_EXECUTABLE": str(tests / "bin" / "vllm"),
               "FAKE_VLLM_TOKEN_DELAY": str(self.args.token_delay), "PYTHONFAULTHANDLER": "1"}
        cmd = [sys.executable, "-m", "vllama_proxy", "serve", "--model", str(self.work / "tiny"), "--served-model-name", MODEL,
               "--port", str(port), "--workers", str(self.args.workers), "--api-key-file", str(self.keys), *FAST]
        self.proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))

    def log_events(self) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def readyz(self) -> dict:
        try:
            req = urllib.request.Request(self.url + "/readyz", headers={"Authorization": "Bearer sk-carol"})  # admin: the full body
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())
        except OSError:
            return {"state": "down"}

    async def wait_ready(self, timeout: float, restarts: int | None = None) -> dict:
        """Until /readyz says ready (with ``restarts`` restarts); ``timeout`` bounds a failure."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllama exited with {self.proc.returncode}")
            body = await asyncio.to_thread(self.readyz)
            if body.get("state") == "ready" and (restarts is None or body.get("restarts") == restarts):
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllama not ready after {timeout:.0f} s: {body}")
            await asyncio.sleep(0.1)

    def processes(self) -> dict[str, psutil.Process]:
        """vllama's own processes: ``front`` and each worker (its children started by multiprocessing's spawn,
        front/workers.py), and multiprocessing's resource tracker if one runs; not vLLM (the stand-in)."""
        front = psutil.Process(self.proc.pid)
        out = {"front": front}
        server = self.server_pid()
        for child in front.children():
            try:
                line = " ".join(child.cmdline())
            except psutil.NoSuchProcess:
                continue
            if child.pid == server:
                continue
            if "spawn_main" in line:
                out[f"worker-{child.pid}"] = child
            elif "resource_tracker" in line:
                out["tracker"] = child
        return out

    def server_pid(self) -> int | None:
        try:
            return int((self.work / "pids.server").read_text())
        except (OSError, ValueError):
            return None

    def sample(self) -> None:
        row = {"t": round(time.monotonic() - self.t0, 1)}
        for name, p in self.processes().items():
            try:
                with p.oneshot():
                    row[name] = {"rss_mib": round(p.memory_info().rss / 2**20, 2), "fds": p.num_fds(),
                                 "cpu_s": round(sum(p.cpu_times()[:2]), 1)}
            except psutil.NoSuchProcess:
                pass
        self.samples.append(row)

    # -- the clients ---------------------------------------------------------------------------------------

    def key(self) -> str:
        r = random.random()
        if r < 0.02:
            return "sk-wrong"
        if r < 0.25:
            return "sk-bob"
        if r < 0.35:
            return f"sk-rot-{self.generation}"  # may race a reload: a 401, an answer in the right shape
        return random.choice(("sk-alice", "sk-carol"))

    async def one(self, session: aiohttp.ClientSession) -> None:
        kind = random.choice(("chat", "chat_stream", "generate", "generate_stream", "openai", "openai_stream",
                              "leave_ndjson", "leave_sse"))
        key = self.key()
        n = random.randint(4, self.args.tokens)
        start = time.monotonic()
        try:
            outcome, detail = await asyncio.wait_for(self.request(session, kind, key, n), self.args.deadline)
        except TimeoutError:
            outcome, detail = "hang", f"no end within {self.args.deadline} s"
        except ollama.ResponseError as e:
            outcome, detail = self.status_outcome(e.status_code, e.error, None), f"{e.status_code} {e.error[:200]}"
        except openai.APIStatusError as e:
            outcome, detail = self.status_outcome(e.status_code, str(e), e.body), f"{e.status_code} {str(e)[:200]}"
        except openai.APIError as e:  # an error event in the stream (openai's SSE decoder raises it)
            outcome, detail = "error_line", str(e)[:200]
        except (aiohttp.ClientError, ConnectionError, openai.APIConnectionError, ollama.RequestError) as e:
            outcome, detail = "conn_error", repr(e)[:200]
        except Exception as e:  # noqa: BLE001 (any other end of a request is a failure to report)
            outcome, detail = "exception", repr(e)[:200]
        self.results.append(Result(kind, outcome, time.monotonic() - start, detail, round(time.monotonic() - self.t0, 2)))

    @staticmethod
    def status_outcome(status: int | None, text: str, body) -> str:
        if status == 500:
            return "http_500"
        if status is None:  # ollama: an {"error"} line in a stream
            return "error_line"
        if body is not None and not isinstance(body, dict):
            return "bad_body"
        if text.lstrip().startswith("<"):
            return "bad_body"  # an HTML error page, not a JSON error
        return "http_4xx" if status < 500 else "http_5xx"

    async def request(self, session: aiohttp.ClientSession, kind: str, key: str, n: int) -> tuple[str, str]:
        prompt = f"soak [[tokens:{n}]]"
        headers = {"Authorization": f"Bearer {key}"}
        if kind.startswith("leave_"):
            return await self.leave(session, kind, headers)
        if kind.startswith("openai"):
            client = self.clients.get(("openai", key))
            if client is None:
                client = self.clients[("openai", key)] = openai.AsyncOpenAI(
                    base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=self.args.deadline, http_client=self.http)
            msgs = [{"role": "user", "content": prompt}]
            if kind == "openai":
                r = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n)
                return ("ok", "") if r.choices and r.choices[0].finish_reason else ("truncated", "no finish_reason")
            finish = None
            stream = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return ("ok", "") if finish else ("truncated", "stream ended with no finish_reason and no error event")
        client = self.clients.get(("ollama", key))
        if client is None:  # one per key, kept: the client's own connections are not what is measured
            client = self.clients[("ollama", key)] = ollama.AsyncClient(host=self.url, headers=headers, timeout=self.args.deadline)
        opts = {"num_predict": n}
        if kind.startswith("chat"):
            call = client.chat(model=MODEL, messages=[{"role": "user", "content": prompt}], options=opts, stream=kind.endswith("stream"))
        else:
            call = client.generate(model=MODEL, prompt=prompt, options=opts, stream=kind.endswith("stream"))
        r = await call
        if not kind.endswith("stream"):
            return ("ok", "") if r.done else ("truncated", "done false")
        last = None
        async for chunk in r:
            last = chunk
        return ("ok", "") if last is not None and last.done else ("truncated", "stream ended with no done line and no error line")

    async def leave(self, session: aiohttp.ClientSession, kind: str, headers: dict) -> tuple[str, str]:
        """A client that reads a few lines of a long stream and closes its connection."""
        if kind == "leave_ndjson":
            path, body = "/api/generate", {"model": MODEL, "prompt": "soak [[tokens:2000]]", "options": {"num_predict": 2000}}
        else:
            path, body = "/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": 2000,
                                                  "messages": [{"role": "user", "content": "soak [[tokens:2000]]"}]}
        async with session.post(self.url + path, json=body, headers=headers) as r:
            if r.status >= 400:
                text = await r.text()
                try:
                    err = json.loads(text)
                except ValueError:
                    return "bad_body", f"{r.status} {text[:200]}"
                return self.status_outcome(r.status, text, err), f"{r.status} {text[:200]}"
            lines = 0
            want = random.randint(1, 5)
            async for raw in r.content:
                if b'"error"' in raw:
                    return "error_line", raw.decode(errors="replace")[:200]
                if raw.strip():
                    lines += 1
                if lines >= want:
                    r.close()  # leave: the connection is closed mid-stream
                    return "left", ""
            return "truncated", f"a 2000-token stream ended after {lines} lines"

    async def client_loop(self, session: aiohttp.ClientSession, end: float) -> None:
        while time.monotonic() < end:
            await self.one(session)
            await asyncio.sleep(random.uniform(0, self.args.think))

    # -- the disturbances ----------------------------------------------------------------------------------

    async def reloads(self, end: float) -> None:
        while True:
            await asyncio.sleep(self.args.hup_every)
            if time.monotonic() >= end:
                return
            self.generation += 1
            self.keys.write_text(keys_toml(self.generation))
            self.proc.send_signal(signal.SIGHUP)
            self.events.append((time.monotonic() - self.t0, f"reload {self.generation}"))

    async def restart(self, at: float) -> None:
        await asyncio.sleep(at)
        pid = self.server_pid()
        os.kill(pid, signal.SIGKILL)
        self.events.append((time.monotonic() - self.t0, f"SIGKILL vLLM {pid}"))
        body = await self.wait_ready(120, restarts=1)
        self.events.append((time.monotonic() - self.t0, f"ready again, restarts={body.get('restarts')}"))

    async def storm(self, at: float) -> None:
        await asyncio.sleep(at)
        for _ in range(self.args.storm):
            self.proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(1 / self.args.storm)
        self.events.append((time.monotonic() - self.t0, f"{self.args.storm} SIGHUPs in 1 s"))

    async def sampler(self, end: float) -> None:
        while time.monotonic() < end:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.args.sample_every)
        await asyncio.to_thread(self.sample)

    # -- the run ---------------------------------------------------------------------------------------

    async def run(self) -> dict:
        self.start()
        try:
            await self.wait_ready(180)
            # both processes catch SIGHUP (a handler set) before one is sent: until then SIGHUP ends them
            await self.wait_workers(180)
            load0 = os.getloadavg()
            self_cpu0 = sum(psutil.Process().cpu_times()[:2])
            self.t0 = time.monotonic()
            end = self.t0 + self.args.duration
            import httpx

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session, \
                    httpx.AsyncClient(timeout=self.args.deadline, limits=httpx.Limits(max_connections=None)) as self.http:
                tasks = [asyncio.create_task(self.client_loop(session, end)) for _ in range(self.args.concurrency)]
                side = [asyncio.create_task(self.reloads(end)), asyncio.create_task(self.sampler(end)),
                        asyncio.create_task(self.restart(self.args.restart_at * self.args.duration)),
                        asyncio.create_task(self.storm(self.args.storm_at * self.args.duration))]
                await asyncio.gather(*tasks)
                side[0].cancel()
                await asyncio.gather(*side[1:])
            wall = time.monotonic() - self.t0
            client_cpu = sum(psutil.Process().cpu_times()[:2]) - self_cpu0
            alive = self.proc.poll() is None
            processes = sorted(self.processes())
        finally:
            self.stop()
        return self.report(wall, client_cpu, load0, os.getloadavg(), alive, processes)

    async def wait_workers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            procs = {k: v for k, v in self.processes().items() if k != "tracker"}
            caught = []
            for p in procs.values():
                try:
                    status = Path(f"/proc/{p.pid}/status").read_text()
                except OSError:
                    continue
                bits = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
                caught.append(bits >> (signal.SIGHUP - 1) & 1)
            if len(procs) == self.args.workers and all(caught):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(procs)} vllama processes after {timeout} s, SIGHUP caught: {caught}")
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()

    def report(self, wall: float, client_cpu: float, load0, load1, alive: bool, processes: list[str]) -> dict:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        failures = [r.__dict__ for r in self.results if r.outcome not in GOOD]
        ok = sorted(r.seconds for r in self.results if r.outcome == "ok")

        def pct(xs, q):
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else None

        by_kind = {}
        for kind in sorted({r.kind for r in self.results}):
            xs = sorted(r.seconds for r in self.results if r.kind == kind and r.outcome == "ok")
            by_kind[kind] = {"n": sum(r.kind == kind for r in self.results), "ok": len(xs), "p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99)}
        # flat after warm-up: per process, the last third's max minus the first sample after the warm-up
        after = [s for s in self.samples if s["t"] >= self.args.warmup]
        last_third = [s for s in after if s["t"] >= self.samples[-1]["t"] - (self.samples[-1]["t"] - self.args.warmup) / 3]
        fd_bound = 2 * self.args.concurrency + 16
        memory = {}
        for name in sorted({k for s in self.samples for k in s if k != "t"}):
            first = next((s[name] for s in after if name in s), None)
            tail = [s[name] for s in last_third if name in s]
            if first is None or not tail:
                continue
            rss_growth = max(x["rss_mib"] for x in tail) - first["rss_mib"]
            fd_growth = max(x["fds"] for x in tail) - first["fds"]
            memory[name] = {"rss_warm_mib": first["rss_mib"], "rss_end_mib": tail[-1]["rss_mib"], "rss_growth_mib": round(rss_growth, 2),
                            "rss_max_mib": max(s[name]["rss_mib"] for s in self.samples if name in s),
                            "fds_warm": first["fds"], "fds_end": tail[-1]["fds"], "fds_growth": fd_growth,
                            "cpu_s": tail[-1]["cpu_s"] - first["cpu_s"],
                            "rss_flat": rss_growth <= self.args.rss_bound, "fds_flat": fd_growth <= fd_bound}
        logged = self.log_events()
        statuses: dict[str, int] = {}
        for e in logged:
            if e.get("event") == "request":
                statuses[str(e.get("status"))] = statuses.get(str(e.get("status")), 0) + 1
        logged_500 = [e for e in logged if e.get("event") == "request" and e.get("status") == 500]
        unhandled = [e for e in logged if e.get("event") == "unhandled_error" or e.get("level") in ("error", "critical")
                     and e.get("event") not in ("engine_exited", "vllm_exited")]
        reloaded = sum(e.get("event") == "keys_loaded" for e in logged)
        restarts = [e for e in logged if "restart" in str(e.get("event", ""))]
        # 5xx answers outside the restart (from its SIGKILL to 10 s after vLLM was ready again): reported, not a check
        kill = next((t for t, w in self.events if w.startswith("SIGKILL")), None)
        back = next((t for t, w in self.events if w.startswith("ready again")), None)
        outside = [r.__dict__ for r in self.results if r.outcome == "http_5xx"
                   and not (kill is not None and back is not None and kill <= r.t <= back + 10)]
        checks = {
            "every request answered or ended with an error": not failures,
            "no 500 logged": not logged_500,
            "vllama alive after the storm": alive,
            "one vLLM restart done": any("ready again" in what for _, what in self.events),
            "keys reloaded": reloaded > 0,
            "RSS flat after warm-up": bool(memory) and all(m["rss_flat"] for m in memory.values()),
            "open files flat after warm-up": bool(memory) and all(m["fds_flat"] for m in memory.values()),
        }
        return {"duration_s": round(wall, 1), "requests": len(self.results), "outcomes": counts,
                "p50_ms": pct(ok, 0.5), "p99_ms": pct(ok, 0.99), "by_kind": by_kind,
                "processes": processes, "memory": memory, "rss_bound_mib": self.args.rss_bound, "fd_bound": fd_bound,
                "logged_statuses": statuses, "logged_500": logged_500[:20], "logged_errors": unhandled[:20],
                "keys_loaded_lines": reloaded, "restart_lines": len(restarts), "events": self.events,
                "client_cpu_s": round(client_cpu, 1), "loadavg_start": load0, "loadavg_end": load1,
                "failures": failures[:50], "http_5xx_outside_restart": len(outside), "http_5xx_outside_examples": outside[:10], "checks": checks, "passed": all(checks.values()),
                "samples": self.samples, "log": str(self.log)}


def table(r: dict) -> str:
    out = [f"soak: {r['duration_s']} s, {r['requests']} requests, load average {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}, "
           f"client CPU {r['client_cpu_s']} s ({100 * r['client_cpu_s'] / max(r['duration_s'], 1):.0f} % of a core)", "",
           "| outcome | requests |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in sorted(r["outcomes"].items(), key=lambda kv: -kv[1])]
    out += ["", f"ok latency: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms", "", "| kind | requests | ok | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    out += [f"| {k} | {v['n']} | {v['ok']} | {v['p50_ms']} | {v['p99_ms']} |" for k, v in r["by_kind"].items()]
    out += ["", f"| process | RSS warm MiB | RSS end MiB | RSS growth (bound {r['rss_bound_mib']}) | open files warm | end | growth (bound {r['fd_bound']}) | CPU s |",
            "|---|---|---|---|---|---|---|---|"]
    out += [f"| {k} | {m['rss_warm_mib']} | {m['rss_end_mib']} | {m['rss_growth_mib']:+} | {m['fds_warm']} | {m['fds_end']} | {m['fds_growth']:+} | {m['cpu_s']:.0f} |"
            for k, m in r["memory"].items()]
    out += ["", f"statuses in vllama's log: {dict(sorted(r['logged_statuses'].items()))}; keys_loaded lines: {r['keys_loaded_lines']}",
            "events: " + "; ".join(f"{t:.0f} s {w}" for t, w in r["events"] if not w.startswith("reload")) +
            f"; {sum(w.startswith('reload') for _, w in r['events'])} reloads",
            f"5xx answers outside the restart (kill to ready + 10 s): {r['http_5xx_outside_restart']}", ""]
    out += [f"{'PASS' if v else 'FAIL'}  {k}" for k, v in r["checks"].items()]
    for f in r["failures"][:10]:
        out.append(f"  failure: {f}")
    for e in r["logged_errors"][:5]:
        out.append(f"  logged error: {json.dumps(e)[:300]}")
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800, help="seconds of traffic (default 1800)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the first flat sample (default: a sixth of the duration, at most 120)")
    p.add_argument("--hup-every", type=float, default=60, help="seconds between keys-file reloads (default 60)")
    p.add_argument("--concurrency", type=int, default=6, help="client loops (default 6)")
    p.add_argument("--think", type=float, default=0.1, help="at most this many seconds between a loop's requests (default 0.1)")
    p.add_argument("--tokens", type=int, default=40, help="at most this many tokens an answer (default 40)")
    p.add_argument("--token-delay", type=float, default=0.01, help="the stand-in's seconds a token (default 0.01)")
    p.add_argument("--deadline", type=float, default=60, help="seconds a request may take before it counts as a hang (default 60)")
    p.add_argument("--workers", type=int, default=2, help="vllama processes (--workers; default 2: the front and one worker)")
    p.add_argument("--restart-at", type=float, default=0.4, help="SIGKILL of the stand-in vLLM at this fraction of the duration")
    p.add_argument("--storm-at", type=float, default=0.6, help="the SIGHUP storm at this fraction of the duration")
    p.add_argument("--storm", type=int, default=50, help="SIGHUPs in the storm's second (default 50)")
    p.add_argument("--sample-every", type=float, default=5, help="seconds between RSS / open-file samples (default 5)")
    p.add_argument("--rss-bound", type=float, default=16, help="MiB an RSS may grow after the warm-up and still be flat (default 16)")
    p.add_argument("--workdir", type=Path, default=None, help="where the keys file and vllama.log go (default: a new temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the full result here")
    p.add_argument("--seed", type=int, default=52)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose vllama and stand-in run (default: this one)")
    a = p.parse_args(argv)
    if a.warmup is None:
        a.warmup = min(120.0, a.duration / 6)
    return a


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    random.seed(args.seed)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="vllama-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(Soak(args, work).run())
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
