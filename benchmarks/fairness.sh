#!/usr/bin/env bash
# Issues 27 and 38 on a lent single GPU: does the fair share hold under a flood?
#  - flood: one key keeps $HEAVY (1000) streams open while another asks one request at a time; the
#    light key's TTFT p50/p90/p99 alone and under the flood, with --fair-share off and on, and the
#    heavy key's tok/s with each (goals, issue 38: light p50 within 1.5x and p99 within 2x of alone
#    with fair share on; heavy on >= 0.95x of off).
#  - weights: four backlogged keys with weights 1, 1, 2, 4 and different prompt and answer lengths
#    (fair share on), each key's share of the output tokens (and of the service: $PROMPT_WEIGHT x
#    prompt + output tokens, what the queue charges) over $WEIGHTS_S (60) s; then a fifth key (weight
#    2) joins: seconds until it has its share (goals: each key's output tokens within 10 % of its
#    weighted share; the late key within 5 s). benchmarks/fair_weights.py.
#  - small: the flood again with fair share on and vllama's --max-running $MAX_RUNNING (< --max-num-seqs),
#    when MAX_RUNNING is set: what a smaller running batch gives the light key and costs the heavy one.
#  - sweep (issue 38's last goal, one device call): $ROUNDS rounds, each of the flood with fair share off,
#    on (vllama's defaults: --fair-light-running half of --max-num-seqs) with the light key alone
#    before it, and on with --fair-light-running N for each N of $LIGHTS ("0 64": 0 is no cap, only
#    the reserve, as before this change); the order rotates each round; a mode that would end past
#    $BUDGET_S (540) seconds of the call is skipped, so that `summary` still runs in the call.
#  - diag: where the light key's time goes under the flood: during a flood through vllama, light
#    requests straight to vLLM (priority -1e9 and 0, streamed; and unstreamed with vLLM's own
#    per-request metrics when this vLLM has --enable-per-request-metrics) and vLLM's /metrics before
#    and after (TTFT, queue and prefill time, ITL; requests running and waiting each second).
#    benchmarks/fair_diag.py.
# One vLLM (`vllm serve`, --max-num-seqs $MAX_NUM_SEQS, --scheduling-policy priority: without
# vllama's priorities every request has priority 0, which is first come first served;
# --api-server-count $ASC, by default what vllama's own sizing (supervisor/sizing.py) would choose
# for this host, printed: one API server, vLLM's default, may be what a 256-stream flood saturates)
# runs for the whole session; vllama runs in front of it as `vllama serve --upstream ... --max-running
# $MAX_NUM_SEQS`, restarted for each mode (a few seconds), so that rounds can alternate off and on.
# From the repo root, in phases (servers start with setsid and outlive one device call while the
# machine stays warm).
#
# Prerequisites as benchmarks/README.md ("On the lent GPU machine"): the vLLM wheel chunks stashed by earlier calls
# (`$DEV/install-vllm.sh stash`, one chunk of .whl-cache/chunks each); the call with `install` carries
# the last chunk, $DEV (a copy of shared/device) and .whl (vllama's deps the image lacks).
#
#   install   $DEV/install-vllm.sh install
#   setup     .whl into /tmp/vsite; the random-weight model /tmp/model; the keys file (all users:
#             heavy, light; w1, w1b, w2, w4 with weights 1, 1, 2, 4; late with weight 2)
#   vllm      start vLLM on :$PV and wait for /health
#   off, on   (re)start vllama --fair-share off|on in front of it
#   small     (re)start vllama --fair-share on --max-running $MAX_RUNNING
#   l<N>      (re)start vllama --fair-share on --fair-light-running N
#   alone     the light key alone ($ALONE_S s after $ALONE_WARMUP s)
#   flood     $HEAVY streams of the heavy key ($HEAVY_TOKENS output tokens each, re-issued) and the
#             light key one request at a time ($LIGHT_TOKENS tokens)
#   weights   the four keys with $WEIGHT_STREAMS streams each, measured $WEIGHTS_S s after $WEIGHTS_WARMUP s (a
#             fresh vllama does not know the keys' answer lengths yet: on the stand-in their
#             shares settled after about three of the longest answers), then the late key for $LATE_S s
#   diag      the flood through the vllama running now, and fair_diag.py straight to vLLM beside it
#   round     one alternating round: off alone flood, on alone flood weights, and with MAX_RUNNING
#             small flood (ROUND numbers files)
#   sweep     $ROUNDS rounds of: off flood; on alone flood; l<N> flood for N in $LIGHTS (ROUND set per round)
#   stop      SIGTERM vllama and vLLM; GPU memory, leftover processes; the logs to $OUT
#   summary   per round and pooled: the flood table and the weights table
#
# Four calls (timeout_s 600 each; a round is about 4 minutes with the defaults, 4.7 with MAX_RUNNING;
# the last call about 6, 18 minutes in all):
#   OUT=$OUT DEV=.devscripts benchmarks/fairness.sh install setup vllm
#   OUT=$OUT ROUND=1 benchmarks/fairness.sh round
#   OUT=$OUT ROUND=2 benchmarks/fairness.sh round
#   OUT=$OUT ROUND=3 MAX_RUNNING=128 benchmarks/fairness.sh round on diag stop summary
# (ASC=1 in the first call compares vLLM's default of one API server: vLLM starts once per session.)
# Issue 38's light-key goal in one call after `install setup vllm` (about 7.5 minutes; timeout_s 600):
#   OUT=$OUT ROUNDS=3 LIGHTS="0 64" DURATION=20 WARMUP=6 ALONE_S=10 ALONE_WARMUP=1 benchmarks/fairness.sh sweep stop summary
# The load generator (fairness.py) runs the light key in a process of its own and the heavy streams
# in $HEAVY_PROCS (4) more: session 10's runs had them all in one event loop.
# Outputs in $OUT (raw, one file per run): r{N}-{off,on,small,l<N>}-{alone,flood}.json (benchmarks/fairness.py,
# with every light TTFT), r{N}-on-weights.json (fair_weights.py, with the per-second series),
# r{N}-on-diag.json (fair_diag.py) beside r{N}-on-diagflood.json, summary.txt, vllm.log.gz,
# r{N}-{off,on,small}.log.gz.
# On the stand-in (CPU, no GPU): tests/bin/vllm on PATH is `vllm`; FAKE_VLLM_MAX_NUM_SEQS makes it
# run that many at once and queue the rest as vLLM does, FAKE_VLLM_TOKEN_DELAY/STEP_PER_SEQ its pace:
#   export PATH=$PWD/tests/bin:$PATH FAKE_VLLM_PYTHON=$PWD/.venv/bin/python PY=$PWD/.venv/bin/python \
#     FAKE_VLLM_MAX_NUM_SEQS=32 FAKE_VLLM_TOKEN_DELAY=0.02 MAX_NUM_SEQS=32 HEAVY=200 HEAVY_TOKENS=64 \
#     LIGHT_TOKENS=8 DURATION=15 WARMUP=10 WEIGHTS_S=20 LATE_S=10 WEIGHT_STREAMS=40 MAX_RUNNING=16 \
#     MODEL=/tmp/m OUT=... LOGS=...
#   ROUND=1 benchmarks/fairness.sh setup vllm round; ROUND=2 benchmarks/fairness.sh round on diag stop summary
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
ALONE_WARMUP=${ALONE_WARMUP:-2} ALONE_S=${ALONE_S:-15} WEIGHTS_WARMUP=${WEIGHTS_WARMUP:-20} MAX_RUNNING=${MAX_RUNNING:-} PROMPT_WEIGHT=${PROMPT_WEIGHT:-0}
ROUNDS=${ROUNDS:-3} LIGHTS=${LIGHTS-0 64} BUDGET_S=${BUDGET_S:-540}
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
proxy() {  # off|on|small|l<N>
  local fair=$1 running=$MAX_NUM_SEQS light=""
  if [ "$1" = small ]; then
    [ -n "$MAX_RUNNING" ] || { log "small needs MAX_RUNNING"; exit 2; }
    fair=on running=$MAX_RUNNING
  fi
  case $1 in l[0-9]*) fair=on light="--fair-light-running ${1#l}" ;; esac
  stop_pid "$LOGS/vllama.pid"
  [ -f "$LOGS/vllama.log" ] && gzip -c "$LOGS/vllama.log" > "$OUT/$(cat "$LOGS/logtag").log.gz"
  echo "r$ROUND-$1" > "$LOGS/logtag"
  curl -s -o /dev/null "$URL/" && { log "port $PORT is taken by another server"; exit 1; }
  setsid $PY -m vllama_proxy serve --upstream "http://127.0.0.1:$PV" --port "$PORT" --max-running "$running" \
    --api-key-file "$LOGS/keys.toml" --fair-share "$fair" --fair-prompt-weight "$PROMPT_WEIGHT" --log-format json \
    $light ${VLLAMA_EXTRA:-} > "$LOGS/vllama.log" 2>&1 < /dev/null &
  echo $! > "$LOGS/vllama.pid"; echo "$1" > "$LOGS/mode"
  for _ in $(seq 240); do
    curl -sf "$URL/readyz" > /dev/null && break
    kill -0 "$(cat "$LOGS/vllama.pid")" 2>/dev/null || { log "vllama exited"; tail -30 "$LOGS/vllama.log"; exit 1; }
    sleep 0.5
  done
  log "round $ROUND: $1 (fair share $fair, --max-running $running $light): ready; $(grep -m1 '"event":"admission"' "$LOGS/vllama.log" | cut -c1-360)"
}
bench() {  # what heavy-streams [warmup duration]
  $PY benchmarks/fairness.py --url "$URL" --model $SERVED --heavy-key sk-heavy --light-key sk-light \
    --heavy-streams "$2" --heavy-procs "${HEAVY_PROCS:-4}" --heavy-tokens "${HEAVY_TOKENS:-256}" --light-tokens "${LIGHT_TOKENS:-32}" \
    --warmup "${3:-$WARMUP}" --duration "${4:-$DURATION}" --label "r$ROUND-$(mode)-$1" --json "$OUT/r$ROUND-$(mode)-$1.json" | tee -a "$OUT/summary.txt"
}
weights() {
  (cd benchmarks && $PY fair_weights.py --url "$URL" --model $SERVED --streams "$WEIGHT_STREAMS" --prompt-weight "$PROMPT_WEIGHT" \
    --key sk-w1:1:128:256 --key sk-w1b:1:512:64 --key sk-w2:2:32:128 --key sk-w4:4:256:192 --late sk-late:2:128:128 \
    --late-at "$WEIGHTS_S" --warmup "$WEIGHTS_WARMUP" --duration "$((WEIGHTS_S + LATE_S))" \
    --label "r$ROUND-$(mode)-weights" --json "$OUT/r$ROUND-$(mode)-weights.json") | tee -a "$OUT/summary.txt"
}

api_servers() {  # "N CPUS SOURCE": vLLM API servers vllama's sizing (supervisor/sizing.py) chooses for one model here
  $PY - "$MODEL" <<'PY'
import sys
from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.supervisor.sizing import plan, usable_cpus
cpus, source = usable_cpus()
print(plan(cpus, source, [ModelConfig(model=sys.argv[1], name="qwen-random")], None).api_servers["qwen-random"], f"{cpus:g} CPUs, {source}")
PY
}
per_request_metrics() {  # vLLM's --enable-per-request-metrics when this vLLM has it (fair_diag.py reads them)
  $PY -c 'import importlib.util as u, pathlib, sys
d = pathlib.Path(u.find_spec("vllm").submodule_search_locations[0]) / "entrypoints"
sys.exit(0 if any("enable_per_request_metrics" in p.read_text(errors="ignore") for p in d.rglob("*.py")) else 1)' 2>/dev/null \
    && echo --enable-per-request-metrics
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
  sizing=$(api_servers 2>> "$OUT/summary.txt")
  [ -n "$sizing" ] || sizing="1 vllama's sizing failed (above): vLLM's default"
  ASC=${ASC:-${sizing%% *}}
  log "vLLM API servers: $ASC (vllama's sizing for this host: ${sizing#* })"
  setsid vllm serve "$MODEL" --served-model-name $SERVED --port "$PV" --max-model-len 4096 --gpu-memory-utilization 0.85 \
    --max-num-seqs "$MAX_NUM_SEQS" --scheduling-policy priority --api-server-count "$ASC" $(per_request_metrics) \
    ${VLLM_EXTRA:-} > "$LOGS/vllm.log" 2>&1 < /dev/null &
  echo $! > "$LOGS/vllm.pid"
  for _ in $(seq 1200); do
    curl -sf "http://127.0.0.1:$PV/health" > /dev/null && break
    kill -0 "$(cat "$LOGS/vllm.pid")" 2>/dev/null || { log "vLLM exited"; tail -30 "$LOGS/vllm.log"; exit 1; }
    sleep 0.5
  done
  log "vLLM ready on :$PV (--max-num-seqs $MAX_NUM_SEQS --api-server-count $ASC $(per_request_metrics))"
  ;;
off|on|small|l[0-9]*) proxy "$phase" ;;
alone) log "$(mode): the light key alone"; bench alone 0 "$ALONE_WARMUP" "$ALONE_S" ;;
flood) log "$(mode): $HEAVY heavy streams + the light key"; bench flood "$HEAVY" ;;
weights) log "$(mode): keys with weights 1 1 2 4, a late one after ${WEIGHTS_S}s"; weights ;;
diag)
  log "$(mode): diag: $HEAVY heavy streams + the light key through vllama, light requests straight to vLLM"
  (cd benchmarks && $PY fair_diag.py --vllm "http://127.0.0.1:$PV" --model $SERVED --warmup "$WARMUP" --duration "$DURATION" \
    --label "r$ROUND-$(mode)-diag" --json "$OUT/r$ROUND-$(mode)-diag.json") > "$LOGS/diag.out" 2>&1 &
  dpid=$!
  bench diagflood "$HEAVY"
  wait $dpid; tee -a "$OUT/summary.txt" < "$LOGS/diag.out"
  ;;
round) "$0" off alone flood on alone flood weights ${MAX_RUNNING:+small flood} || exit 1 ;;
sweep)  # $ROUNDS rounds of: off flood, on alone flood, l<N> flood for each N of $LIGHTS; the order rotates each round
  modes=(off on); for n in $LIGHTS; do modes+=("l$n"); done
  for r in $(seq "$ROUNDS"); do
    k=$(( (r - 1) % ${#modes[@]} ))
    for m in "${modes[@]:k}" "${modes[@]:0:k}"; do
      need=$(( WARMUP + DURATION + 15 )); [ "$m" = on ] && need=$(( need + ALONE_WARMUP + ALONE_S + 2 ))
      if [ $(( SECONDS + need )) -gt "$BUDGET_S" ]; then log "round $r: $m skipped: ${SECONDS}s of ${BUDGET_S}s spent"; continue; fi
      ROUND=$r "$0" "$m" $([ "$m" = on ] && echo alone) flood || exit 1
    done
  done ;;
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
