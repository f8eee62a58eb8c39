#!/usr/bin/env bash
# On the lent GPU: a model created from a Modelfile with `DRAFT ngram` (`PARAMETER draft_num_predict K`), which vllama
# turns into vLLM's --speculative-config for its base, against the same weights without it: output tokens/s of greedy
# chats of a repetitive prompt through vllama's /api/chat, alternating (benchmarks/draft_ngram.py --compare). From the
# repo root, after hop_cost.sh's `install setup` (its header: the wheels, .whl, the random model at /tmp/model), with
# the GPU free (hop_cost.sh stop first if its vllama runs).
#
#   check    numba and vLLM's n-gram proposer (vllm/v1/spec_decode/ngram_proposer.py jits with numba; the image has
#            numba 0.68, vLLM 0.26 pins 0.65): versions, the import and one jitted call
#   start    vllama serving two models of one set of weights, each on a vLLM of its own sharing the GPU
#            (DRAFT_SHARE 0.42 each): BASE (qwen-random, /tmp/model, port 8100) and COPY (qwen-copy, /tmp/model-copy:
#            symlinks to the same files, port 8102), on :PD (11435); VLLM_CACHE_ROOT as hop_cost.sh's start left it
#            ($LOGS/cache-b: the compile cache is warm for the plain model); seconds until each answers
#   measure  draft_ngram.py --compare BASE --model COPY: DRAFT_ROUNDS (12) alternating rounds of both plain (A/A),
#            then POST /api/create COPY-ngram (FROM COPY, DRAFT ngram, draft_num_predict DRAFT_K (4): COPY's vLLM
#            restarts with the speculative config), DRAFT_ROUNDS alternating rounds of BASE and COPY-ngram,
#            DRAFT_TOKENS (256) tokens each (ignore_eos), temperature 0; vLLM's spec-decode counters of COPY's vLLM;
#            the speculative_decoding line of vllama's log: draft.json, summary.txt
#   stop     SIGTERM vllama; GPU memory after
#
# One call after the burst (burst_gpu.sh's vllama stopped first):
#   OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh stop && OUT=$OUT benchmarks/draft_gpu.sh check start measure stop
# Dry run on the stand-in (no GPU): PATH=$PWD/tests/bin:$PATH FAKE_VLLM_PYTHON=$(command -v python3) MODEL=<a model dir>
#   VLLAMA_EXTRA=--no-gpu-check NO_GPU=1 DRAFT_TOKENS=8 DRAFT_ROUNDS=2 benchmarks/draft_gpu.sh start measure stop
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} MODEL=${MODEL:-/tmp/model}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state-draft
PD=${PD:-11435} D=http://127.0.0.1:${PD:-11435} BASE=qwen-random COPY=qwen-copy
SHARE=${DRAFT_SHARE:-0.42}
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
say() { tee -a "$OUT/summary.txt"; }
gpu() { [ -n "${NO_GPU:-}" ] && echo "-" || nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '; }

for phase in "$@"; do case $phase in
check)
  python3 - <<'PY' 2>&1 | say
import time
import numba, numpy
print(f"numba {numba.__version__}, numpy {numpy.__version__}")
from vllm.v1.spec_decode import ngram_proposer  # noqa: F401  (jits its lookup with numba)
from numba import njit
t = time.perf_counter()
f = njit(lambda a: a.sum())
print(f"vllm n-gram proposer imported; a jitted call: {f(numpy.arange(10))} in {time.perf_counter() - t:.2f} s")
PY
  ;;
start)
  rm -rf "$MODEL-copy" && mkdir -p "$MODEL-copy" && for f in "$MODEL"/*; do ln -s "$f" "$MODEL-copy/"; done
  models=$(python3 -c "import json, sys; m, s = sys.argv[1], float(sys.argv[2]); print(json.dumps([
    {'model': m, 'name': 'qwen-random', 'port': 8100, 'gpu_memory_utilization': s, 'max_model_len': 4096, 'keep_alive': '-1'},
    {'model': m + '-copy', 'name': 'qwen-copy', 'port': 8102, 'gpu_memory_utilization': s, 'max_model_len': 4096, 'keep_alive': '-1'}]))" "$MODEL" "$SHARE")
  log "draft start: vllama --models $models"
  date +%s.%N > $LOGS/d.t0
  VLLM_CACHE_ROOT=${DRAFT_CACHE:-$LOGS/cache-b} setsid python3 -m vllama_proxy serve --models "$models" --port $PD --keep-alive -1 \
    --log-format json --no-on-demand ${VLLAMA_EXTRA:-} > $LOGS/vllama-draft.log 2>&1 < /dev/null &
  echo $! > $LOGS/d.pid
  for m in $BASE $COPY; do
    s=$(python3 benchmarks/hop_report.py first $D ollama --model $m --timeout 590) || { log "draft start: $m did not answer"; tail -30 $LOGS/vllama-draft.log | cut -c1-300; exit 1; }
    log "draft start: $m answers, $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $(cat $LOGS/d.t0)}") s after launch (first token $s s)"
  done
  log "GPU memory used: $(gpu)"
  grep -aE '"(front_end|admission)"' $LOGS/vllama-draft.log | head -2 | cut -c1-400 | say
  ;;
measure)
  python3 benchmarks/draft_ngram.py --url $D --model $COPY --compare $BASE --tokens "${DRAFT_TOKENS:-256}" \
    --rounds "${DRAFT_ROUNDS:-12}" --k "${DRAFT_K:-4}" --vllm-url http://127.0.0.1:8102 --json "$OUT/draft.json" 2>&1 | say
  grep -a '"speculative_decoding"' $LOGS/vllama-draft.log | head -2 | cut -c1-400 | say
  grep -aoE 'speculative_config=SpeculativeConfig[^)]{0,240}' $LOGS/vllama-draft.log | head -2 | say
  grep -aE 'SpecDecoding metrics|Mean acceptance' $LOGS/vllama-draft.log | tail -3 | sed -E 's/^.*"line":"?//' | cut -c1-300 | say
  ;;
stop)
  if [ -f $LOGS/d.pid ]; then
    pid=$(cat $LOGS/d.pid); kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
    rm -f $LOGS/d.pid
  fi
  sleep 2; log "draft stop: GPU memory used: $(gpu)"
  gzip -c $LOGS/vllama-draft.log > "$OUT/vllama-draft.log.gz" 2>/dev/null
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac; done
