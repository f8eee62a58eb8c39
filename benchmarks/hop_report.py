#!/usr/bin/env python3
"""Helpers of ``benchmarks/hop_cost.sh`` (issue 28): per-round ratios, vllama's stage timings,
the batch file, the first answer of a starting server.

Usage:
  hop_report.py rounds RUN.json                 per level and round: tok/s of each target, the ratio to
                                                the baseline, TTFT / ITL p50 deltas (ms); then the pooled ones,
                                                and the median of the per-round ratios and deltas
  hop_report.py split RUN.json                  c=1 with targets d (vLLM direct), r (bare relay), p (vllama /v1
                                                pass-through), g (vllama /api/generate), v (vLLM direct with
                                                vllama's upstream body): TTFT / ITL p50 per target and round,
                                                deltas vs d, and the steps r-d (the hop), p-r (vllama's
                                                pass-through beyond a bare relay), g-p (the translation), v-d
                                                (vllama's body at vLLM); per round, median and pooled
  hop_report.py ci RUN.json [--boot 10000]      per level and target: the throughput ratio to the baseline over
                                                paired blocks (loadgen's rounds) with 95 % confidence intervals
                                                (Student's t over the blocks and a bootstrap), whether it tells
                                                0.97 from 1.0, the TTFT / ITL p50 deltas with their intervals,
                                                and how many blocks of this spread would resolve ±1.5 %
  hop_report.py merge OUT.json RUN.json...       one loadgen JSON holding the levels of several runs
  hop_report.py metrics URL FILE                save vllama's /metrics text to FILE
  hop_report.py stages BEFORE AFTER [LABEL]     vllama_request_stage_seconds between two /metrics files:
                                                per stage requests, mean, p50 and p90 (ms, p from the buckets);
                                                one JSON line (label, stages) after the table
  hop_report.py prompts N FILE [--words 128] [--tokens 128] [--model M] [--url /v1/completions] [--seed 28]
                                                an OpenAI-batch JSONL of N prompts as loadgen makes them
                                                (random common words, ignore_eos, temperature 0)
  hop_report.py first URL KIND [--timeout S]    wait until a server answers one generated token (KIND:
                                                ollama -> /api/generate, openai -> /v1/completions), asking
                                                every 0.25 s; prints the seconds it took
  hop_report.py startlog LOG T0                 a starting server's milestones (vLLM's log lines: args,
                                                engine init, weights, compile, graphs, API up) in seconds
                                                after T0 (epoch seconds of the launch; vLLM logs local time)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

STAGES = ("handler", "parsed", "upstream_headers", "first_upstream_data", "first_client_write")
_LINE = re.compile(r'^vllama_request_stage_seconds_(bucket|count|sum)\{(.*)\} (\S+)$')


def rounds(path: str) -> None:
    data = json.loads(Path(path).read_text())
    base = data.get("baseline")
    print("| c | round | target | tok/s | baseline tok/s | ratio | TTFT p50 ms | Δ | ITL p50 ms | Δ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lv in data.get("levels", []):
        by_round: dict[int, dict[str, dict]] = {}
        for run in lv["runs"]:
            by_round.setdefault(run["round"], {})[run["target"]] = run
        if len(by_round) > 8:  # many short rounds (targets interleaved a few requests at a time): 6 blocks of rounds
            by_round = _blocks(by_round, 6)
        for r, runs in sorted(by_round.items()):
            b = runs.get(base)
            for name, s in runs.items():
                if name == base or b is None:
                    continue
                ratio = s["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else float("nan")
                dt = _d(s["ttft_ms"]["p50"], b["ttft_ms"]["p50"])
                di = _d(s["itl_ms"]["p50"], b["itl_ms"]["p50"])
                print(f"| {lv['concurrency']} | {r} | {name} | {s['output_tok_s']:.0f} | {b['output_tok_s']:.0f} | {ratio:.3f} | "
                      f"{s['ttft_ms']['p50']} | {dt} | {s['itl_ms']['p50']} | {di} |")
        for name, x in lv["ratios"].items():
            print(f"| {lv['concurrency']} | pooled | {name} | {lv['summary'][name]['output_tok_s']:.0f} | "
                  f"{lv['summary'][base]['output_tok_s']:.0f} | {x['tok_s_ratio']} | {lv['summary'][name]['ttft_ms']['p50']} | "
                  f"{x['ttft_p50_delta_ms']} | {lv['summary'][name]['itl_ms']['p50']} | {x['itl_p50_delta_ms']} |")
            per = [(runs[name], runs[base]) for _, runs in sorted(by_round.items()) if name in runs and base in runs]
            ratios = [s["output_tok_s"] / b["output_tok_s"] for s, b in per if b["output_tok_s"]]
            dts = [s["ttft_ms"]["p50"] - b["ttft_ms"]["p50"] for s, b in per if s["ttft_ms"]["p50"] is not None and b["ttft_ms"]["p50"] is not None]
            dis = [s["itl_ms"]["p50"] - b["itl_ms"]["p50"] for s, b in per if s["itl_ms"]["p50"] is not None and b["itl_ms"]["p50"] is not None]
            print(f"| {lv['concurrency']} | median of {len(per)} rounds | {name} | | | {_med(ratios, '.3f')} "
                  f"(min {_fmt(min(ratios, default=None), '.3f')}, max {_fmt(max(ratios, default=None), '.3f')}) | | "
                  f"{_med(dts, '+.3f')} | | {_med(dis, '+.3f')} |")


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (two-sided 95 %: ``p`` 0.975): exact for 1 and 2 degrees of freedom, else the
    Cornish-Fisher expansion around the normal quantile (0.004 under the tables' 3.182 at 3, within
    0.001 of them from 5 on)."""
    import math

    if df < 1:
        return float("nan")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def mean_ci(xs: list[float], boot: int = 10000, seed: int = 42) -> dict[str, float | int | None]:
    """Mean of paired per-block differences ``xs`` with its 95 % confidence interval, two ways: Student's
    t over the blocks (``lo``/``hi``) and a percentile bootstrap of the mean (``boot_lo``/``boot_hi``,
    ``boot`` resamples, seeded: the same file prints the same interval). ``sd``: the blocks' standard
    deviation; ``n``: blocks."""
    import random

    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "lo": None, "hi": None, "boot_lo": None, "boot_hi": None}
    m = statistics.fmean(xs)
    if n == 1:
        return {"n": 1, "mean": m, "sd": None, "lo": None, "hi": None, "boot_lo": None, "boot_hi": None}
    sd = statistics.stdev(xs)
    half = t_quantile(0.975, n - 1) * sd / n**0.5
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=n)) for _ in range(boot))
    return {"n": n, "mean": m, "sd": sd, "lo": m - half, "hi": m + half,
            "boot_lo": means[int(0.025 * (boot - 1))], "boot_hi": means[int(0.975 * (boot - 1))]}


#: The goal of issue 42 (>= 0.97x its own vLLM) and the half-width an interval needs to tell 0.97 from 1.0.
GOAL_RATIO = 0.97
RESOLVE_HALF_WIDTH = 0.015


def ratio_ci(path: str, boot: int = 10000) -> list[dict]:
    """Per level and target: the throughput ratio to the baseline over paired blocks (rounds of one
    loadgen run: each block runs every target once, back to back) with its 95 % interval, and the TTFT and
    ITL p50 deltas (ms) with theirs.

    The ratio is the geometric mean of the blocks' ratios (the mean of log ratios, so ``a/b`` and ``b/a``
    are symmetric); its interval is the log interval mapped back. A block pairs runs that ran seconds apart,
    so drift between blocks (vLLM's own, the host's) cancels in the pair and the interval measures what is
    left. ``blocks_for_resolve``: how many blocks of this spread give a half-width of
    ``RESOLVE_HALF_WIDTH`` (1.5 %, enough to tell 0.97 from 1.0)."""
    import math

    data = json.loads(Path(path).read_text())
    base = data.get("baseline")
    out = []
    for lv in data.get("levels", []):
        by_round: dict[int, dict[str, dict]] = {}
        for run in lv["runs"]:
            by_round.setdefault(run["round"], {})[run["target"]] = run
        names = [n for n in lv["summary"] if n != base]
        for name in names:
            pairs = [(runs[name], runs[base]) for _, runs in sorted(by_round.items()) if name in runs and base in runs]
            logs = [math.log(s["output_tok_s"] / b["output_tok_s"]) for s, b in pairs
                    if s["output_tok_s"] and b["output_tok_s"]]
            r = mean_ci(logs, boot)
            row: dict = {"concurrency": lv["concurrency"], "target": name, "baseline": base, "blocks": r["n"]}
            ex = (lambda v: None if v is None else math.exp(v))
            row.update(ratio=ex(r["mean"]), lo=ex(r["lo"]), hi=ex(r["hi"]), boot_lo=ex(r["boot_lo"]), boot_hi=ex(r["boot_hi"]))
            row["blocks_for_resolve"] = (math.ceil((1.96 * r["sd"] / math.log(1 + RESOLVE_HALF_WIDTH)) ** 2)
                                         if r["sd"] else None)
            for metric, key in (("ttft_ms", "ttft_p50_delta_ms"), ("itl_ms", "itl_p50_delta_ms")):
                d = mean_ci([s[metric]["p50"] - b[metric]["p50"] for s, b in pairs
                             if s[metric]["p50"] is not None and b[metric]["p50"] is not None], boot)
                row[key] = {k: d[k] for k in ("mean", "lo", "hi")}
            row["verdict"] = verdict(row["lo"], row["hi"])
            out.append(row)
    return out


def verdict(lo: float | None, hi: float | None) -> str:
    """What a ratio's 95 % interval says about the goal (>= ``GOAL_RATIO``) and about parity (1.0)."""
    if lo is None or hi is None:
        return "too few blocks"
    if lo >= 1.0:
        return "faster than the baseline"
    if lo >= GOAL_RATIO:
        return f">= {GOAL_RATIO} (goal met)" + (", not told from 1.0" if hi >= 1.0 else ", below 1.0")
    if hi < GOAL_RATIO:
        return f"< {GOAL_RATIO} (goal missed)"
    return f"not resolved: the interval holds {GOAL_RATIO}" + (" and 1.0" if hi >= 1.0 else "")


def ci(path: str, boot: int = 10000) -> None:
    """Print :func:`ratio_ci`'s table, then one JSON line per row."""
    rows = ratio_ci(path, boot)
    f = (lambda v, spec: "-" if v is None else format(v, spec))
    print("throughput ratio to the baseline over paired blocks, 95 % confidence intervals "
          f"(t over blocks; bootstrap of {boot} resamples); TTFT / ITL p50 Δ ms, mean of blocks [t interval]")
    print("| c | target | blocks | ratio | 95 % CI (t) | 95 % CI (bootstrap) | verdict | TTFT p50 Δ | ITL p50 Δ "
          f"| blocks for ±{RESOLVE_HALF_WIDTH:.1%} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = (lambda x: f"{f(x['mean'], '+.3f')} [{f(x['lo'], '+.3f')}, {f(x['hi'], '+.3f')}]")
        print(f"| {r['concurrency']} | {r['target']} | {r['blocks']} | {f(r['ratio'], '.4f')} | "
              f"{f(r['lo'], '.4f')} – {f(r['hi'], '.4f')} | {f(r['boot_lo'], '.4f')} – {f(r['boot_hi'], '.4f')} | "
              f"{r['verdict']} | {d(r['ttft_p50_delta_ms'])} | {d(r['itl_p50_delta_ms'])} | {f(r['blocks_for_resolve'], 'd')} |")
    for r in rows:
        print(json.dumps({"ci": r}))


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _med(xs: list[float], spec: str) -> str:
    return _fmt(statistics.median(xs) if xs else None, spec)


#: c1split's steps: (label, minuend target, subtrahend target).
SPLIT_STEPS = (("hop (r-d): relay process + loopback", "r", "d"),
               ("vllama /v1 beyond a bare relay (p-r)", "p", "r"),
               ("translation (g-p): /api/generate vs /v1 pass-through", "g", "p"),
               ("vllama's body at vLLM (v-d)", "v", "d"),
               ("total (g-d)", "g", "d"))


def split(path: str) -> None:
    """c1split's table: per round and pooled TTFT / ITL p50 per target, deltas vs d, and the steps."""
    data = json.loads(Path(path).read_text())
    for lv in data.get("levels", []):
        by_round: dict[int, dict[str, dict]] = {}
        for run in lv["runs"]:
            by_round.setdefault(run["round"], {})[run["target"]] = run
        if len(by_round) > 8:  # many short rounds (targets interleaved a few requests at a time): 6 blocks of rounds
            by_round = _blocks(by_round, 6)
        names = [t for t in ("d", "r", "p", "g", "v") if t in lv["summary"]] + [t for t in lv["summary"] if t not in "drpgv"]
        for metric in ("ttft_ms", "itl_ms"):
            print(f"c={lv['concurrency']}: {metric[:-3].upper()} p50 (ms) per round; Δ vs d in brackets")
            print("| round | " + " | ".join(names) + " |")
            print("|---|" + "---|" * len(names))
            rows = [(str(r), runs) for r, runs in sorted(by_round.items())] + [("pooled", lv["summary"])]
            for label, runs in rows:
                d = runs.get("d", {}).get(metric, {}).get("p50")
                cells = []
                for n in names:
                    v = runs.get(n, {}).get(metric, {}).get("p50")
                    cells.append("-" if v is None else (f"{v:.3f}" if n == "d" or d is None else f"{v:.3f} ({v - d:+.3f})"))
                print(f"| {label} | " + " | ".join(cells) + " |")
            print(f"steps of {metric[:-3].upper()} p50 (ms): per round, median of rounds, pooled")
            print("| step | per round | median | pooled |")
            print("|---|---|---|---|")
            for label, a, b in SPLIT_STEPS:
                per = [runs[a][metric]["p50"] - runs[b][metric]["p50"] for _, runs in sorted(by_round.items())
                       if a in runs and b in runs and runs[a][metric]["p50"] is not None and runs[b][metric]["p50"] is not None]
                if not per:
                    continue
                sa, sb = lv["summary"][a][metric]["p50"], lv["summary"][b][metric]["p50"]
                pooled = "-" if sa is None or sb is None else f"{sa - sb:+.3f}"
                print(f"| {label} | {', '.join(f'{x:+.3f}' for x in per)} | {statistics.median(per):+.3f} | {pooled} |")


def _blocks(by_round: dict[int, dict[str, dict]], k: int) -> dict[int, dict[str, dict]]:
    """Consecutive rounds merged into ``k`` blocks; a block's p50 is the median of its rounds' p50s, its
    output tok/s the mean of its rounds'."""
    rounds = sorted(by_round)
    out: dict[int, dict[str, dict]] = {}
    for b in range(k):
        part = rounds[b * len(rounds) // k:(b + 1) * len(rounds) // k]
        merged: dict[str, dict] = {}
        for name in {n for r in part for n in by_round[r]}:
            merged[name] = {m: {"p50": statistics.median(v)} if (v := [by_round[r][name][m]["p50"] for r in part
                            if name in by_round[r] and by_round[r][name][m]["p50"] is not None]) else {"p50": None}
                            for m in ("ttft_ms", "itl_ms")}
            merged[name]["output_tok_s"] = statistics.mean(by_round[r][name]["output_tok_s"] for r in part if name in by_round[r])
        out[b] = merged
    return out


def _d(a, b) -> str:
    return "-" if a is None or b is None else f"{a - b:+.3f}"


def save_metrics(url: str, out: str) -> None:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as r:
        Path(out).write_bytes(r.read())


def _parse(path: str) -> dict[str, dict]:
    """stage -> {"count", "sum", "buckets": {le: cumulative count}}."""
    out: dict[str, dict] = {s: {"count": 0.0, "sum": 0.0, "buckets": {}} for s in STAGES}
    for line in Path(path).read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        kind, labels, value = m.groups()
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        st = out.setdefault(lab.get("stage", "?"), {"count": 0.0, "sum": 0.0, "buckets": {}})
        if kind == "bucket":
            le = float("inf") if lab["le"] == "+Inf" else float(lab["le"])
            st["buckets"][le] = st["buckets"].get(le, 0.0) + float(value)
        else:
            st[kind] += float(value)
    return out


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket holding the q-th request."""
    items = sorted(buckets.items())
    total = items[-1][1] if items else 0
    if total <= 0:
        return None
    rank, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in items:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 0)
        prev_le, prev_n = le, n
    return None


def stages(before: str, after: str, label: str = "") -> None:
    a, b = _parse(before), _parse(after)
    rows = {}
    print(f"vllama stage timings{' ' + label if label else ''} (ms from accepted; per request)")
    print("| stage | requests | mean | p50 | p90 |")
    print("|---|---|---|---|---|")
    for s in STAGES:
        n = b[s]["count"] - a[s]["count"]
        tot = b[s]["sum"] - a[s]["sum"]
        bk = {le: v - a[s]["buckets"].get(le, 0.0) for le, v in b[s]["buckets"].items()}
        p50, p90 = _quantile(bk, 0.5), _quantile(bk, 0.9)
        rows[s] = {"requests": int(n), "mean_ms": round(tot / n * 1000, 3) if n else None,
                   "p50_ms": round(p50 * 1000, 3) if p50 is not None else None,
                   "p90_ms": round(p90 * 1000, 3) if p90 is not None else None}
        r = rows[s]
        print(f"| {s} | {r['requests']} | {r['mean_ms']} | {r['p50_ms']} | {r['p90_ms']} |")
    print(json.dumps({"label": label, "stages": rows}))


def prompts(n: int, path: str, words: int, tokens: int, model: str, url: str, seed: int = 28) -> None:
    """An OpenAI-batch JSONL of ``n`` prompts; another ``seed`` gives other prompts (no prefix-cache hits
    between files)."""
    from loadgen import PromptFactory

    make = PromptFactory(words, seed=seed)
    with open(path, "w") as f:
        for i in range(n):
            p = make()
            if url == "/api/generate":
                body = {"model": model, "prompt": p, "raw": True,
                        "options": {"num_predict": tokens, "ignore_eos": True, "temperature": 0}}
            else:
                body = {"model": model, "prompt": p, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": url, "body": body}) + "\n")


def first(url: str, kind: str, model: str, timeout: float) -> None:
    """Seconds until one generated token comes back (connection refused / 503 while loading: ask again)."""
    t0 = time.monotonic()
    if kind == "ollama":
        req = ("/api/generate", {"model": model, "prompt": "Once upon a time", "raw": True, "stream": False,
                                 "options": {"num_predict": 1, "temperature": 0}})
    else:
        req = ("/v1/completions", {"model": model, "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0})
    last = ""
    while time.monotonic() - t0 < timeout:
        try:
            r = urllib.request.Request(url.rstrip("/") + req[0], data=json.dumps(req[1]).encode(),
                                       headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(r, timeout=timeout) as resp:
                resp.read()
                print(f"{time.monotonic() - t0:.2f}")
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            last = str(e)[:120]
        time.sleep(0.25)
    print(f"timeout after {timeout:.0f} s ({last})")
    raise SystemExit(1)


#: vLLM's start, in the order it happens: (label, what its first log line matching says).
MILESTONES = (("vLLM args logged", r"non-default args"),
              ("model config resolved", r"Resolved architecture"),
              ("engine core init begins", r"Initializing a V1 LLM engine"),
              ("weights loaded", r"Loading weights took|Model loading took"),
              ("torch.compile done", r"torch\.compile takes|Directly load the compiled graph"),
              ("CUDA graphs captured", r"Graph capturing finished"),
              ("engine ready", r"init engine .* took"),
              ("API server up", r"Starting vLLM API server|Application startup complete|Available routes are"))
_STAMP = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")


def startlog(log: str, t0: float) -> None:
    """Seconds after ``t0`` of each milestone's first log line (vLLM's stamps: local time, whole seconds)."""
    year = time.localtime(t0).tm_year
    text = Path(log).read_text(errors="replace").splitlines()
    out = []
    for label, pat in MILESTONES:
        rx = re.compile(pat)
        for line in text:
            m = _STAMP.search(line) if rx.search(line) else None
            if m:
                mo, d, h, mi, sec = map(int, m.groups())
                t = time.mktime((year, mo, d, h, mi, sec, 0, 0, -1))
                out.append(f"{label} +{t - int(t0):.0f} s")
                break
    print("; ".join(out) if out else "no vLLM milestones in " + log)


def main(argv: list[str]) -> None:
    cmd, *rest = argv
    opts = {k.lstrip("-"): v for k, v in zip(rest[::2], rest[1::2]) if k.startswith("--")}
    pos = [x for i, x in enumerate(rest) if not x.startswith("--") and (i == 0 or not rest[i - 1].startswith("--"))]
    if cmd == "rounds":
        rounds(pos[0])
    elif cmd == "split":
        split(pos[0])
    elif cmd == "ci":
        ci(pos[0], int(opts.get("boot", 10000)))
    elif cmd == "startlog":
        startlog(pos[0], float(pos[1]))
    elif cmd == "merge":
        runs = [json.loads(Path(p).read_text()) for p in pos[1:]]
        merged = {**runs[0], "levels": sorted((lv for r in runs for lv in r.get("levels", [])), key=lambda lv: lv["concurrency"]),
                  "table": "\n\n".join(r.get("table", "") for r in runs)}
        Path(pos[0]).write_text(json.dumps(merged, indent=1))
    elif cmd == "metrics":
        save_metrics(pos[0], pos[1])
    elif cmd == "stages":
        stages(pos[0], pos[1], pos[2] if len(pos) > 2 else "")
    elif cmd == "prompts":
        prompts(int(pos[0]), pos[1], int(opts.get("words", 128)), int(opts.get("tokens", 128)),
                opts.get("model", "qwen-random"), opts.get("url", "/v1/completions"), int(opts.get("seed", 28)))
    elif cmd == "first":
        first(pos[0], pos[1], opts.get("model", "qwen-random"), float(opts.get("timeout", 600)))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
