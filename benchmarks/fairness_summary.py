"""The tables of ``benchmarks/fairness.sh``: ``python benchmarks/fairness_summary.py OUT``.

Reads ``r{N}-{off,on,small,l<N>}-{alone,flood}.json`` (``fairness.py``), ``r{N}-on-weights.json``
(``fair_weights.py``) and ``r{N}-on-diag.json`` (``fair_diag.py``) from OUT. Prints, per round and
as the median over rounds: the light key's TTFT p50/p90/p99 alone and under the flood with fair
share off, on, and on with a smaller ``--max-running`` (small), their ratios to alone, the heavy
key's tok/s on/off and small/off (issue 38's goals: on-flood p50 <= 1.5x and p99 <= 2x of alone,
heavy >= 0.95x); for the weights run each key's output-token share (the goal: within 10 %) and
service share against its weighted share, and the seconds until the late key had its share; and
the diagnostic's light requests straight to vLLM beside vLLM's own clock.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys


def main(out: str) -> None:
    runs: dict[int, dict[str, dict]] = {}
    for path in sorted(glob.glob(os.path.join(out, "r*-*.json"))):
        m = re.fullmatch(r"r(\d+)-(\w+-\w+)\.json", os.path.basename(path))
        if m:
            runs.setdefault(int(m.group(1)), {})[m.group(2)] = json.load(open(path))
    print("| round | run | light reqs | light TTFT p50 ms | p90 ms | p99 ms | heavy tok/s | errors (heavy / light) |")
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {}
    fixed = ("off-alone", "off-flood", "on-alone", "on-flood", "small-flood", "on-diagflood")
    for r, got in sorted(runs.items()):
        for name in (*fixed, *sorted(n for n in got if n not in fixed and n.endswith(("-alone", "-flood")))):
            s = got.get(name)
            if s is None:
                continue
            t = s["light_ttft_ms"]
            print(f"| {r} | {name} | {s['light_requests']} | {t['p50']} | {t['p90']} | {t['p99']} | {s['heavy_tok_s']} | "
                  f"{s['heavy_errors'] or 0} / {s['light_errors'] or 0} |")
        alone = got.get("on-alone") or got.get("off-alone")
        for mode in _modes(runs):
            flood = got.get(f"{mode}-flood")
            if alone and flood and alone["light_ttft_ms"]["p50"] and flood["light_ttft_ms"]["p50"]:
                for q in ("p50", "p99"):
                    ratios.setdefault(f"{mode} {q}/alone", []).append(flood["light_ttft_ms"][q] / alone["light_ttft_ms"][q])
        for mode in _modes(runs):
            if mode != "off" and got.get(f"{mode}-flood") and got.get("off-flood") and got["off-flood"]["heavy_tok_s"]:
                ratios.setdefault(f"heavy {mode}/off", []).append(got[f"{mode}-flood"]["heavy_tok_s"] / got["off-flood"]["heavy_tok_s"])
    print()
    for name, values in ratios.items():
        print(f"{name}: " + ", ".join(f"{v:.2f}x" for v in values) + f" (median {statistics.median(values):.2f}x)")
    pooled(runs)
    weights = {r: got[n] for r, got in sorted(runs.items()) for n in got if n.endswith("-weights")}
    if weights:
        print()
        print("| round | key | weight | prompt words / output tokens | want | output share (x want) | service share (x want) | output tok/s |")
        print("|---|---|---|---|---|---|---|---|")
        for r, w in weights.items():
            for key, k in w["keys"].items():
                print(f"| {r} | {key} | {k['weight']:g} | {k['prompt_words']} / {k['output_tokens']} | {k['want']} | "
                      f"{k['output_share']} ({k['output_vs_want']}x) | {k['service_share']} ({k['service_vs_want']}x) | {k['output_tok_s']} |")
            late = w.get("late")
            if late:
                print(f"| {r} | {late['key']} (late) | {late['weight']:g} | | {late['want']} | {late['output_share_after']} after it joined "
                      f"| {late['service_share_after']} | seconds to its share: {late['seconds_to_share']} |")
    diags = {r: got[n] for r, got in sorted(runs.items()) for n in got if n.endswith("-diag")}
    for r, d in diags.items():
        print(f"\nround {r}, {d['label']}: light requests straight to vLLM during the flood")
        for name, row in d["direct_to_vllm"].items():
            print(f"  {name}: " + json.dumps({k: v for k, v in row.items() if k != "requests"}))
        print("  vLLM's histograms over the window (every request, the flood's too):")
        for name, h in d["vllm_histograms_over_window"].items():
            print(f"    {name}: {json.dumps(h)}")
        print(f"  vLLM's gauges (each second): {json.dumps(d['vllm_gauges'])}")


def _modes(runs: dict[int, dict[str, dict]]) -> list[str]:
    """The modes with a flood run: off, on, small, then l<N> (``--fair-light-running N``) by N."""
    found = {n.rsplit("-", 1)[0] for got in runs.values() for n in got if n.endswith("-flood") and n != "on-diagflood"}
    order = [m for m in ("off", "on", "small") if m in found]
    return order + sorted(found - set(order), key=lambda m: (len(m), m))


def pooled(runs: dict[int, dict[str, dict]]) -> None:
    """Every round's light TTFTs together (one p99 of ~300 answers, not three of ~100) against the
    light key alone, pooled the same way, and the heavy key's tok/s over the rounds against off's:
    issue 38's goals, light p50 <= 1.5x and p99 <= 2x of alone, heavy >= 0.95x of off."""
    def ttfts(name: str) -> list[float]:
        return [t for got in runs.values() for t in got.get(name, {}).get("light_ttft_s", [])]

    alone = ttfts("on-alone") or ttfts("off-alone")
    if not alone:
        return
    a50, a99 = _q(alone, 50), _q(alone, 99)
    off = [got["off-flood"]["heavy_tok_s"] for got in runs.values() if "off-flood" in got]
    print(f"\npooled over rounds: light alone p50 {a50 * 1000:.1f} ms, p99 {a99 * 1000:.1f} ms ({len(alone)} requests)")
    print("| mode | light reqs | p50 ms (x alone) | p99 ms (x alone) | heavy tok/s mean (x off) | goals (p50 <= 1.5x, p99 <= 2x, heavy >= 0.95x) |")
    print("|---|---|---|---|---|---|")
    for mode in _modes(runs):
        got = ttfts(f"{mode}-flood")
        if not got:
            continue
        p50, p99 = _q(got, 50), _q(got, 99)
        heavy = [g[f"{mode}-flood"]["heavy_tok_s"] for g in runs.values() if f"{mode}-flood" in g]
        h = statistics.fmean(heavy)
        hx = h / statistics.fmean(off) if off and statistics.fmean(off) else None
        met = [p50 / a50 <= 1.5, p99 / a99 <= 2.0] + ([hx >= 0.95] if hx is not None and mode != "off" else [])
        print(f"| {mode} | {len(got)} | {p50 * 1000:.1f} ({p50 / a50:.2f}x) | {p99 * 1000:.1f} ({p99 / a99:.2f}x) | "
              f"{h:,.0f}" + (f" ({hx:.2f}x)" if hx is not None and mode != "off" else "") + f" | {'met' if all(met) else 'not met'} |")


def _q(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


if __name__ == "__main__":
    main(sys.argv[1])
