#!/usr/bin/env python3
"""Plot a loadgen (or cpu_bench) JSON file: output tokens/s and TTFT p50 vs concurrency, one line per target.

    python benchmarks/plot.py results.json [-o results.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(data: dict, target: str, key: str, sub: str | None = None) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for lv in data.get("levels", []):
        s = lv["summary"].get(target)
        if s is None:
            continue
        v = s[key][sub] if sub else s[key]
        if v is not None:
            xs.append(lv["concurrency"])
            ys.append(v)
    return xs, ys


def plot(data: dict, out: Path) -> None:
    if not data.get("levels"):
        raise SystemExit("no levels in this file (a --burst run has nothing to plot)")
    targets = list(data["levels"][0]["summary"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for t in targets:
        proto = data["levels"][0]["summary"][t].get("protocol", "")
        label = f"{t} ({proto})" if proto else t
        ax1.plot(*series(data, t, "output_tok_s"), marker="o", label=label)
        ax2.plot(*series(data, t, "ttft_ms", "p50"), marker="o", label=label)
    for ax, title, ylabel in ((ax1, "Output throughput", "output tokens/s"),
                              (ax2, "Time to first token (p50)", "TTFT p50 (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        levels = [lv["concurrency"] for lv in data["levels"]]
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend()
    wl = data.get("workload", {})
    model = wl.get("model", "?")
    fig.suptitle(f"{data.get('benchmark', 'loadgen')}: {model}, {wl.get('prompt_words', '?')} prompt words, "
                 f"{wl.get('output_tokens', '?')} output tokens — {data.get('hostname', '?')}, {data.get('date', '')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, help="loadgen.py --json or cpu_bench.py --json output")
    p.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: the JSON path with .png)")
    args = p.parse_args(argv)
    data = json.loads(args.json.read_text())
    out = args.output or args.json.with_suffix(".png")
    plot(data, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
