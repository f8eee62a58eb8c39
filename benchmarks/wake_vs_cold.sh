#!/usr/bin/env bash
# Cold start vs wake-up through vllama on the GPU (issue 7): a request for a model whose
# keep_alive ended, with vLLM sleep mode (wake-up) and without (vLLM restarted).
# Prerequisites as benchmarks/gpu_run.sh (vLLM in /tmp/site, deps in /tmp/vsite, /tmp/model).
# Usage: OUT=dir benchmarks/wake_vs_cold.sh
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
URL=http://127.0.0.1:11434
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
state() { curl -s $URL/readyz | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null; }
wait_state() { for i in $(seq 1200); do [ "$(state)" = "$1" ] && return 0; sleep 0.25; done; log "never reached $1"; return 1; }
gen() {  # prints the wall seconds of one 16-token request
  curl -s -o /dev/null -w '%{time_total}' $URL/api/generate \
    -d '{"model":"qwen-random","prompt":"Once upon a time","stream":false,"options":{"num_predict":16,"ignore_eos":true}}'
}
gpu() { nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1; }
for mode in sleep nosleep; do
  extra=""; [ $mode = sleep ] && extra="--enable-sleep-mode"
  t0=$(date +%s.%N)
  setsid python3 -m vllama_proxy serve --model /tmp/model --served-model-name qwen-random --keep-alive 8s \
    --health-interval 1 --log-format json -- --max-model-len 4096 --gpu-memory-utilization 0.85 $extra \
    > "/tmp/wake-$mode.log" 2>&1 < /dev/null &
  pid=$!
  wait_state ready || { tail -30 "/tmp/wake-$mode.log"; exit 1; }
  log "[$mode] first load (cold start): $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s; GPU $(gpu)"
  log "[$mode] warm request: $(gen) s"
  for round in 1 2; do
    target=sleeping; [ $mode = nosleep ] && target=unloaded
    wait_state $target || exit 1
    log "[$mode] keep_alive ended -> $target; GPU $(gpu)"
    log "[$mode] request for the $target model: $(gen) s (round $round); state now $(state); GPU $(gpu)"
  done
  grep -o '"woke_up","seconds":[0-9.]*\|"seconds":[0-9.]*,"event":"woke_up"' "/tmp/wake-$mode.log" | head -3
  kill -TERM $pid; for i in $(seq 120); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  log "[$mode] stopped; GPU $(gpu)"
  gzip -c "/tmp/wake-$mode.log" > "$OUT/wake-$mode.log.gz"
done
