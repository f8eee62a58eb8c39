#!/usr/bin/env bash
# Issue 30 on the lent GPU: LoRA adapters of created models served many at once by one vLLM.
# From the repo root, in phases (the server is started with setsid and outlives one device call while
# the machine stays warm, so the phases may be split over calls).
#
# Prerequisites as benchmarks/ttft_c1.sh: the vLLM wheel chunks stashed by earlier calls
# (`$DEV/install-vllm.sh stash`); the call with `install` carries the last chunk, $DEV (a copy of
# shared/device) and .whl (vllama's deps the image lacks: ollama, ...).
#
#   install  $DEV/install-vllm.sh install
#   setup    .whl into /tmp/vsite
#   model    the random Qwen2.5-1.5B-shaped model at $MODEL ($DEV/make_random_model.py), and 4 random
#            rank-16 LoRA adapters of it in /tmp/loras (benchmarks/make_random_lora.py: torch + safetensors)
#   start    `vllama serve --model $MODEL` served as `base`, keep_alive forever
#   create   create_blob + create(adapters=...) of lora0..lora3 from `base`: create-to-first-answer each
#            (lora0 turns LoRA on: vLLM restarts; lora1..3 load into the running vLLM)
#   load     at 64 and 256 streams (4*c requests each, 128 in / 128 out): `base` alone, then base + the
#            4 adapters round-robin in one stream: output tok/s, TTFT, TPOT, the ratio
#   stop     SIGTERM; leftover processes; the vLLM command line vllama chose
# Outputs in $OUT: summary.txt (every result line), create.json, load.json, vllama.log.gz.
#
# Dry run without a GPU (the stand-in vLLM: no LoRA, so only model/start/load-base are meaningful):
#   PATH=$PWD/tests/bin:$PATH NO_GPU=1 MODEL=/tmp/tiny LEVELS=4 benchmarks/adapters.sh model start load stop
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device} MODEL=${MODEL:-/tmp/model}
LEVELS=${LEVELS:-64,256} URL=http://127.0.0.1:${PORT:-11434}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
gpu() { command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1 || echo "no GPU"; }
wait_ready() {  # pid seconds
  for _ in $(seq $(( $2 * 2 ))); do
    curl -sf $URL/readyz > /dev/null && return 0
    kill -0 "$1" 2>/dev/null || { log "vllama exited"; return 1; }
    sleep 0.5
  done
  log "not ready after $2 s"; return 1
}

for phase in "$@"; do case $phase in
install) "$DEV/install-vllm.sh" install || exit 1 ;;
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null); $(nproc) CPUs; GPU: $(nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null)"
  ;;
model)
  t=$(date +%s)
  [ -f "$MODEL/config.json" ] || python3 "$DEV/make_random_model.py" "$MODEL" > /dev/null || exit 1
  python3 benchmarks/make_random_lora.py "$MODEL" /tmp/loras --count 4 --rank 16 | tee -a "$OUT/summary.txt" || exit 1
  log "model and 4 adapters in $(( $(date +%s) - t )) s"
  ;;
start)
  setsid python3 -m vllama_proxy serve --model "$MODEL" --served-model-name base --port "${PORT:-11434}" --keep-alive -1 --log-format json \
    ${NO_GPU:+--no-gpu-check} > $LOGS/vllama.log 2>&1 < /dev/null &
  echo $! > $LOGS/pid
  t=$(date +%s)
  wait_ready "$(cat $LOGS/pid)" 600 || { tail -30 $LOGS/vllama.log; exit 1; }
  log "vllama up in $(( $(date +%s) - t )) s: $(curl -s $URL/readyz | head -c 300); GPU $(gpu)"
  ;;
create)
  python3 benchmarks/adapters_load.py create $URL base /tmp/loras/lora0 /tmp/loras/lora1 /tmp/loras/lora2 /tmp/loras/lora3 \
    --json "$OUT/create.json" 2>&1 | tee -a "$OUT/summary.txt"
  log "GPU after the adapters: $(gpu)"
  ;;
load)
  names=""; [ -f "$OUT/create.json" ] && names="lora0 lora1 lora2 lora3"
  python3 benchmarks/adapters_load.py load $URL base $names --levels "$LEVELS" --json "$OUT/load.json" 2>&1 | tee -a "$OUT/summary.txt"
  ;;
stop)
  kill -TERM "$(cat $LOGS/pid)"; for _ in $(seq 240); do kill -0 "$(cat $LOGS/pid)" 2>/dev/null || break; sleep 0.5; done
  log "stopped; left: $(pgrep -fc 'vllm serve|VLLM::' || true) vLLM processes; GPU $(gpu)"
  python3 - $LOGS/vllama.log <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    if '"launched"' in line:
        e = json.loads(line); print("    launched:", " ".join(e.get("argv", [])))
PY
  gzip -c $LOGS/vllama.log > "$OUT/vllama.log.gz"
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac; done
