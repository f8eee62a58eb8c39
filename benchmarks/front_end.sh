#!/usr/bin/env bash
# Issues 11 and 12 on the lent GPU machine: vllama's defaults against vLLM's, in phases so that the
# servers outlive one device call (setsid) while the machine stays warm. From the repo root.
#
# Prerequisites: vLLM in /tmp/site (shared/device/install-vllm.sh); `setup` installs vllama's
# missing deps from .whl/ (orjson, structlog, ollama wheels for Python 3.12) into /tmp/vsite
# and makes the random-weight model /tmp/model (shared/device/make_random_model.py, from DEV=...).
#
#   setup     deps + model
#   start     (a) `vllm serve /tmp/model` with vLLM's defaults on :8000, then, once it is ready,
#             (b) `vllama serve --model /tmp/model` with vllama's defaults (no --workers, no
#             --api-server-count) on :11434, whose vLLM (c) listens on :8100. Both vLLMs get
#             --gpu-memory-utilization $SHARE (0.42) only, so that they fit side by side.
#   checks    multi_api_check.py: health/models/tokenize/metrics with several API servers
#   sweep     c = $LEVELS, $ROUNDS alternating rounds, targets a, b, c; then (c) with stream: false
#   pauses    (b) alone, levels with 10 s idle pauses between runs (stale upstream connections)
#   burst     $BURST requests at once through (b)
#   workers   vllama's proxy processes alone: `vllama serve --upstream (c) --workers 2` and `--workers 8`
#             beside (b) (its automatic choice) and (c), c = $WLEVELS, 3 alternating rounds
#   interval  (a) stopped; (d) `vllm serve --api-server-count 4 --stream-interval 4` on :8001 vs (c)
#   restart   SIGKILL one of (c)'s API servers: vllama restarts vLLM, no process left behind
#   stop      SIGTERM everything; GPU memory and leftover processes reported
#
# DP=2 on two GPUs: SHARE=0.85 VLLAMA_ONLY=1 VLLM_EXTRA="--data-parallel-size 2" ... start checks sweep stop
# (VLLAMA_ONLY skips (a); TARGETS picks the sweep's targets). LG_CPUS=0-13 keeps the load generator off
# the CPUs an engine core may get (a remote client, as in production). The phase pintoggle (the engine
# core's placement toggled on the running server): `git show abcf5ef:benchmarks/front_end.sh`, its
# pin_engine.py in abcf5ef:benchmarks/ (benchmarks/RESULTS.md says how to fetch it).
# Usage: OUT=dir DEV=.devscripts benchmarks/front_end.sh setup start checks sweep ... stop
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=/tmp/gpu-logs
mkdir -p "$OUT" $LOGS
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=/tmp/vllama-state
A=http://127.0.0.1:8000 B=http://127.0.0.1:11434 C=http://127.0.0.1:8100 D=http://127.0.0.1:8001 SERVED=qwen-random
SHARE=${SHARE:-0.42}
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
wait_url() {  # url pid seconds
  local t0; t0=$(date +%s.%N)
  until curl -sf "$1" > /dev/null; do
    if ! kill -0 "$2" 2>/dev/null; then log "$1: process exited"; return 1; fi
    if awk "BEGIN{exit !($(date +%s.%N) - $t0 > $3)}"; then log "$1 not ready after $3 s"; return 1; fi
    sleep 0.5
  done
  log "$1 ready after $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s"
}
loadgen() { ${LG_CPUS:+taskset -c $LG_CPUS} python3 benchmarks/loadgen.py --model $SERVED --output-tokens 128 --prompt-words 128 --raise-nofile --procs "${PROCS:-4}" "$@"; }
cpu_snapshot() {  # processes by kind and their CPU seconds so far
  python3 - <<'PY'
import psutil, collections
kinds = collections.Counter(); cpu = collections.Counter()
for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
    t = " ".join(p.info["cmdline"] or []) or p.info["name"] or ""
    k = ("vLLM API server" if "APIServer" in t else "vLLM engine core" if "EngineCore" in t else
         "vllama" if "vllama_proxy" in t or "spawn_main" in t else "vllm serve" if "vllm serve" in t or t.endswith("/vllm") else "loadgen" if "loadgen" in t else None)
    if k:
        kinds[k] += 1; c = p.info["cpu_times"]; cpu[k] += (c.user + c.system) if c else 0
print("; ".join(f"{k}: {kinds[k]} procs, {cpu[k]:.0f} cpu-s" for k in sorted(kinds)))
PY
}

for phase in "$@"; do case $phase in
setup)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  [ -f /tmp/model/config.json ] || python3 "${DEV:-shared/device}/make_random_model.py" /tmp/model
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null); $(nproc) CPUs; GPU: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | tr '\n' ' ')"
  ;;
start)
  if [ -z "${VLLAMA_ONLY:-}" ]; then
    setsid vllm serve /tmp/model --served-model-name $SERVED --host 127.0.0.1 --port 8000 --gpu-memory-utilization "$SHARE" \
      > $LOGS/vllm-a.log 2>&1 < /dev/null &
    echo $! > /tmp/a.pid
    wait_url $A/health "$(cat /tmp/a.pid)" 600 || { tail -30 $LOGS/vllm-a.log; exit 1; }
  fi
  setsid python3 -m vllama_proxy serve --model /tmp/model --served-model-name $SERVED --vllm-port 8100 --port 11434 \
    --keep-alive -1 --log-format json -- --gpu-memory-utilization "$SHARE" ${VLLM_EXTRA:-} > $LOGS/vllama.log 2>&1 < /dev/null &
  echo $! > /tmp/b.pid
  wait_url $B/readyz "$(cat /tmp/b.pid)" 600 || { tail -40 $LOGS/vllama.log; exit 1; }
  log "readyz: $(curl -s $B/readyz)"
  grep -m1 '"front_end"' $LOGS/vllama.log; grep -m1 '"admission"' $LOGS/vllama.log; grep -m1 '"launched"' $LOGS/vllama.log | cut -c1-400
  cpu_snapshot
  ;;
checks)
  python3 benchmarks/multi_api_check.py --url $B --direct $C --model $SERVED > "$OUT/multi-api-check.json"; log "multi_api_check exit $?"
  python3 -c 'import json; r = json.load(open("'"$OUT"'/multi-api-check.json")); print(len(r["processes"]), "vLLM processes;", {k: r[k] for k in ("health", "models", "tokenize", "aborted", "failures")}); print("running per scrape:", [s["running"] for s in r["scrapes_under_load"]])'
  ;;
sweep)
  cpu_snapshot
  loadgen --targets "${TARGETS:-a=openai:$A,b=ollama:$B,c=openai:$C}" --levels "${LEVELS:-1,10,64,256,1024}" \
    --cpu-by-kind --rounds "${ROUNDS:-3}" --requests-per-level "${RPL:-min(max(16,4*c),2048)}" --warmup 16 --json "$OUT/sweep${TAG:-}.json"
  loadgen --targets "c_nostream=openai-nostream:$C" --levels "${NOSTREAM_LEVELS:-256}" --rounds 2 \
    --requests-per-level "min(max(16,4*c),2048)" --warmup 0 --json "$OUT/nostream${TAG:-}.json"
  cpu_snapshot
  ;;
pauses)
  loadgen --targets "b=ollama:$B" --levels 1,64,256,1024 --rounds 1 --requests-per-level "min(max(16,2*c),2048)" \
    --warmup 0 --cooldown 10 --json "$OUT/pauses${TAG:-}.json"
  ;;
burst)
  loadgen --targets "b=ollama:$B" --burst "${BURST:-5000}" --warmup 0 --json "$OUT/burst${TAG:-}.json"
  log "vllama RSS now: $(ps -o rss= -p "$(cat /tmp/b.pid)") kB (main); $(grep -c upstream_retry $LOGS/vllama.log) upstream retries so far"
  ;;
workers)
  for w in 2 8; do
    setsid python3 -m vllama_proxy serve --upstream $C --port $((11433 + w)) --workers $w --log-format json \
      > $LOGS/vllama-w$w.log 2>&1 < /dev/null &
    echo $! > /tmp/w$w.pid
  done
  for w in 2 8; do wait_url http://127.0.0.1:$((11433 + w))/readyz "$(cat /tmp/w$w.pid)" 60 || exit 1; done
  loadgen --targets "b=ollama:$B,w2=ollama:http://127.0.0.1:11435,w8=ollama:http://127.0.0.1:11441,c=openai:$C" \
    --levels "${WLEVELS:-256,1024}" --rounds 3 --requests-per-level "min(max(16,4*c),2048)" --warmup 8 --cpu-by-kind \
    --json "$OUT/workers${TAG:-}.json"
  for w in 2 8; do kill -TERM "$(cat /tmp/w$w.pid)"; done
  ;;
interval)
  [ -f /tmp/a.pid ] && { kill -TERM -- -"$(cat /tmp/a.pid)" 2>/dev/null; sleep 8; }
  setsid vllm serve /tmp/model --served-model-name $SERVED --host 127.0.0.1 --port 8001 --gpu-memory-utilization "$SHARE" \
    --api-server-count 4 --stream-interval 4 > $LOGS/vllm-d.log 2>&1 < /dev/null &
  echo $! > /tmp/d.pid
  wait_url $D/health "$(cat /tmp/d.pid)" 600 || { tail -30 $LOGS/vllm-d.log; exit 1; }
  loadgen --targets "c=openai:$C,d_interval4=openai:$D" --levels 1,64,256 --rounds 2 \
    --requests-per-level "min(max(16,4*c),1024)" --warmup 8 --json "$OUT/interval.json"
  kill -TERM -- -"$(cat /tmp/d.pid)"
  ;;
restart)
  victim=$(pgrep -f '^VLLM::APIServer_' | head -1)  # the title starts the cmdline; a shell that names it does not
  log "SIGKILL to API server $victim; vllama's states follow"
  kill -KILL "$victim"
  for i in $(seq 600); do
    s=$(curl -s $B/readyz | python3 -c 'import json,sys; b=json.load(sys.stdin); print(b["state"], b["restarts"])' 2>/dev/null)
    [ "$s" != "${last:-}" ] && log "state: $s"; last=$s
    case $s in "ready 1") break;; esac; sleep 0.5
  done
  log "after restart: $(pgrep -fc 'APIServer') API servers, $(pgrep -fc EngineCore) engine cores; generate: $(curl -s -o /dev/null -w '%{http_code}' $B/api/generate -d '{"model":"'$SERVED'","prompt":"hi","stream":false,"options":{"num_predict":8}}')"
  ;;
stop)
  for f in /tmp/b.pid /tmp/a.pid /tmp/d.pid; do
    [ -f $f ] || continue; pid=$(cat $f); kill -0 "$pid" 2>/dev/null || continue
    log "SIGTERM to $f ($pid)"; kill -TERM "$pid"
    for i in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    log "exited: $(kill -0 "$pid" 2>/dev/null && echo no || echo yes); processes left in its session: $(ps -e -o sid= | awk -v s="$pid" '$1==s' | wc -l)"
  done
  sleep 2
  log "GPU memory used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '); vLLM processes left: $(pgrep -fc '^VLLM::|bin/vllm serve')"
  for f in vllama vllm-a vllm-d; do [ -f $LOGS/$f.log ] && gzip -c $LOGS/$f.log > "$OUT/$f.log.gz"; done
  ;;
*) echo "unknown phase $phase"; exit 2;;
esac; done
