"""Pool token_cpu.py's paired blocks of runs and of their swapped twins (the builds' roles exchanged: old = the
branch, new = main) into branch/main per (c, route): the geometric mean of the block ratios and a 95 % bootstrap
interval (paired_stats.bootstrap), so that whatever favours one process slot cancels.

    python benchmarks/results/cpu-mwtoken14/pool.py main-vs-branch.json main-vs-branch-2.json --swapped branch-vs-main-swapped.json
"""
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from paired_stats import bootstrap, geomean  # noqa: E402

args = sys.argv[1:]
cut = args.index("--swapped") if "--swapped" in args else len(args)
cells = {}
for i, path in enumerate(args):
    if i == cut:
        continue
    for b in orjson.loads(Path(path).read_bytes())["blocks"]:
        ratio = b["new"]["us_per_token"] / b["old"]["us_per_token"]
        cells.setdefault((b["c"], b["route"]), []).append(ratio if i < cut else 1 / ratio)
print("| c | route | blocks | branch/main [95 % CI] |\n|---|---|---|---|")
for (c, route), ratios in cells.items():
    lo, hi = bootstrap(ratios, geomean, 10_000, 0)
    print(f"| {c} | {route} | {len(ratios)} | {geomean(ratios):.3f} [{lo:.3f}, {hi:.3f}] |")
