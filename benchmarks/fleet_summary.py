"""Summarize `benchmarks/fleet.sh rounds`: each router configuration over its rounds, against round robin.

Usage: ``python3 benchmarks/fleet_summary.py DIR`` where DIR holds the loadgen JSON files
``CONFIG-rROUND.json`` that ``fleet.sh run_config`` wrote (``--conversations`` runs). Prints a
Markdown table, one row per configuration, in the order of first appearance:

- the cluster prefix-cache hit rate pooled over the rounds (sum of both engines' hit tokens over the
  sum of their queried tokens) and its ratio to round robin's, with the lowest and highest round;
- TTFT p50/p90 (ms) pooled over every turn of every round (the ``ttft_s`` of each run's timeline),
  and the per-round p50s, with how many rounds beat round robin's p50 of the same round;
- output tok/s (median over rounds), turns answered, and the turns per engine (summed).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

# loadgen's own percentile (linear, numpy's default): the same p50 as its per-run tables
from loadgen import percentile


def load(folder: Path) -> dict[str, dict[int, dict]]:
    """{config: {round: the run's first result}} from ``CONFIG-rROUND.json`` files."""
    runs: dict[str, dict[int, dict]] = {}
    for f in sorted(folder.glob("*-r*.json"), key=lambda p: p.stat().st_mtime):
        m = re.fullmatch(r"(.+)-r(\d+)\.json", f.name)
        if m:
            # fleet.sh writes CONFIG's "+" as "." in file names
            runs.setdefault(m[1].replace(".", "+"), {})[int(m[2])] = json.loads(f.read_text())["runs"][0]
    return runs


def pooled(values: list[float], q: float) -> str:
    """The ``q`` percentile of ``values`` (ms), formatted; ``n/a`` when empty."""
    p = percentile(sorted(values), q)
    return "n/a" if p is None else f"{p:.1f}"


def summarize(runs: dict[str, dict[int, dict]]) -> list[str]:
    """The Markdown lines (table and notes)."""
    base = runs.get("round_robin", {})

    def pooled_rate(rs: dict[int, dict]) -> float | None:
        q = sum((r.get("cache") or {}).get("queries") or 0 for r in rs.values())
        h = sum((r.get("cache") or {}).get("hits") or 0 for r in rs.values())
        return h / q if q else None

    def p50(r: dict) -> float:
        return r["ttft_ms"]["p50"]

    base_rate = pooled_rate(base)
    header = ("| configuration | rounds | turns ok | cluster hit rate (pooled; min-max) | vs round robin | "
              "TTFT p50 / p90 pooled (ms) | TTFT p50 per round (ms) | rounds p50 < round robin's | output tok/s (median) | turns per engine |")
    out = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        rate = pooled_rate(rs)
        per_round = [(r.get("cache") or {}).get("cluster_hit_rate") for r in rs.values()]
        per_round = [x for x in per_round if x is not None]
        ttfts = [t[5] * 1000 for r in rs.values() for t in r["timeline"] if len(t) > 5 and t[5] is not None]
        engines: list[float] = []
        for r in rs.values():
            for i, e in enumerate((r.get("cache") or {}).get("engines", [])):
                engines[i:i + 1] = [(engines[i] if i < len(engines) else 0) + e.get("requests", 0)]
        beats = [p50(r) < p50(base[k]) for k, r in rs.items() if k in base] if name != "round_robin" else []
        out.append(
            f"| {name} | {len(rs)} | {sum(r['ok'] for r in rs.values())}/{sum(r['requests'] for r in rs.values())} | "
            + (f"{rate:.4f} ({min(per_round):.3f}-{max(per_round):.3f})" if rate is not None and per_round else "n/a")
            + " | " + (f"{rate / base_rate:.2f}x" if rate and base_rate else "")
            + f" | {pooled(ttfts, 50)} / {pooled(ttfts, 90)} | "
            + ", ".join(f"{p50(r):.1f}" for _, r in sorted(rs.items()))
            + " | " + (f"{sum(beats)}/{len(beats)}" if beats else "")
            + f" | {statistics.median(r['output_tok_s'] for r in rs.values()):,.0f} | "
            + " / ".join(f"{x:.0f}" for x in engines) + " |")
    out.append("")
    out.append("(pooled: over every turn of every round of that configuration; per round: loadgen's p50 of that run; "
               "configurations: POLICY[+system: the front's --session-key system][+balanced: cache_aware with lower "
               "balance thresholds], see benchmarks/fleet.sh)")
    return out


def main() -> None:
    runs = load(Path(sys.argv[1]))
    if not runs:
        sys.exit(f"no CONFIG-rROUND.json in {sys.argv[1]}")
    print("\n".join(summarize(runs)))


if __name__ == "__main__":
    main()
