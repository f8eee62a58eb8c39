#!/usr/bin/env bash
# What the usage ledger (issue 39) costs the hot path: two `vllama serve --upstream` in front of one
# stand-in vLLM (tests/fake_vllm.py, FAKE_TOKEN_DELAY s per token), one with the ledger (its default:
# SQLite in its state directory, rows written every second or per 1,000) and one with --usage-db off;
# benchmarks/loadgen.py streams /api/generate to both at $LEVEL concurrent streams, alternating
# ($ROUNDS rounds, each target first in turn), and reports TTFT / ITL / throughput with the ratio
# on/off (the baseline), then the paired per-round statistics (benchmarks/paired_stats.py: the tok/s
# ratio's geometric mean and the TTFT p50 difference, each with its 95 % bootstrap interval, also split
# by which target went first). Afterwards it checks that the ledger holds one row per request answered.
#
#   benchmarks/ledger_cost.sh [OUT]      (default OUT: /tmp/ledger-cost; writes OUT/ledger.json and .txt)
#
# Knobs: LEVEL (1024), REQUESTS (2 x LEVEL per run), ROUNDS (4: on-off, off-on, ...), WARMUP (64 requests each),
# TOKENS (16 output tokens), COOLDOWN (0 s between runs; above --usage-flush-interval, a run never starts
# while the previous run's last rows are written),
# FAKE_TOKEN_DELAY (0.05 s), WORKERS (vllama's --workers; default: vllama's choice for the host),
# ON_FLAGS (more flags for the ledger-on server; ON_FLAGS="--usage-db off" is the A/A control: two
# identical servers, so its intervals are the noise floor and the order effect of this host).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/ledger-cost}
LEVEL=${LEVEL:-1024} REQUESTS=${REQUESTS:-$((2 * ${LEVEL:-1024}))} ROUNDS=${ROUNDS:-4} TOKENS=${TOKENS:-16} WARMUP=${WARMUP:-64} COOLDOWN=${COOLDOWN:-0}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
rm -rf "$OUT/state-on" "$OUT/state-off" "$OUT/model"
port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PF=$(port) PON=$(port) POFF=$(port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
$PY -c "import sys; sys.path.insert(0, 'tests'); from conftest import write_model_dir; from pathlib import Path; write_model_dir(Path('$OUT/model'))"
FAKE_VLLM_TOKEN_DELAY=${FAKE_TOKEN_DELAY:-0.05} $PY tests/fake_vllm.py serve "$OUT/model" --port "$PF" --served-model-name m \
  --max-model-len 4096 > "$OUT/fake.log" 2>&1 & pids+=($!)
serve() {  # $1 port, $2 state dir, more: flags
  local p=$1 state=$2; shift 2
  VLLAMA_STATE_DIR=$state $PY -m vllama_proxy serve --upstream "http://127.0.0.1:$PF" --port "$p" --no-access-log \
    ${WORKERS:+--workers $WORKERS} "$@" > "$state.log" 2>&1 & pids+=($!)
}
serve "$PON" "$OUT/state-on" ${ON_FLAGS:-}
serve "$POFF" "$OUT/state-off" --usage-db off
for p in $PF $PON $POFF; do
  for _ in $(seq 200); do curl -sf "http://127.0.0.1:$p/v1/models" > /dev/null && break; sleep 0.1; done
done
echo "$(date -u +%FT%TZ) $(nproc) CPUs, $(uname -srm); vllama $(git describe --always --dirty)" | tee "$OUT/ledger.txt"
$PY benchmarks/loadgen.py --targets "on=ollama:http://127.0.0.1:$PON,off=ollama:http://127.0.0.1:$POFF" --model m \
  --levels "$LEVEL" --requests-per-level "$REQUESTS" --rounds "$ROUNDS" --output-tokens "$TOKENS" --prompt-words 64 \
  --baseline off --raise-nofile --warmup "$WARMUP" --cooldown "$COOLDOWN" --json "$OUT/ledger.json" 2>&1 | tee -a "$OUT/ledger.txt"
$PY benchmarks/paired_stats.py "$OUT/ledger.json" | tee -a "$OUT/ledger.txt"
kill "${pids[1]}"; wait "${pids[1]}" 2>/dev/null || true  # a clean stop writes every row
[ -e "$OUT/state-on/usage.sqlite3" ] || { echo "ledger rows: none (ON_FLAGS=${ON_FLAGS:-}: no ledger)" | tee -a "$OUT/ledger.txt"; exit 0; }
rows=$($PY -c "import sqlite3; print(sqlite3.connect('$OUT/state-on/usage.sqlite3').execute('select count(*) from vllama_usage').fetchone()[0])")
echo "ledger rows: $rows (expected $((REQUESTS * ROUNDS + WARMUP)): the ledger-on target's measured and warm-up requests)" | tee -a "$OUT/ledger.txt"
