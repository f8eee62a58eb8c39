#!/usr/bin/env python3
"""A lone request's TTFT through two vllama codes side by side, paired request by request (issue 42, item 4).

Runs the stand-in vLLM (``tests/fake_vllm.py``, ``FAKE_VLLM_TOKEN_DELAY`` ``--token-delay``, no engine)
and, in front of it, one ``vllama serve`` per code given (``--code LABEL=DIR``: the ``vllama_proxy`` in DIR,
e.g. ``git archive main vllama_proxy`` unpacked; ``LABEL=.`` this checkout), each with ``--workers``
(1) and, with ``--mode supervised`` (the default, as ``hop_cost.sh c1fake``), launching its own stand-in
through ``tests/bin/vllm``; ``--mode upstream`` puts them all in front of one stand-in (``--upstream``).
Target ``d`` is the stand-in's ``/v1/completions`` direct (the first code's stand-in when supervised); ``--relay``
adds ``r``, a bare aiohttp relay (``aiohttp_floor.py``) in front of it: the hop alone.

A blocking client (``http.client``, one keep-alive connection per target) sends one request at a time,
every target once per round in a shuffled order (seeded; ``--burst N``: N requests back to back each, as
``c1split`` interleaves 8), ``--route`` ``generate`` (raw ``/api/generate``),
``chat`` (``/api/chat``) or ``v1chat`` (a streamed ``/v1/chat/completions``, relayed), ``--tokens`` tokens, ``--gap-ms`` between requests; TTFT is the send to the
first line that carries a token. The processes are started afresh ``--epochs`` times (rounds and blocks split evenly over them: one
process's own layout shifts its TTFT by tens of µs, which one pair of processes would read as an effect).
Rounds are grouped in ``--blocks`` blocks; per block and target the TTFT
p50, and per pair of targets the difference of those p50s over the blocks: mean with its 95 % interval
(Student's t over the blocks and a seeded bootstrap, ``hop_report.mean_ci``), and the pooled p50s.

    python benchmarks/c1_paired.py --code main=/tmp/main-code --code new=. [--rounds 600] [--blocks 20]
        [--route generate|chat|v1chat] [--mode supervised|upstream] [--workers 1] [--json OUT]

Always stops its subprocesses.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from hop_report import mean_ci  # noqa: E402
from procs import Children, free_port, wait_http  # noqa: E402


class Target:
    """One endpoint the client asks: a kept-alive connection, the request's bytes, TTFTs in µs."""

    def __init__(self, label: str, port: int, path: str, body: dict) -> None:
        self.label, self.port, self.path = label, port, path
        self.body = orjson.dumps(body)
        self.conn = http.client.HTTPConnection("127.0.0.1", port)
        self.sse = path.startswith("/v1/")

    def ask(self) -> float:
        """One request: µs from the send to the first line with a token (the whole answer is read)."""
        t0 = time.perf_counter_ns()
        self.conn.request("POST", self.path, self.body, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{self.label} {self.path}: HTTP {r.status} {r.read()[:200]!r}")
        first = 0
        while True:
            line = r.readline()
            if not line:
                break
            if not first and line.strip() and (not self.sse or line.startswith(b"data: {")):
                first = time.perf_counter_ns()
        if not first:
            raise RuntimeError(f"{self.label}: no token")
        return (first - t0) / 1e3


def _start_vllama(children: Children, label: str, code: str, a: argparse.Namespace, tmp: Path, upstream: str | None,
                  env: dict[str, str]) -> tuple[int, int | None]:
    """Start one vllama from ``code``; ``(its port, its stand-in's port or None)``."""
    port = free_port()
    code_dir = str(Path(code).resolve())
    e = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [code_dir, env.get("PYTHONPATH")])),  # deps from the rest
         "VLLAMA_STATE_DIR": str(tmp / f"state-{label}")}
    if upstream:
        serve, fport = ["--upstream", upstream], None
    else:
        fport = free_port()
        serve = ["--model", str(tmp / "m"), "--served-model-name", "fake-model", "--vllm-port", str(fport),
                 "--keep-alive", "-1", "--no-gpu-check"]
    launcher = f"import sys; sys.path.insert(0, {code_dir!r}); from vllama_proxy.cli import main; sys.argv[0] = 'vllama'; sys.exit(main())"
    proc = children.start([sys.executable, "-c", launcher, "serve", *serve, "--port", str(port), "--workers", str(a.workers),
                           "--log-format", "json"], e, tmp / f"vllama-{label}.log")
    wait_http(f"http://127.0.0.1:{port}/", proc, timeout=120)
    probe = Target(label, port, "/api/generate", {"model": "fake-model", "prompt": "x [[tokens:1]]", "raw": True,
                                                 "options": {"num_predict": 1}})
    deadline = time.monotonic() + 120
    while True:  # the model serves (supervised: the stand-in launched and healthy)
        try:
            probe.ask()
            break
        except (RuntimeError, OSError):
            if time.monotonic() > deadline:
                raise
            probe.conn.close()
            time.sleep(0.5)
    if a.workers > 1:
        for _ in range(600):  # every worker listens
            if (tmp / f"vllama-{label}.log").read_text().count("worker_listening") >= a.workers - 1:
                break
            time.sleep(0.1)
    return port, fport


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", action="append", required=True, help="LABEL=DIR: a folder holding a vllama_proxy (repeat)")
    ap.add_argument("--mode", choices=("supervised", "upstream"), default="supervised")
    ap.add_argument("--route", choices=("generate", "chat", "v1chat"), default="generate")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=50, help="rounds not counted")
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--token-delay", type=float, default=0.002, help="the stand-in's seconds before each token")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="pause between requests")
    ap.add_argument("--burst", type=int, default=1, help="requests to one target back to back per round (c1split: 8, "
                    "no gap): what a server does after an answer then delays the next request")
    ap.add_argument("--no-direct", action="store_true", help="leave target d out")
    ap.add_argument("--relay", action="store_true", help="add target r: a bare aiohttp relay (aiohttp_floor.py) in front of d")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--epochs", type=int, default=4, help="fresh processes this many times (rounds and blocks split "
                    "evenly): one process's own layout moves its TTFT p50 by tens of µs (an A/A of one pair: +72 µs)")
    ap.add_argument("--json", default=None, help="every TTFT, by target and round")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vllama-c1pair-"))
    env = {**os.environ, "FAKE_VLLM_TOKEN_DELAY": str(a.token_delay), "FAKE_VLLM_PYTHON": sys.executable,
           "VLLAMA_VLLM_EXECUTABLE": str(ROOT / "tests" / "bin" / "vllm")}
    prompt = f"hello [[tokens:{a.tokens}]]"
    if a.route == "generate":
        path, body = "/api/generate", {"model": "fake-model", "prompt": prompt, "raw": True, "options": {"num_predict": a.tokens}}
    elif a.route == "v1chat":
        path, body = "/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": prompt}],
                                              "max_tokens": a.tokens, "stream": True}
    else:
        path, body = "/api/chat", {"model": "fake-model", "messages": [{"role": "user", "content": prompt}],
                                   "options": {"num_predict": a.tokens}}
    completions = {"model": "fake-model", "prompt": prompt, "max_tokens": a.tokens, "stream": True}
    rng = random.Random(a.seed)
    ttft: dict[str, list[float]] = {}
    labels: list[str] = []
    t0 = time.time()
    for epoch in range(a.epochs):
        # fresh processes each epoch, started in turn order (a process's own layout moves its TTFT by tens of µs)
        codes = a.code[epoch % len(a.code):] + a.code[:epoch % len(a.code)]
        children = Children()
        try:
            upstream = None
            direct_port = None
            if a.mode == "upstream":
                direct_port = free_port()
                fake = children.start([sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", str(tmp / "m"), "--port",
                                       str(direct_port), "--served-model-name", "fake-model"], env, tmp / "fake.log")
                wait_http(f"http://127.0.0.1:{direct_port}/health", fake)
                upstream = f"http://127.0.0.1:{direct_port}"
            targets: list[Target] = []
            for spec in codes:
                label, _, code = spec.partition("=")
                port, fport = _start_vllama(children, label, code, a, tmp, upstream, env)
                direct_port = direct_port or fport
                targets.append(Target(label, port, path, body))
            targets.sort(key=lambda t: [c.partition("=")[0] for c in a.code].index(t.label))
            if a.relay:
                rport = free_port()
                relay = children.start([sys.executable, str(HERE / "aiohttp_floor.py"), "--upstream",
                                        f"http://127.0.0.1:{direct_port}", "--port", str(rport)], env, tmp / "relay.log")
                wait_http(f"http://127.0.0.1:{rport}/", relay)
                targets.insert(0, Target("r", rport, "/v1/completions", completions))
            if not a.no_direct:
                targets.insert(0, Target("d", direct_port, "/v1/completions", completions))
            labels = [t.label for t in targets]
            for t in targets:
                ttft.setdefault(t.label, [])
            for i in range(a.warmup + a.rounds // a.epochs):
                order = targets[:]
                rng.shuffle(order)
                for t in order:
                    for _ in range(a.burst):
                        x = t.ask()
                        if i >= a.warmup:
                            ttft[t.label].append(x)
                        if a.gap_ms:
                            time.sleep(a.gap_ms / 1e3)
        finally:
            children.stop_all()
    wall = time.time() - t0
    _report(a, labels, ttft, wall)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "ttft_us": ttft, "load": os.getloadavg()}))


def _report(a: argparse.Namespace, labels: list[str], ttft: dict[str, list[float]], wall: float) -> None:
    size = a.rounds * a.burst // a.blocks
    p50 = {k: [statistics.median(v[b * size:(b + 1) * size]) for b in range(a.blocks)] for k, v in ttft.items()}
    print(f"c=1 {a.route}, {a.tokens} tokens, stand-in {a.token_delay * 1e3:g} ms/token, --mode {a.mode}, --workers {a.workers}: "
          f"{a.rounds} rounds x {len(labels)} targets x {a.burst} ({a.blocks} blocks of {size}), gap {a.gap_ms:g} ms, in {wall:.0f} s, "
          f"load {os.getloadavg()[0]:.2f}")
    print("\n| target | TTFT p50 µs (pooled) | p10 | p90 | block p50s: min, median, max |\n|---|---|---|---|---|")
    for label in labels:
        v = sorted(ttft[label])
        q = lambda p: v[min(len(v) - 1, int(p * len(v)))]  # noqa: E731
        print(f"| {label} | {statistics.median(v):.0f} | {q(0.1):.0f} | {q(0.9):.0f} | "
              f"{min(p50[label]):.0f}, {statistics.median(p50[label]):.0f}, {max(p50[label]):.0f} |")
    print("\n| pair | Δ TTFT p50 µs, mean over blocks | 95 % t interval | bootstrap | pooled Δ |\n|---|---|---|---|---|")
    pairs = [(x, y) for i, x in enumerate(labels) for y in labels[i + 1:]]
    for x, y in pairs:
        ci = mean_ci([b - c for b, c in zip(p50[y], p50[x])])
        pooled = statistics.median(ttft[y]) - statistics.median(ttft[x])
        print(f"| {y} − {x} | {ci['mean']:+.0f} | [{ci['lo']:+.0f}, {ci['hi']:+.0f}] | "
              f"[{ci['boot_lo']:+.0f}, {ci['boot_hi']:+.0f}] | {pooled:+.0f} |")


if __name__ == "__main__":
    main()
