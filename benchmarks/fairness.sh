#!/usr/bin/env bash
# Issue 27 on a lent single GPU: one key floods streams while another asks one request at a time.
# The light key's TTFT p50/p99 alone, with fair sharing off and on, and the heavy key's tok/s cost of
# fair sharing (goals: light within 2x of alone; heavy >= 0.95x). From the repo root, in phases
# (the server is started with setsid and outlives one device call while the machine stays warm).
#
# Prerequisites as benchmarks/ttft_c1.sh: the vLLM wheel chunks stashed by earlier calls
# (`$DEV/install-vllm.sh stash`, one chunk of .whl-cache/chunks each); the call with `install` carries
# the last chunk, $DEV (a copy of shared/device) and .whl (vllama's deps the image lacks).
#
#   install   $DEV/install-vllm.sh install
#   setup     .whl into /tmp/vsite; the random-weight model /tmp/model; the keys file (heavy, light: users)
#   start-off `vllama serve --model /tmp/model --fair-share off` (vLLM first come first served)
#   start-on  the same with --fair-share on (vLLM --scheduling-policy priority, vllama sets priorities)
#   alone     the light key alone ($DURATION s after $WARMUP s)
#   flood     $HEAVY (1000) streams of the heavy key ($HEAVY_TOKENS output tokens each, re-issued) and
#             the light key one request at a time ($LIGHT_TOKENS tokens)
#   stop      SIGTERM, leftover processes, GPU memory; the log to $OUT
#   summary   the table: light TTFT p50/p99 alone/off/on, heavy tok/s off/on
# vLLM runs with --max-num-seqs $MAX_NUM_SEQS (256): the heavy key's streams beyond it wait in vLLM's
# queue, where first come first served puts the light key's request behind them and priority does not.
#
# Two calls (timeout_s 600 each, about 5 minutes each):
#   OUT=$OUT DEV=.devscripts benchmarks/fairness.sh install setup start-off alone flood stop
#   OUT=$OUT DEV=.devscripts benchmarks/fairness.sh start-on alone flood stop summary
# Outputs in $OUT: {off,on}-{alone,flood}.json (benchmarks/fairness.py), summary.txt, {off,on}.log.gz.
# Dry run on the stand-in (tests/bin/vllm on PATH): MODEL=<a model dir> VLLAMA_EXTRA=--no-gpu-check
# HEAVY=50 DURATION=5 WARMUP=2 (FAKE_VLLM_TOKEN_DELAY to pace the stand-in).
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device} MODEL=${MODEL:-/tmp/model}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state
PORT=${PORT:-11434} URL=http://127.0.0.1:${PORT:-11434} SERVED=qwen-random
HEAVY=${HEAVY:-1000} DURATION=${DURATION:-60} WARMUP=${WARMUP:-15} MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
mode() { cat "$LOGS/mode" 2>/dev/null || echo none; }
start() {  # off|on
  setsid python3 -m vllama_proxy serve --model "$MODEL" --served-model-name $SERVED --port "$PORT" --keep-alive -1 \
    --api-key-file "$LOGS/keys.toml" --fair-share "$1" --log-format json ${VLLAMA_EXTRA:-} \
    -- --max-model-len 4096 --gpu-memory-utilization 0.85 --max-num-seqs "$MAX_NUM_SEQS" > "$LOGS/$1.log" 2>&1 < /dev/null &
  echo $! > "$LOGS/vllama.pid"; echo "$1" > "$LOGS/mode"
  for _ in $(seq 1200); do
    curl -sf "$URL/readyz" > /dev/null && break
    kill -0 "$(cat "$LOGS/vllama.pid")" 2>/dev/null || { log "vllama exited"; tail -30 "$LOGS/$1.log"; exit 1; }
    sleep 0.5
  done
  log "fair share $1: ready; vLLM argv: $(grep -m1 -o '"argv":\[[^]]*\]' "$LOGS/$1.log" | tr -d '"' | cut -c1-400)"
}
bench() {  # what heavy-streams
  python3 benchmarks/fairness.py --url "$URL" --model $SERVED --heavy-key sk-heavy --light-key sk-light \
    --heavy-streams "$2" --heavy-tokens "${HEAVY_TOKENS:-256}" --light-tokens "${LIGHT_TOKENS:-32}" \
    --warmup "$WARMUP" --duration "$DURATION" --label "$(mode)-$1" --json "$OUT/$(mode)-$1.json" | tee -a "$OUT/summary.txt"
}

for phase in "$@"; do case $phase in
install) "$DEV/install-vllm.sh" install || exit 1 ;;
setup)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  [ -f "$MODEL/config.json" ] || python3 "$DEV/make_random_model.py" "$MODEL"
  printf '[[keys]]\nname = "heavy"\nkey = "sk-heavy"\n\n[[keys]]\nname = "light"\nkey = "sk-light"\n' > "$LOGS/keys.toml"
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null); $(nproc) CPUs; GPU: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
  ;;
start-off) start off ;;
start-on) start on ;;
alone) log "$(mode): the light key alone"; bench alone 0 ;;
flood) log "$(mode): $HEAVY heavy streams + the light key"; bench flood "$HEAVY" ;;
stop)
  f=$LOGS/vllama.pid
  if [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; then
    pid=$(cat "$f"); kill -TERM "$pid"
    for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -f "$f"; sleep 2
  log "stopped; GPU memory used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | tr '\n' ' '); vLLM processes left: $(pgrep -fc '^VLLM::|bin/vllm serve')"
  [ -f "$LOGS/$(mode).log" ] && gzip -c "$LOGS/$(mode).log" > "$OUT/$(mode).log.gz"
  ;;
summary)
  python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
r = {n: json.load(open(os.path.join(out, n + ".json"))) for n in ("off-alone", "off-flood", "on-alone", "on-flood")
     if os.path.exists(os.path.join(out, n + ".json"))}
print("| run | light reqs | light TTFT p50 ms | p99 ms | heavy tok/s | heavy errors | light errors |")
print("|---|---|---|---|---|---|---|")
for n, s in r.items():
    t = s["light_ttft_ms"]
    print(f"| {n} | {s['light_requests']} | {t['p50']} | {t['p99']} | {s['heavy_tok_s']} | {s['heavy_errors']} | {s['light_errors']} |")
alone = r.get("on-alone") or r.get("off-alone")
if alone and "on-flood" in r and "off-flood" in r:
    a, on, off = alone["light_ttft_ms"], r["on-flood"], r["off-flood"]
    print(f"light TTFT p50 on/alone {on['light_ttft_ms']['p50'] / a['p50']:.2f}x, off/alone {off['light_ttft_ms']['p50'] / a['p50']:.2f}x; "
          f"p99 on/alone {on['light_ttft_ms']['p99'] / a['p99']:.2f}x, off/alone {off['light_ttft_ms']['p99'] / a['p99']:.2f}x")
    print(f"heavy tok/s on/off {on['heavy_tok_s'] / max(off['heavy_tok_s'], 1e-9):.3f}x")
PY
  ;;
*) echo "unknown phase $phase"; exit 2;;
esac; done
