#!/usr/bin/env bash
# Issue 19, item 10 on the lent H200: a lone request's first token through vllama vs its own vLLM.
# From the repo root, in phases (servers are started with setsid and outlive one device call while
# the machine stays warm, so the phases may be split over several calls).
#
# Prerequisites (benchmarks/README.md, /work/shared/device/README.md): the vLLM wheel chunks stashed
# by two earlier calls (`$DEV/install-vllm.sh stash` carrying .whl-cache/chunks/{SHA256SUMS,wheels.tar.00},
# then .whl-cache/chunks/wheels.tar.01); this call carries the last chunk, the device scripts
# ($DEV, a copy of shared/device) and .whl (vllama's deps the image lacks: orjson, structlog for
# Python 3.12). Optional: build/old-vllama/vllama_proxy (ignored by git, so it can be carried), the
# code before the fix (`mkdir -p build/old-vllama && git archive 35405eb vllama_proxy | tar -x -C
# build/old-vllama`), adds target o.
#
#   install  $DEV/install-vllm.sh install (the last chunk, sha256, pip --no-deps into /tmp/site)
#   setup    vllama's deps from .whl into /tmp/vsite; the random-weight model /tmp/model
#   start    (b) `vllama serve --model /tmp/model` with vllama's defaults (as issue 19 measured:
#            it picks --api-server-count and --workers from the CPUs) on :11434, its vLLM (c) on
#            :8100; with build/old-vllama also (o) the old code as `vllama serve --upstream (c)` with
#            the same number of workers on :11436
#   c1       c = 1 (one client process: one stream at a time), $C1_ROUNDS (4) alternating rounds
#            x $C1_REQUESTS (64) requests per target; TTFT / ITL / TPOT per request
#   c256     c = 256, $C256_ROUNDS (3) alternating rounds x 1,024 requests, 4 client processes (tok/s)
#   conns    upstream connections: 64 sequential requests per target while `ss` samples the
#            connections to vLLM (1 new = one connection for all 64, 64 = one per request)
#   stop     SIGTERM everything; GPU memory and leftover vLLM processes; logs to $OUT
#
# One call after the two stash calls (timeout_s 600; about 6-7 minutes):
#   OUT=$OUT DEV=.devscripts benchmarks/ttft_c1.sh install setup start c1 c256 conns stop
# Outputs in $OUT: c1.json, c256.json (benchmarks/loadgen.py JSON, every run and the pooled
# summaries), conns.txt, start.txt, vllama.log.gz, summary.txt.
# Knobs for a dry run against the stand-in (tests/bin/vllm on PATH): MODEL, VLLAMA_EXTRA (e.g.
# --no-gpu-check), LOGS, PB / PC / PO (ports of b, c, o), TOKENS (output tokens, 128), C256_REQUESTS.
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device} MODEL=${MODEL:-/tmp/model} OLD=${OLD:-build/old-vllama}
mkdir -p "$OUT" $LOGS
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state
PB=${PB:-11434} PC=${PC:-8100} PO=${PO:-11436}
B=http://127.0.0.1:$PB C=http://127.0.0.1:$PC O=http://127.0.0.1:$PO SERVED=qwen-random
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
wait_url() {  # url pid seconds
  local t0; t0=$(date +%s.%N)
  until curl -sf "$1" > /dev/null; do
    if ! kill -0 "$2" 2>/dev/null; then log "$1: process exited"; return 1; fi
    if awk "BEGIN{exit !($(date +%s.%N) - $t0 > $3)}"; then log "$1 not ready after $3 s"; return 1; fi
    sleep 0.5
  done
  log "$1 ready after $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s"
}
targets() { echo "b=ollama:$B,c=openai:$C$([ -f $LOGS/o.pid ] && kill -0 "$(cat $LOGS/o.pid)" 2>/dev/null && echo ",o=ollama:$O")"; }
loadgen() { python3 benchmarks/loadgen.py --model $SERVED --output-tokens "${TOKENS:-128}" --prompt-words 128 --raise-nofile --baseline c "$@"; }
ratios() { tee -a "$OUT/summary.txt"; }

for phase in "$@"; do case $phase in
install)
  "$DEV/install-vllm.sh" install || exit 1
  ;;
setup)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  [ -f "$MODEL/config.json" ] || python3 "$DEV/make_random_model.py" "$MODEL"
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null); aiohttp $(python3 -c 'import aiohttp; print(aiohttp.__version__)'); $(nproc) CPUs; GPU: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | tr '\n' ' ')"
  ;;
start)
  setsid python3 -m vllama_proxy serve --model "$MODEL" --served-model-name $SERVED --vllm-port $PC --port $PB \
    --keep-alive -1 --log-format json ${VLLAMA_EXTRA:-} -- --max-model-len 4096 --gpu-memory-utilization 0.85 \
    > $LOGS/vllama.log 2>&1 < /dev/null &
  echo $! > $LOGS/b.pid
  wait_url $B/readyz "$(cat $LOGS/b.pid)" 600 || { tail -40 $LOGS/vllama.log; exit 1; }
  { curl -s $B/readyz; echo; grep -m1 '"front_end"' $LOGS/vllama.log; grep -m1 '"listening"' $LOGS/vllama.log; } > "$OUT/start.txt"
  workers=$(grep -m1 '"listening"' $LOGS/vllama.log | sed -E 's/.*"workers":([0-9]+).*/\1/')
  log "vllama up: $workers workers; vLLM API servers $(grep -m1 -o '"vllm_api_servers":{[^}]*}' $LOGS/vllama.log)"
  if [ -d "$OLD/vllama_proxy" ]; then  # -P: the old package from PYTHONPATH, not the one in the current directory
    PYTHONPATH=$PWD/$OLD:/tmp/vsite:/tmp/site VLLAMA_STATE_DIR=$LOGS/state-old setsid python3 -P -m vllama_proxy serve \
      --upstream $C --port $PO --workers "$workers" --log-format json > $LOGS/vllama-old.log 2>&1 < /dev/null &
    echo $! > $LOGS/o.pid
    wait_url $O/ "$(cat $LOGS/o.pid)" 60 || exit 1
    log "old vllama (target o): $(grep -m1 -o '"workers":[0-9]*' $LOGS/vllama-old.log)"
  fi
  ;;
c1)
  log "c=1: targets $(targets), ${C1_ROUNDS:-4} rounds x ${C1_REQUESTS:-64} requests, one client process"
  loadgen --targets "$(targets)" --levels 1 --rounds "${C1_ROUNDS:-4}" --requests-per-level "${C1_REQUESTS:-64}" \
    --procs 1 --warmup 16 --json "$OUT/c1.json" | ratios
  ;;
c256)
  log "c=256: targets $(targets), ${C256_ROUNDS:-3} rounds x ${C256_REQUESTS:-1024} requests, 4 client processes"
  loadgen --targets "$(targets)" --levels 256 --rounds "${C256_ROUNDS:-3}" --requests-per-level "${C256_REQUESTS:-1024}" \
    --procs 4 --warmup 16 --cpu-by-kind --json "$OUT/c256.json" | ratios
  ;;
conns)
  # Connections to vLLM opened while 64 sequential requests ran: the local ports of every established
  # connection to :$PC, sampled every 20 ms (a connection lives at least one request, ~0.3 s), that
  # were not there before. 1 = one connection reused by all 64 (a new client process opens one).
  estab() { ss -Htn state established "( dport = :$PC )" | awk '{print $3}' | sort -u; }
  for t in $(targets | tr ',' ' '); do
    name=${t%%=*}; estab > $LOGS/before.txt; : > $LOGS/seen.txt
    ( while :; do estab >> $LOGS/seen.txt; sleep 0.02; done ) & sampler=$!
    loadgen --targets "$t" --levels 1 --rounds 1 --requests-per-level 64 --procs 1 --warmup 0 --baseline "$name" > /dev/null
    kill $sampler; wait $sampler 2>/dev/null
    n=$(sort -u $LOGS/seen.txt | comm -13 $LOGS/before.txt - | wc -l)
    log "conns: $name: 64 sequential requests opened $n new connection(s) to vLLM" | tee -a "$OUT/conns.txt"
  done
  ;;
stop)
  for f in $LOGS/o.pid $LOGS/b.pid; do
    [ -f $f ] || continue; pid=$(cat $f); kill -0 "$pid" 2>/dev/null || continue
    log "SIGTERM to $f ($pid)"; kill -TERM "$pid"
    for i in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    rm -f $f
  done
  sleep 2
  log "GPU memory used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '); vLLM processes left: $(pgrep -fc '^VLLM::|bin/vllm serve')"
  for f in vllama vllama-old; do [ -f $LOGS/$f.log ] && gzip -c $LOGS/$f.log > "$OUT/$f.log.gz"; done
  ;;
*) echo "unknown phase $phase"; exit 2;;
esac; done
