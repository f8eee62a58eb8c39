#!/usr/bin/env bash
# Issues 27 and 38 on a lent single GPU: does the fair share hold under a flood?
#  - flood: one key keeps $HEAVY (1000) streams open while another asks one request at a time; the
#    light key's TTFT p50/p90/p99 alone and under the flood, with --fair-share off and on, and the
#    heavy key's tok/s with each (goals, issue 38: light p50 within 1.5x and p99 within 2x of alone
#    with fair share on; heavy on >= 0.95x of off).
#  - weights: four backlogged keys with weights 1, 1, 2, 4 and different prompt and answer lengths
#    (fair share on), each key's share of the service (VTC: prompt + 2 x output tokens) and of the
#    output tokens over $WEIGHTS_S (60) s; then a fifth key (weight 2) joins: seconds until it has
#    its share (goals: within 10 %; the late key within 5 s). benchmarks/fair_weights.py.
# One vLLM (`vllm serve`, --max-num-seqs $MAX_NUM_SEQS, --scheduling-policy priority: without
# vllama's priorities every request has priority 0, which is first come first served) runs for the
# whole session; vllama runs in front of it as `vllama serve --upstream ... --max-running
# $MAX_NUM_SEQS`, restarted for each mode (a few seconds), so that rounds can alternate off and on.
# From the repo root, in phases (servers start with setsid and outlive one device call while the
# machine stays warm).
#
# Prerequisites as benchmarks/ttft_c1.sh: the vLLM wheel chunks stashed by earlier calls
# (`$DEV/install-vllm.sh stash`, one chunk of .whl-cache/chunks each); the call with `install` carries
# the last chunk, $DEV (a copy of shared/device) and .whl (vllama's deps the image lacks).
#
#   install   $DEV/install-vllm.sh install
#   setup     .whl into /tmp/vsite; the random-weight model /tmp/model; the keys file (all users:
#             heavy, light; w1, w1b, w2, w4 with weights 1, 1, 2, 4; late with weight 2)
#   vllm      start vLLM on :$PV and wait for /health
#   off, on   (re)start vllama --fair-share off|on in front of it
#   alone     the light key alone ($DURATION s after $WARMUP s)
#   flood     $HEAVY streams of the heavy key ($HEAVY_TOKENS output tokens each, re-issued) and the
#             light key one request at a time ($LIGHT_TOKENS tokens)
#   weights   the four keys with $WEIGHT_STREAMS streams each, the late key after $WEIGHTS_S s
#   round     one alternating round: off alone flood, on alone flood weights (ROUND numbers files)
#   stop      SIGTERM vllama and vLLM; GPU memory, leftover processes; the logs to $OUT
#   summary   per round and pooled: the flood table and the weights table
#
# Four calls (timeout_s 600 each; a round is about 4.5 minutes with the defaults, 16 minutes in all):
#   OUT=$OUT DEV=.devscripts benchmarks/fairness.sh install setup vllm
#   OUT=$OUT ROUND=1 benchmarks/fairness.sh round
#   OUT=$OUT ROUND=2 benchmarks/fairness.sh round
#   OUT=$OUT ROUND=3 benchmarks/fairness.sh round stop summary
# Outputs in $OUT (raw, one file per run): r{N}-{off,on}-{alone,flood}.json (benchmarks/fairness.py,
# with every light TTFT), r{N}-on-weights.json (fair_weights.py, with the per-second series),
# summary.txt, vllm.log.gz, r{N}-{off,on}.log.gz.
# On the stand-in (CPU, no GPU): tests/bin/vllm on PATH is `vllm`; FAKE_VLLM_MAX_NUM_SEQS makes it
# run that many at once and queue the rest as vLLM does, FAKE_VLLM_TOKEN_DELAY/STEP_PER_SEQ its pace:
#   export PATH=$PWD/tests/bin:$PATH FAKE_VLLM_PYTHON=$PWD/.venv/bin/python PY=$PWD/.venv/bin/python \
#     FAKE_VLLM_MAX_NUM_SEQS=32 FAKE_VLLM_TOKEN_DELAY=0.02 MAX_NUM_SEQS=32 HEAVY=200 HEAVY_TOKENS=64 \
#     LIGHT_TOKENS=8 DURATION=15 WARMUP=10 WEIGHTS_S=20 LATE_S=10 WEIGHT_STREAMS=40 MODEL=/tmp/m OUT=... LOGS=...
#   ROUND=1 benchmarks/fairness.sh setup vllm round; ROUND=2 benchmarks/fairness.sh round stop summary
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device} MODEL=${MODEL:-/tmp/model}
mkdir -p "$OUT" "$LOGS"
[ -n "${FAKE_VLLM_PYTHON:-}" ] || PATH=/tmp/site/bin:$PATH  # the stand-in's tests/bin/vllm stays first on a dry run
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state
PY=${PY:-python3}
PORT=${PORT:-11434} PV=${PV:-8100} URL=http://127.0.0.1:${PORT:-11434} SERVED=qwen-random ROUND=${ROUND:-1}
HEAVY=${HEAVY:-1000} DURATION=${DURATION:-30} WARMUP=${WARMUP:-10} MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
WEIGHTS_S=${WEIGHTS_S:-60} LATE_S=${LATE_S:-15} WEIGHT_STREAMS=${WEIGHT_STREAMS:-200}
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
mode() { cat "$LOGS/mode" 2>/dev/null || echo none; }
stop_pid() {  # pidfile
  [ -f "$1" ] || return 0
  local pid; pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -f "$1"
}
proxy() {  # off|on
  stop_pid "$LOGS/vllama.pid"
  [ -f "$LOGS/vllama.log" ] && gzip -c "$LOGS/vllama.log" > "$OUT/$(cat "$LOGS/logtag").log.gz"
  echo "r$ROUND-$1" > "$LOGS/logtag"
  curl -s -o /dev/null "$URL/" && { log "port $PORT is taken by another server"; exit 1; }
  setsid $PY -m vllama_proxy serve --upstream "http://127.0.0.1:$PV" --port "$PORT" --max-running "$MAX_NUM_SEQS" \
    --api-key-file "$LOGS/keys.toml" --fair-share "$1" --log-format json ${VLLAMA_EXTRA:-} > "$LOGS/vllama.log" 2>&1 < /dev/null &
  echo $! > "$LOGS/vllama.pid"; echo "$1" > "$LOGS/mode"
  for _ in $(seq 240); do
    curl -sf "$URL/readyz" > /dev/null && break
    kill -0 "$(cat "$LOGS/vllama.pid")" 2>/dev/null || { log "vllama exited"; tail -30 "$LOGS/vllama.log"; exit 1; }
    sleep 0.5
  done
  log "round $ROUND: fair share $1: ready; $(grep -m1 '"event":"admission"' "$LOGS/vllama.log" | cut -c1-240)"
}
bench() {  # what heavy-streams
  $PY benchmarks/fairness.py --url "$URL" --model $SERVED --heavy-key sk-heavy --light-key sk-light \
    --heavy-streams "$2" --heavy-tokens "${HEAVY_TOKENS:-256}" --light-tokens "${LIGHT_TOKENS:-32}" \
    --warmup "$WARMUP" --duration "$DURATION" --label "r$ROUND-$(mode)-$1" --json "$OUT/r$ROUND-$(mode)-$1.json" | tee -a "$OUT/summary.txt"
}
weights() {
  (cd benchmarks && $PY fair_weights.py --url "$URL" --model $SERVED --streams "$WEIGHT_STREAMS" \
    --key sk-w1:1:128:256 --key sk-w1b:1:512:64 --key sk-w2:2:32:128 --key sk-w4:4:256:192 --late sk-late:2:128:128 \
    --late-at "$WEIGHTS_S" --warmup "$WARMUP" --duration "$((WEIGHTS_S + LATE_S))" \
    --label "r$ROUND-$(mode)-weights" --json "$OUT/r$ROUND-$(mode)-weights.json") | tee -a "$OUT/summary.txt"
}

for phase in "$@"; do case $phase in
install) "$DEV/install-vllm.sh" install || exit 1 ;;
setup)
  [ -d .whl ] && $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  [ -f "$MODEL/config.json" ] || [ -n "${FAKE_VLLM_PYTHON:-}" ] || $PY "$DEV/make_random_model.py" "$MODEL"
  { for k in heavy light; do printf '[[keys]]\nname = "%s"\nkey = "sk-%s"\n\n' $k $k; done
    for kw in w1:1 w1b:1 w2:2 w4:4 late:2; do printf '[[keys]]\nname = "%s"\nkey = "sk-%s"\nweight = %s\n\n' "${kw%:*}" "${kw%:*}" "${kw#*:}"; done
  } > "$LOGS/keys.toml"
  log "vllm $($PY -c 'import vllm; print(vllm.__version__)' 2>/dev/null); $(nproc) CPUs; GPU: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
  ;;
vllm)
  curl -s -o /dev/null "http://127.0.0.1:$PV/health" && { log "port $PV is taken by another server"; exit 1; }
  setsid vllm serve "$MODEL" --served-model-name $SERVED --port "$PV" --max-model-len 4096 --gpu-memory-utilization 0.85 \
    --max-num-seqs "$MAX_NUM_SEQS" --scheduling-policy priority > "$LOGS/vllm.log" 2>&1 < /dev/null &
  echo $! > "$LOGS/vllm.pid"
  for _ in $(seq 1200); do
    curl -sf "http://127.0.0.1:$PV/health" > /dev/null && break
    kill -0 "$(cat "$LOGS/vllm.pid")" 2>/dev/null || { log "vLLM exited"; tail -30 "$LOGS/vllm.log"; exit 1; }
    sleep 0.5
  done
  log "vLLM ready on :$PV (--max-num-seqs $MAX_NUM_SEQS)"
  ;;
off|on) proxy "$phase" ;;
alone) log "$(mode): the light key alone"; bench alone 0 ;;
flood) log "$(mode): $HEAVY heavy streams + the light key"; bench flood "$HEAVY" ;;
weights) log "$(mode): keys with weights 1 1 2 4, a late one after ${WEIGHTS_S}s"; weights ;;
round) "$0" off alone flood on alone flood weights || exit 1 ;;
stop)
  stop_pid "$LOGS/vllama.pid"
  [ -f "$LOGS/vllama.log" ] && gzip -c "$LOGS/vllama.log" > "$OUT/$(cat "$LOGS/logtag").log.gz" && rm "$LOGS/vllama.log"
  stop_pid "$LOGS/vllm.pid"; sleep 2
  log "stopped; GPU memory used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | tr '\n' ' '); vLLM processes left: $(pgrep -fc '^VLLM::|bin/vllm serve')"
  [ -f "$LOGS/vllm.log" ] && gzip -c "$LOGS/vllm.log" > "$OUT/vllm.log.gz"
  ;;
summary) $PY benchmarks/fairness_summary.py "$OUT" | tee -a "$OUT/summary.txt" ;;
*) echo "unknown phase $phase"; exit 2;;
esac; done
