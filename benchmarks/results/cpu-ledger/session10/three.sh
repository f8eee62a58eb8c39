#!/usr/bin/env bash
# local diagnostic: ledger old (main) vs new vs off, one stand-in, alternating rounds
set -euo pipefail
cd /work/wt-ledger
OUT=${1:-/tmp/ledger-wt/three}
LEVEL=${LEVEL:-128} REQUESTS=${REQUESTS:-256} ROUNDS=${ROUNDS:-12}
PY=/work/wt-ledger/.venv/bin/python
mkdir -p "$OUT"; rm -rf "$OUT"/state-* "$OUT/model"
port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PF=$(port) PA=$(port) PB=$(port) PC=$(port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
PYTHONPATH=/work/wt-ledger $PY -c "import sys; sys.path.insert(0, 'tests'); from conftest import write_model_dir; from pathlib import Path; write_model_dir(Path('$OUT/model'))"
FAKE_VLLM_TOKEN_DELAY=0.05 $PY tests/fake_vllm.py serve "$OUT/model" --port "$PF" --served-model-name m --max-model-len 4096 > "$OUT/fake.log" 2>&1 & pids+=($!)
serve() { local code=$1 p=$2 state=$3; shift 3
  PYTHONPATH=$code VLLAMA_STATE_DIR=$state $PY -m vllama_proxy serve --upstream "http://127.0.0.1:$PF" --port "$p" --no-access-log --workers 1 "$@" > "$state.log" 2>&1 & pids+=($!); }
serve /tmp/ledger-wt/maincopy "$PA" "$OUT/state-old"
serve /work/wt-ledger "$PB" "$OUT/state-new"
serve /work/wt-ledger "$PC" "$OUT/state-off" --usage-db off
for p in $PF $PA $PB $PC; do for _ in $(seq 300); do curl -sf "http://127.0.0.1:$p/v1/models" > /dev/null && break; sleep 0.2; done; done
uptime | tee "$OUT/three.txt"
PYTHONPATH=/work/wt-ledger $PY benchmarks/loadgen.py --targets "old=ollama:http://127.0.0.1:$PA,new=ollama:http://127.0.0.1:$PB,off=ollama:http://127.0.0.1:$PC" --model m \
  --levels "$LEVEL" --requests-per-level "$REQUESTS" --rounds "$ROUNDS" --output-tokens 16 --prompt-words 64 \
  --baseline off --raise-nofile --warmup 32 --json "$OUT/three.json" 2>&1 | tee -a "$OUT/three.txt"
$PY benchmarks/paired_stats.py "$OUT/three.json" | tee -a "$OUT/three.txt"
uptime | tee -a "$OUT/three.txt"
