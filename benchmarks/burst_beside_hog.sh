#!/usr/bin/env bash
# The 5,000 burst beside a CPU hog: RUNS (3) runs in a row of `load_2000.py --clients CLIENTS (5000) --tokens 8
# --no-stream --workers 2 --procs 2` (non-streamed /api/generate through `vllama serve --upstream` over the stand-in
# vLLM, 50 ms a token), each with `stress-ng --cpu HOG (2)` started 2 s before it and stopped after it.
# CODE (default: this checkout) is the vllama tree measured: e.g. main's `git archive` unpacked beside this one with
# this benchmarks/ copied in. Results: OUT (default results/burst-hog-<date>)/run<i>.json and a line per run on stdout.
#   benchmarks/burst_beside_hog.sh
#   CODE=/tmp/main OUT=/tmp/before benchmarks/burst_beside_hog.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CODE=${CODE:-$(dirname "$HERE")}
RUNS=${RUNS:-3}
CLIENTS=${CLIENTS:-5000}
HOG=${HOG:-2}
OUT=${OUT:-$HERE/results/burst-hog-$(date -u +%Y%m%d-%H%M)}
PY=${PY:-$CODE/.venv/bin/python}
command -v stress-ng >/dev/null || { echo "stress-ng is not installed (apt-get install stress-ng)" >&2; exit 2; }
mkdir -p "$OUT"
hog=
trap '[ -n "$hog" ] && kill "$hog" 2>/dev/null || true' EXIT
for i in $(seq 1 "$RUNS"); do
  stress-ng --cpu "$HOG" --timeout 600s >/dev/null 2>&1 &
  hog=$!
  sleep 2
  load=$(cut -d' ' -f1 /proc/loadavg)
  (cd "$CODE" && PYTHONPATH="$CODE" "$PY" "$CODE/benchmarks/load_2000.py" --clients "$CLIENTS" --tokens 8 --no-stream \
      --workers 2 --procs 2 --timeout 300 --json "$OUT/run$i.json" >"$OUT/run$i.txt" 2>&1) || true
  kill "$hog" 2>/dev/null || true
  wait "$hog" 2>/dev/null || true
  hog=
  "$PY" - "$OUT/run$i.json" "$i" "$load" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
r = d["requests"]
kinds = ", ".join(f"{k} {v}" for k, v in sorted(d["kinds"].items()) if k != "ok") or "none"
print(f"run {sys.argv[2]}: {r['ok']}/{r['sent']} ok, errors: {kinds}; {d['wall_s']:.1f} s; load before {sys.argv[3]}; "
      f"listen overflows {d.get('listen_queue', {}).get('ListenOverflows', '?')}")
EOF
done
