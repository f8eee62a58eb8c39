#!/usr/bin/env bash
# The GPU run of issue 4 on the lent H200 (device tool), from the repo root, in phases so
# that one vLLM serves several device calls (servers are started with setsid and outlive
# the call that started them while the machine stays warm).
#
# Prerequisites on the device (benchmarks/README.md "GPU run"): vLLM in /tmp/site
# (shared/device/install-vllm.sh), vllama's missing deps in /tmp/vsite, the random-weight
# model in /tmp/model (shared/device/make_random_model.py).
#
#   start   vllama serve --model /tmp/model --workers $WORKERS [-- ... $VLLM_EXTRA] (the supervisor launching the real
#           `vllm serve` on :8100, Ollama API on :11434) and a one-process proxy of the same vLLM
#           (vllama serve --upstream, :11435); waits until ready
#   e2e     transcript with the real ollama client (benchmarks/e2e_ollama.py) + /api/ps
#   disconnect  64 long generations, clients leave: time until vLLM shows 0 running
#   sweep   LEVELS, targets alternating (TARGETS; default proxy (N workers), proxy1 (1 process), direct)
#   burst   BURST requests at once through the proxy and direct
#   bench   `vllm bench serve` against the proxy's /v1 and against vLLM directly
#   stop    SIGTERM both: drain, stop vLLM's group; GPU memory must read 0
#
# Usage: OUT=dir benchmarks/gpu_run.sh start e2e sweep ...
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=/tmp/gpu-logs  # server logs outlive a call's $OUT; `stop` copies them
mkdir -p "$OUT" $LOGS
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
PROXY=http://127.0.0.1:11434 PROXY1=http://127.0.0.1:11435 DIRECT=http://127.0.0.1:8100 SERVED=qwen-random
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
wait_ready() {  # url pid-file seconds
  local t0; t0=$(date +%s.%N)
  until curl -sf "$1/readyz" > /dev/null; do
    if ! kill -0 "$(cat "$2")" 2>/dev/null; then log "$1: vllama exited"; return 1; fi
    if awk "BEGIN{exit !($(date +%s.%N) - $t0 > $3)}"; then log "$1 not ready after $3 s: $(curl -s "$1/readyz")"; return 1; fi
    sleep 0.5
  done
  log "$1 ready after $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s: $(curl -s "$1/readyz")"
}
loadgen() { python3 benchmarks/loadgen.py --model $SERVED --output-tokens 128 --prompt-words 128 --raise-nofile --procs "${PROCS:-4}" "$@"; }

for phase in "$@"; do case $phase in
start)
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null), GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader)"
  setsid python3 -m vllama_proxy serve --model /tmp/model --served-model-name $SERVED \
    --alias qwen2.5:1.5b=$SERVED --vllm-port 8100 --port 11434 --workers "${WORKERS:-4}" --log-format json --keep-alive -1 \
    -- --max-model-len 4096 --gpu-memory-utilization 0.85 ${VLLM_EXTRA:-} > "$LOGS/vllama.log" 2>&1 < /dev/null &
  echo $! > /tmp/vllama.pid
  sleep 3
  log "while vLLM loads: $(curl -s -w ' [%{http_code}]' $PROXY/api/tags) $(curl -s -w ' [%{http_code}]' $PROXY/readyz)"
  wait_ready $PROXY /tmp/vllama.pid 480 || { tail -40 "$LOGS/vllama.log"; exit 1; }
  setsid python3 -m vllama_proxy serve --upstream $DIRECT --port 11435 --workers 1 --log-format json \
    > "$LOGS/vllama1.log" 2>&1 < /dev/null &
  echo $! > /tmp/vllama1.pid
  wait_ready $PROXY1 /tmp/vllama1.pid 30 || exit 1
  ;;
e2e)
  log "e2e transcript (ollama client)"
  python3 benchmarks/e2e_ollama.py --url $PROXY --model qwen2.5:1.5b --out "$OUT/e2e.json"
  log "/api/ps: $(curl -s $PROXY/api/ps)"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
  ;;
sweep)
  log "sweep ${LEVELS:-1,10,64,256,1024}: targets alternating"
  loadgen --targets "${TARGETS:-proxy=ollama:$PROXY,proxy1=ollama:$PROXY1,direct=openai:$DIRECT}" \
    --levels "${LEVELS:-1,10,64,256,1024}" --rounds "${ROUNDS:-1}" --requests-per-level "${RPL:-max(32,4*c)}" \
    --warmup 16 --json "$OUT/sweep-${TAG:-all}.json"
  ;;
disconnect)
  log "client disconnects -> vllm:num_requests_running"
  python3 benchmarks/disconnect_check.py --url $PROXY --model $SERVED -n 64 --json "$OUT/disconnect.json"
  ;;
burst)
  for tgt in proxy=ollama:$PROXY direct=openai:$DIRECT; do
    log "burst ${BURST:-5000}: $tgt"
    loadgen --targets "$tgt" --burst "${BURST:-5000}" --warmup 0 --json "$OUT/burst-${tgt%%=*}.json"
  done
  ;;
bench)
  for base in $PROXY $DIRECT; do
    log "vllm bench serve --base-url $base"
    timeout 240 vllm bench serve --backend openai --base-url $base --endpoint /v1/completions --model $SERVED \
      --tokenizer /tmp/model --dataset-name random --random-input-len 128 --random-output-len 128 \
      --num-prompts 1024 --max-concurrency 256 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el \
      --metric-percentiles 50,90,99 2>&1 | grep -vE "it/s\]|^\s*$" | sed -n '/Serving Benchmark Result/,/^====*$/p'
  done
  ;;
stop)
  for f in /tmp/vllama1.pid /tmp/vllama.pid; do
    pid=$(cat $f); log "SIGTERM to vllama $pid (drain, stop vLLM's group)"
    kill -TERM "$pid"
    for i in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    sleep 1; log "exited: $(kill -0 "$pid" 2>/dev/null && echo no || echo yes); processes left in its session: $(ps -e -o sid= | awk -v s="$pid" '$1==s' | wc -l)"
  done
  sleep 1
  log "GPU memory used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
  log "vLLM log lines captured: $(grep -c '"component":"vllm"' "$LOGS/vllama.log")"
  gzip -c "$LOGS/vllama.log" > "$OUT/vllama.log.gz"; gzip -c "$LOGS/vllama1.log" > "$OUT/vllama1.log.gz"
  ;;
*) echo "unknown phase $phase"; exit 2;;
esac; done
