#!/usr/bin/env bash
# Issue 28 on the lent GPU: does the hop cost anything? vllama vs its own vLLM (alternating, 3 rounds)
# at c = 1, 16, 64, 256, 1024 with vllama's stage timings and the spread over vLLM's API servers;
# `vllama batch` with no concurrency flag vs vLLM's offline LLM.generate; a model's first answer
# (cold start vs vanilla `vllm serve`, a second start with the compile cache kept, A -> B -> A of two
# on-demand models with the defaults). From the repo root, in phases (servers run under setsid and
# outlive one device call while the machine stays warm, so the phases may be split over calls).
#
# Prerequisites as benchmarks/ttft_c1.sh: the vLLM 0.26 wheel chunks stashed by two earlier calls
# (`$DEV/install-vllm.sh stash`, carrying .whl-cache/chunks/{SHA256SUMS,wheels.tar.00}, then
# .whl-cache/chunks/wheels.tar.01); the call with `install` carries the last chunk, $DEV (a copy of
# shared/device) and .whl (vllama's deps the image lacks).
#
#   install  $DEV/install-vllm.sh install
#   setup    .whl into /tmp/vsite; the random-weight 1.5 B Qwen2 at /tmp/model; versions
#   wake     a loopback TCP round trip between two processes, back to back and after a 5 ms pause: what one
#            more hop costs on this host when the process it wakes was idle (benchmarks/wake_latency.py)
#   start    (b) `vllama serve --model /tmp/model` with vllama's defaults on :11434, its vLLM (c) on :8100,
#            with a fresh compile cache (VLLM_CACHE_ROOT=$LOGS/cache-b): a cold start, timed from launch
#            to the first generated token
#   c1       c = 1, one client process, $ROUNDS (3) alternating rounds x $C1_REQUESTS (32); stage timings
#   sweep    c = 16, 64, 256, 1024 (SWEEP_LEVELS), $ROUNDS alternating rounds x 4c requests each, 4 client
#            processes, CPU by process kind; vllama's stage timings per level; per-round ratios
#   spread   c = 64 and 256 (SPREAD_LEVELS), each target alone: how the connections to vLLM spread over
#            its API-server processes, and their CPU (benchmarks/api_spread.py)
#   batch    $BATCH_N (5000) prompts of 128 words, 128 tokens (/v1/completions lines): `vllama batch` with
#            no concurrency flag (it reads max_running from /api/version)
#   stop     SIGTERM vllama; GPU memory and leftover vLLM processes; logs
#   offline  (GPU free: after stop) vLLM's LLM.generate on the same 5,000 prompts, same GPU share (0.85)
#   vanilla  (GPU free) `vllm serve /tmp/model` with vLLM's defaults and a fresh compile cache: launch to
#            first token, then stopped
#   warm     (GPU free, after start) vllama's model again with the compile cache of `start` kept: the
#            second cold start, then stopped
#   cold     (GPU free; optional) vllama's model with a fresh compile cache again, beside vanilla
#   ondemand (GPU free) two random models placed in $HUB as Qwen/Qwen2.5-1.5B-Instruct and
#            meta-llama/Llama-3.2-1B-Instruct; `vllama serve` with no model and its defaults; the real
#            ollama client asks qwen2.5:1.5b, llama3.2:1b, qwen2.5:1.5b, llama3.2:1b, qwen2.5:1.5b (16 tokens
#            each: the third is A -> B -> A; the fourth and fifth separate a model's first sleep); then stopped
#
# After the two stash calls, three calls back to back (the machine must stay warm: vllama keeps running
# between them; timeout_s 600 each): the install call (with the last chunk), then two calls of measurements:
#   0: OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh install setup wake start      (~3.5 min)
#   1: OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh c1 sweep spread batch stop offline   (~8 min)
#   2: OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh vanilla warm ondemand          (~8 min)
# (`cold` adds ~2.5 min: vllama with a fresh compile cache right beside `vanilla`; `start` is the first.)
# Outputs in $OUT (one call's; at most 8 files): summary.txt (every result, tables), c1.json and
# sweep.json (benchmarks/loadgen.py JSON; sweep.json has every level), spread.json, stages.jsonl, logs.tar.gz.
# Dry run against the stand-in (tests/bin/vllm on PATH, no GPU): MODEL (a model dir), VLLAMA_EXTRA
# (--no-gpu-check), NO_GPU=1 (skips nvidia-smi), C1_REQUESTS, SWEEP_LEVELS, SPREAD_LEVELS, BATCH_N,
# TOKENS, PB / PC ports, HUB.
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device} MODEL=${MODEL:-/tmp/model}
HUB=${HUB:-/tmp/hf/hub}
mkdir -p "$OUT" "$LOGS" "$HUB"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state HF_HOME=$(dirname "$HUB") HF_HUB_CACHE=$HUB
PB=${PB:-11434} PC=${PC:-8100} ROUNDS=${ROUNDS:-3} TOKENS=${TOKENS:-128}
B=http://127.0.0.1:$PB C=http://127.0.0.1:$PC SERVED=qwen-random
VLLM_SHAPE="--max-model-len 4096 --gpu-memory-utilization 0.85"
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
say() { tee -a "$OUT/summary.txt"; }
gpu() { [ -n "${NO_GPU:-}" ] && echo "-" || nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '; }
loadgen() { python3 benchmarks/loadgen.py --model $SERVED --output-tokens "$TOKENS" --prompt-words 128 --raise-nofile --baseline c "$@"; }
report() { python3 benchmarks/hop_report.py "$@"; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop_pid() {  # pidfile: SIGTERM, wait up to 60 s
  alive "$1" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1"); kill -TERM "$pid"
  for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && { log "still running after 60 s: SIGKILL to $pid's group"; kill -KILL -- "-$pid" 2>/dev/null; }
  rm -f "$1"
}
page_cache() { cat "$MODEL"/*.safetensors > /dev/null 2>&1 || true; }  # every start reads the weights from RAM
# vllama serve --model $MODEL with its defaults; $1: its log file, $2: VLLM_CACHE_ROOT. Prints "seconds to first token".
vllama_start() {
  page_cache
  VLLM_CACHE_ROOT=$2 setsid python3 -m vllama_proxy serve --model "$MODEL" --served-model-name $SERVED --vllm-port $PC \
    --port $PB --keep-alive -1 --log-format json ${VLLAMA_EXTRA:-} -- $VLLM_SHAPE > "$1" 2>&1 < /dev/null &
  echo $! > $LOGS/b.pid
  report first $B ollama --model $SERVED --timeout 590
}
compile_lines() {  # what vLLM said about its compile cache and start (the lines worth comparing)
  grep -aE 'torch.compile takes|Compiling a graph|Directly load the compiled graph|init engine .* took|Graph capturing finished|Loading weights took|Model loading took' "$1" \
    | sed -E 's/^.*"line":"?//' | cut -c1-200 | head -20
}

for phase in "$@"; do case $phase in
install) "$DEV/install-vllm.sh" install || exit 1 ;;
setup)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  [ -f "$MODEL/config.json" ] || python3 "$DEV/make_random_model.py" "$MODEL" > /dev/null || exit 1
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null); $(nproc) CPUs; $(free -g | awk '/Mem/{print $2" GiB RAM, "$7" available"}'); GPU: $([ -n "${NO_GPU:-}" ] || nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader)"
  ;;
wake) python3 benchmarks/wake_latency.py --n 400 --pause-ms 5 | say ;;
start)
  rm -rf "$LOGS/cache-b"
  s=$(vllama_start $LOGS/vllama.log $LOGS/cache-b) || { tail -40 $LOGS/vllama.log; exit 1; }
  log "cold start (vllama, fresh compile cache): launch to first token $s s"
  { grep -m1 '"front_end"' $LOGS/vllama.log; grep -m1 '"admission"' $LOGS/vllama.log; grep -m1 '"compile_cache"' $LOGS/vllama.log
    echo "/api/version: $(curl -s $B/api/version)"; compile_lines $LOGS/vllama.log; } | cut -c1-400 | say
  ;;
c1)
  log "c=1: b=vllama c=its vLLM, $ROUNDS rounds x ${C1_REQUESTS:-32} requests, one client process"
  report metrics $B $LOGS/m0.txt
  loadgen --targets "b=ollama:$B,c=openai:$C" --levels 1 --rounds "$ROUNDS" --requests-per-level "${C1_REQUESTS:-32}" \
    --procs 1 --warmup 16 --json "$OUT/c1.json" > $LOGS/c1.txt 2>&1
  report metrics $B $LOGS/m1.txt
  report rounds "$OUT/c1.json" | say
  report stages $LOGS/m0.txt $LOGS/m1.txt c=1 | tee -a "$OUT/summary.txt" | tail -1 >> "$OUT/stages.jsonl"
  ;;
sweep)
  warm=16; rm -f $LOGS/sweep-*.json
  for c in ${SWEEP_LEVELS:-16 64 256 1024}; do
    log "c=$c: $ROUNDS alternating rounds x $(( 4 * c )) requests per target, 4 client processes"
    report metrics $B $LOGS/m0.txt
    loadgen --targets "b=ollama:$B,c=openai:$C" --levels "$c" --rounds "$ROUNDS" --requests-per-level "$(( 4 * c ))" \
      --procs 4 --warmup $warm --cpu-by-kind --json "$LOGS/sweep-$c.json" > $LOGS/sweep-$c.txt 2>&1 || log "c=$c: loadgen reported errors"
    report metrics $B $LOGS/m1.txt
    warm=0
    report rounds "$LOGS/sweep-$c.json" | say
    grep '^|' $LOGS/sweep-$c.txt | say  # loadgen's tables: pooled results, cores by process kind, ratios
    report stages $LOGS/m0.txt $LOGS/m1.txt "c=$c" | tee -a "$OUT/summary.txt" | tail -1 >> "$OUT/stages.jsonl"
    report merge "$OUT/sweep.json" $LOGS/sweep-*.json  # one file of every level so far (files that come back: 8 at most)
  done
  ;;
spread)
  echo "[" > $LOGS/spread.json; sep=""
  for c in ${SPREAD_LEVELS:-64 256}; do
    for t in b=ollama:$B c=openai:$C; do
      sleep 4  # idle pooled connections retire (3 s) between the targets
      python3 benchmarks/api_spread.py --port $PC --interval 0.25 --json $LOGS/spread-one.json > $LOGS/spread-one.txt & sp=$!
      sleep 1
      loadgen --targets "$t" --levels "$c" --rounds 1 --requests-per-level "$(( 4 * c ))" --procs 4 --warmup 0 \
        --baseline "${t%%=*}" > $LOGS/spread-load.txt 2>&1
      kill -INT $sp; wait $sp
      log "spread c=$c target ${t%%=*} ($(grep -E "^\| $c " $LOGS/spread-load.txt | cut -d'|' -f7-8 | tr -s ' ' | head -1) req/s | tok/s):"
      say < $LOGS/spread-one.txt
      { echo "$sep{\"concurrency\": $c, \"target\": \"${t%%=*}\", \"spread\": "; cat $LOGS/spread-one.json; echo "}"; } >> $LOGS/spread.json
      sep=","
    done
  done
  echo "]" >> $LOGS/spread.json; cp $LOGS/spread.json "$OUT/spread.json"
  ;;
batch)
  n=${BATCH_N:-5000}
  report prompts "$n" $LOGS/batch.jsonl --words 128 --tokens "$TOKENS" --model $SERVED
  log "batch: $n prompts, /api/version says $(curl -s $B/api/version)"
  t=$(date +%s.%N)
  python3 -m vllama_proxy batch $LOGS/batch.jsonl -o $LOGS/batch-out.jsonl --restart --host $B > $LOGS/batch.txt 2>&1
  rc=$?
  grep -E 'concurrency|^vllama batch: [0-9]+/[0-9]+ .*skipped' $LOGS/batch.txt | say
  ok=$(grep -c '"status_code": *200' $LOGS/batch-out.jsonl || true)
  log "vllama batch: exit $rc, $ok/$n answered 200, wall $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t}") s"
  ;;
stop)
  stop_pid $LOGS/b.pid
  sleep 2
  log "stopped; GPU memory used: $(gpu); vLLM processes left: $(pgrep -fc '^VLLM::|bin/vllm serve' || true)"
  ;;
offline)
  [ -f $LOGS/batch.jsonl ] || report prompts "${BATCH_N:-5000}" $LOGS/batch.jsonl --words 128 --tokens "$TOKENS" --model $SERVED
  log "offline LLM.generate on the same prompts, gpu_memory_utilization 0.85 (GPU used before: $(gpu))"
  if [ -n "${NO_GPU:-}" ]; then log "offline: skipped (NO_GPU: the stand-in has no LLM class)"; continue; fi
  page_cache
  VLLM_CACHE_ROOT=$LOGS/cache-offline python3 benchmarks/offline_generate.py "$MODEL" $LOGS/batch.jsonl --json $LOGS/offline.json \
    > $LOGS/offline.log 2>&1 || tail -20 $LOGS/offline.log | say
  log "offline: $(cat $LOGS/offline.json 2>/dev/null)"
  ;;
vanilla)
  rm -rf $LOGS/cache-vanilla; page_cache
  t=$(date +%s.%N)
  VLLM_CACHE_ROOT=$LOGS/cache-vanilla setsid vllm serve "$MODEL" --served-model-name $SERVED --port $PC $VLLM_SHAPE \
    > $LOGS/vanilla.log 2>&1 < /dev/null &
  echo $! > $LOGS/v.pid
  s=$(report first $C openai --model $SERVED --timeout 590)
  log "cold start (vanilla vllm serve, fresh compile cache): launch to first token $s s"
  compile_lines $LOGS/vanilla.log | say
  stop_pid $LOGS/v.pid
  ;;
cold|warm)
  if [ $phase = cold ]; then cache=$LOGS/cache-cold; rm -rf $cache; else cache=$LOGS/cache-b; fi
  s=$(vllama_start $LOGS/vllama-$phase.log $cache) || { tail -40 $LOGS/vllama-$phase.log; }
  log "$([ $phase = cold ] && echo 'cold start (vllama, fresh compile cache)' || echo 'second start (vllama, compile cache of start kept)'): launch to first token $s s"
  compile_lines $LOGS/vllama-$phase.log | say
  stop_pid $LOGS/b.pid
  ;;
ondemand)
  t=$(date +%s)
  if [ -n "${NO_GPU:-}" ]; then  # the dry run: copies of $MODEL under both names
    for r in Qwen/Qwen2.5-1.5B-Instruct meta-llama/Llama-3.2-1B-Instruct; do
      d=$HUB/models--${r//\//--}; [ -d "$d" ] || { rm -rf $LOGS/src; cp -r "$MODEL" $LOGS/src; python3 benchmarks/on_demand_models.py place $LOGS/src "$HUB" $r; }
    done
  else
    [ -d /tmp/qwen-src ] || python3 "$DEV/make_random_model.py" /tmp/qwen-src > /dev/null
    [ -d "$HUB/models--Qwen--Qwen2.5-1.5B-Instruct" ] || python3 benchmarks/on_demand_models.py place /tmp/qwen-src "$HUB" Qwen/Qwen2.5-1.5B-Instruct
    [ -d /tmp/llama-src ] || python3 benchmarks/on_demand_models.py llama /tmp/llama-src --tokenizer-from "$(echo "$HUB"/models--Qwen--Qwen2.5-1.5B-Instruct/snapshots/*)"
    [ -d "$HUB/models--meta-llama--Llama-3.2-1B-Instruct" ] || python3 benchmarks/on_demand_models.py place /tmp/llama-src "$HUB" meta-llama/Llama-3.2-1B-Instruct
  fi
  log "on-demand models in $HUB ($(( $(date +%s) - t )) s): $(ls "$HUB" | tr '\n' ' ')"
  setsid python3 -m vllama_proxy serve --port $PB --log-format json ${VLLAMA_EXTRA:-} > $LOGS/ondemand.log 2>&1 < /dev/null &
  echo $! > $LOGS/d.pid
  for _ in $(seq 120); do curl -sf $B/readyz > /dev/null && break; sleep 0.5; done
  python3 benchmarks/on_demand_client.py $B ask ${ONDEMAND_MODELS:-qwen2.5:1.5b llama3.2:1b qwen2.5:1.5b llama3.2:1b qwen2.5:1.5b} 2>&1 | say
  grep -aE '"on_demand_sleep"|"compile_cache"|"woke_up"|"on_demand_unload"|"to":"(sleeping|ready|unloaded)"' $LOGS/ondemand.log | cut -c1-300 | say
  stop_pid $LOGS/d.pid
  log "stopped; GPU memory used: $(gpu)"
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac; done
# whatever ran, the logs so far (one file: at most 8 come back)
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" --exclude='cache-*' --exclude='state' --exclude='*.jsonl' --exclude='*.pid' . 2>/dev/null || true
