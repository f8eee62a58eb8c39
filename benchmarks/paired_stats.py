#!/usr/bin/env python3
"""Paired per-round statistics of a ``benchmarks/loadgen.py --rounds N --baseline B`` JSON: for each
level and each other target, the rounds where both ran, compared round by round.

- **tok/s ratio** target / baseline: the geometric mean of the per-round ratios, with a 95 % percentile
  bootstrap interval (rounds resampled with replacement, 10,000 times, fixed seed);
- **TTFT p50 difference** target − baseline in ms: the mean of the per-round differences with its 95 %
  bootstrap interval, and their median;
- the same two split by which of the pair went first in the round (loadgen alternates: round r starts
  with target r), since a target that runs right after its own previous run may differ from one that
  follows the other (work its previous run left behind: a pending write, closing connections).

An interval that holds 1 (ratio) or 0 (difference) is "nothing measurable at this many rounds"; its
width is what the run can resolve. Pure Python (no numpy), so it runs wherever loadgen does.

    python benchmarks/paired_stats.py LOADGEN.json [--resamples 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Callable, Sequence


def bootstrap(values: Sequence[float], stat: Callable[[Sequence[float]], float], resamples: int, seed: int) -> tuple[float, float]:
    """95 % percentile bootstrap interval of ``stat`` over ``values`` (resampled with replacement)."""
    rng = random.Random(seed)
    n = len(values)
    stats = sorted(stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return stats[int(0.025 * (resamples - 1))], stats[int(0.975 * (resamples - 1))]


def geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def pairs(level: dict, target: str, baseline: str) -> list[dict]:
    """Per round where both ran: ``{"round", "ratio", "ttft_diff_ms", "first"}`` (``first``: the target
    that ran first in the round)."""
    by: dict[int, dict[str, dict]] = {}
    order: dict[int, list[str]] = {}
    for run in level["runs"]:
        by.setdefault(run["round"], {})[run["target"]] = run
        order.setdefault(run["round"], []).append(run["target"])
    out = []
    for r in sorted(by):
        a, b = by[r].get(target), by[r].get(baseline)
        if not a or not b or not a.get("output_tok_s") or not b.get("output_tok_s"):
            continue
        ta, tb = (a.get("ttft_ms") or {}).get("p50"), (b.get("ttft_ms") or {}).get("p50")
        out.append({"round": r, "ratio": a["output_tok_s"] / b["output_tok_s"],
                    "ttft_diff_ms": None if ta is None or tb is None else ta - tb,
                    "first": next(t for t in order[r] if t in (target, baseline))})
    return out


def describe(rows: list[dict], resamples: int, seed: int) -> str:
    """One line: the ratio and the TTFT difference with their intervals, over ``rows``."""
    if not rows:
        return "no paired rounds"
    ratios = [p["ratio"] for p in rows]
    text = f"{len(rows)} rounds: tok/s ratio {geomean(ratios):.3f}"
    if len(rows) > 1:
        lo, hi = bootstrap(ratios, geomean, resamples, seed)
        text += f" [{lo:.3f}, {hi:.3f}]"
    diffs = [p["ttft_diff_ms"] for p in rows if p["ttft_diff_ms"] is not None]
    if diffs:
        text += f"; TTFT p50 diff {statistics.fmean(diffs):+.1f} ms"
        if len(diffs) > 1:
            lo, hi = bootstrap(diffs, statistics.fmean, resamples, seed)
            text += f" [{lo:+.1f}, {hi:+.1f}]"
        text += f", median {statistics.median(diffs):+.1f} ms"
    return text


def report(data: dict, resamples: int = 10_000, seed: int = 0) -> list[str]:
    """The lines :func:`main` prints for a loadgen JSON ``data``."""
    baseline = data.get("baseline")
    lines = [f"paired per-round statistics vs {baseline} (geometric mean ratio, mean difference; 95 % bootstrap CI in brackets):"]
    if not baseline:
        return lines + ["  no --baseline: nothing to pair"]
    names = [t["name"] for t in data["targets"] if t["name"] != baseline]
    for level in data.get("levels", []):
        for name in names:
            rows = pairs(level, name, baseline)
            lines.append(f"  c={level['concurrency']} {name} / {baseline}: {describe(rows, resamples, seed)}")
            for first in (name, baseline):
                part = [p for p in rows if p["first"] == first]
                if part and len(part) < len(rows):
                    lines.append(f"    rounds {first} ran first: {describe(part, resamples, seed)}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="loadgen.py's --json output")
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    print("\n".join(report(data, args.resamples, args.seed)))


if __name__ == "__main__":
    main()
