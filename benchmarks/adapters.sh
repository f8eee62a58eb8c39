#!/usr/bin/env bash
# Issue 42.3 on a lent GPU: does the base model keep its tok/s with adapters beside it?
#  - rounds: the base alone with no LoRA (`nolora`: its own state directory, no adapter created, vLLM
#    with vllama's N API servers) against the base + 4 adapters declared at launch (`launch`:
#    --adapters launch, vLLM with --enable-lora --lora-modules lora0..3 and the same N API servers), at
#    $LEVELS (256) streams, 128 words in / 128 tokens out, $REQS (8) x streams requests each; `launch`
#    runs the mixed load (base, lora0..lora3 round-robin in one stream) and the base alone on the LoRA
#    vLLM. The two alternate within a round (odd rounds nolora first, even rounds launch first), 3
#    rounds. Goal (issue 42): launch/mixed >= 0.9x nolora/base. CONFIGS="nolora launch runtime" adds
#    `runtime` (--adapters runtime: the same 4 adapters, one API server, runtime loading) for the choice
#    of the default.
#  - create to first answer: lora0..lora3 created one after the other on the launch server (`prepare`:
#    lora0 turns LoRA on and compiles its graphs; each create restarts vLLM with the adapter declared),
#    then, after the rounds, a fifth (`new`: lora3 deleted, lora4 created: still 4 adapters, so the same
#    --max-loras and compile cache key): upload, create (the restart), first answer. vLLM's
#    compile-cache lines of every start go to summary.txt.
# From the repo root, in phases; every phase that starts vllama stops it before it ends.
#
# Prerequisites as benchmarks/README.md ("On the lent GPU machine"): the vLLM wheel chunks stashed by earlier calls
# (`$DEV/install-vllm.sh stash`, one chunk of .whl-cache/chunks each); the call with `install` carries
# the last chunk, $DEV (a copy of shared/device) and .whl (vllama's deps the image lacks: ollama, ...).
#
#   install   $DEV/install-vllm.sh install
#   setup     .whl into /tmp/vsite; versions, CPUs, GPU
#   model     the random Qwen2.5-1.5B-shaped model at $MODEL ($DEV/make_random_model.py) and 5 random
#             rank-16 LoRA adapters of it in /tmp/loras (benchmarks/make_random_lora.py)
#   prepare   the launch server: lora0..lora3 created (create.json), the vLLM command lines
#   round     one alternating round of $CONFIGS (r$ROUND-<config>.json)
#   new       the launch server: lora4 created, create to first answer (new.json); run after the rounds
#   summary   the rounds' table and ratio, the creates' table
#   stop      any vllama left; leftover vLLM processes
#
# Five calls on one warm machine (timeout_s 600 each; a vLLM start is 40-120 s, so `prepare` is 4-8
# minutes with its 4 restarts, a round 3-5 minutes; about 25 minutes of device time in all):
#   OUT=$OUT DEV=.devscripts benchmarks/adapters.sh install setup model
#   OUT=$OUT benchmarks/adapters.sh prepare
#   OUT=$OUT ROUND=1 benchmarks/adapters.sh round
#   OUT=$OUT ROUND=2 benchmarks/adapters.sh round
#   OUT=$OUT ROUND=3 benchmarks/adapters.sh round new summary stop
# $OUT is each call's own folder: the raw files are written to $LOGS/res (the warm machine's /tmp) and
# copied to $OUT, so that `summary` in the last call reads every round's.
# Outputs in $OUT (raw): summary.txt (every result line of that call), create.json, new.json,
# r{N}-{nolora,launch}.json (benchmarks/adapters_load.py load rows), table.json, {config}.log.gz.
#
# Dry run on the stand-in (CPU, no GPU: tests/bin/vllm serves --lora-modules and refuses runtime LoRA
# with several API servers as vLLM does; a model dir with a config.json, adapters made with torch):
#   export PATH=$PWD/tests/bin:$PATH FAKE_VLLM_PYTHON=$PWD/.venv/bin/python PY=$PWD/.venv/bin/python \
#     NO_GPU=1 MODEL=/tmp/ad-tiny LEVELS=8 REQS=2 OUT=/tmp/ad-out LOGS=/tmp/ad-logs \
#     VLLAMA_EXTRA="--cpus 8 --vllm-executable $PWD/tests/bin/vllm --crash-loop-limit 2"
#   benchmarks/adapters.sh model prepare; ROUND=1 benchmarks/adapters.sh round new summary stop
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device} MODEL=${MODEL:-/tmp/model}
RES=$LOGS/res
mkdir -p "$OUT" "$LOGS" "$RES"
[ -n "${FAKE_VLLM_PYTHON:-}" ] || PATH=/tmp/site/bin:$PATH  # the stand-in's tests/bin/vllm stays first on a dry run
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
PY=${PY:-python3} PORT=${PORT:-11434} URL=http://127.0.0.1:${PORT:-11434} ROUND=${ROUND:-1}
LEVELS=${LEVELS:-256} REQS=${REQS:-8} CONFIGS=${CONFIGS:-nolora launch}
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
gpu() { command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1 || echo "no GPU"; }
stop_vllama() {
  [ -f "$LOGS/vllama.pid" ] || return 0
  local pid; pid=$(cat "$LOGS/vllama.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 240); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -f "$LOGS/vllama.pid"
  local cfg; cfg=$(cat "$LOGS/config" 2>/dev/null || echo none)
  [ -f "$LOGS/$cfg.log" ] && gzip -c "$LOGS/$cfg.log" > "$OUT/$cfg.log.gz"
}
vllm_lines() {  # log: the vLLM command lines, the adapter mode, and vLLM's compile-cache lines of this log
  grep -a '"launched"\|"lora_mode"\|"draining"' "$1" | cut -c1-600 | sed 's/^/    /' | tee -a "$OUT/summary.txt"
  grep -aE 'torch.compile takes|Compiling a graph|Directly load the compiled graph|init engine .* took|Graph capturing finished' "$1" \
    | sed 's/.*"line":"//; s/"}$//' | cut -c1-200 | sed 's/^/    vllm: /' | tee -a "$OUT/summary.txt"
}
serve() {  # config: (re)start vllama for it and wait until the base is ready
  stop_vllama
  local state=$LOGS/state-$1 flags=""
  case $1 in
    nolora) ;;
    launch) flags="--adapters launch" ;;
    runtime) state=$LOGS/state-launch flags="--adapters runtime" ;;
    *) log "unknown config $1"; exit 2 ;;
  esac
  echo "$1" > "$LOGS/config"
  curl -s -o /dev/null "$URL/" && { log "port $PORT is taken by another server"; exit 1; }
  VLLAMA_STATE_DIR=$state setsid $PY -m vllama_proxy serve --model "$MODEL" --served-model-name base --port "$PORT" \
    --keep-alive -1 --log-format json $flags ${NO_GPU:+--no-gpu-check} ${VLLAMA_EXTRA:-} > "$LOGS/$1.log" 2>&1 < /dev/null &
  echo $! > "$LOGS/vllama.pid"
  local t; t=$(date +%s)
  for _ in $(seq 1200); do
    state=$(curl -s "$URL/readyz" | $PY -c 'import json,sys; print(json.load(sys.stdin).get("state"))' 2>/dev/null)
    [ "$state" = ready ] && break
    [ "$state" = failed ] && { log "vLLM ($1) failed: $(curl -s "$URL/readyz" | head -c 2000)"; stop_vllama; exit 1; }
    kill -0 "$(cat "$LOGS/vllama.pid")" 2>/dev/null || { log "vllama ($1) exited"; tail -30 "$LOGS/$1.log"; exit 1; }
    sleep 0.5
  done
  log "$1: vllama and vLLM up in $(( $(date +%s) - t )) s; GPU $(gpu); $(curl -s "$URL/readyz" | head -c 400)"
}
names() { [ "$1" = nolora ] || echo lora0 lora1 lora2 lora3; }

for phase in "$@"; do case $phase in
install) "$DEV/install-vllm.sh" install || exit 1 ;;
setup)
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  log "vllm $($PY -c 'import vllm; print(vllm.__version__)' 2>/dev/null); $(nproc) CPUs; GPU: $(nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null)"
  ;;
model)
  t=$(date +%s)
  [ -f "$MODEL/config.json" ] || $PY "$DEV/make_random_model.py" "$MODEL" > /dev/null || exit 1
  $PY benchmarks/make_random_lora.py "$MODEL" /tmp/loras --count 5 --rank 16 | tee -a "$OUT/summary.txt" || exit 1
  log "model and 5 adapters in $(( $(date +%s) - t )) s"
  ;;
prepare)
  rm -rf "$LOGS/state-launch" "$LOGS/state-nolora" "$RES"/*.json
  serve launch
  $PY benchmarks/adapters_load.py create "$URL" base /tmp/loras/lora0 /tmp/loras/lora1 /tmp/loras/lora2 /tmp/loras/lora3 \
    --json "$RES/create.json" 2>&1 | tee -a "$OUT/summary.txt"
  cp "$RES/create.json" "$OUT/"
  log "GPU after the adapters: $(gpu)"
  vllm_lines "$LOGS/launch.log"
  stop_vllama
  ;;
round)
  order=$CONFIGS; [ $(( ROUND % 2 )) -eq 0 ] && order=$(echo $CONFIGS | tr ' ' '\n' | tac | tr '\n' ' ')
  for cfg in $order; do
    serve "$cfg"
    mixes=base,mixed; [ "$cfg" = nolora ] && mixes=base
    $PY benchmarks/adapters_load.py load "$URL" base $(names "$cfg") --levels "$LEVELS" --mixes "$mixes" \
      --requests-per-stream "$REQS" --tag round=$ROUND --tag config=$cfg --json "$RES/r$ROUND-$cfg.json" 2>&1 | tee -a "$OUT/summary.txt"
    cp "$RES/r$ROUND-$cfg.json" "$OUT/"
    [ "$ROUND" = 1 ] && vllm_lines "$LOGS/$cfg.log"
    stop_vllama
  done
  ;;
new)
  serve launch
  # lora3 deleted first (no restart: vLLM keeps serving what it declared), so that lora4 makes 4 adapters
  # again: --max-loras stays 4 and the compile cache's key with it (5 would make it 8, a new key)
  $PY -c "import ollama, sys; ollama.Client(host=sys.argv[1]).delete('lora3')" "$URL" || exit 1
  $PY benchmarks/adapters_load.py create "$URL" base /tmp/loras/lora4 --start 4 --json "$RES/new.json" 2>&1 | tee -a "$OUT/summary.txt"
  cp "$RES/new.json" "$OUT/"
  vllm_lines "$LOGS/launch.log"
  stop_vllama
  ;;
summary)
  $PY benchmarks/adapters_load.py table "$RES"/r*-*.json --json "$OUT/table.json" 2>&1 | tee -a "$OUT/summary.txt"
  cp "$RES"/*.json "$OUT/"
  $PY - "$RES" <<'PY' | tee -a "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = [r for f in ("create.json", "new.json") if (out / f).exists() for r in json.loads((out / f).read_text())]
print("\n| adapter | upload (s) | create (s) | first answer (s) | create to first answer (s) | what vllama did |\n|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['adapter']} | {r['upload_s']} | {r['create_s']} | {r['first_answer_s']} | {r['create_to_first_answer_s']} | {next((x for x in r['status'] if x.startswith(('restarted', 'loaded', 'the adapter'))), '')} |")
PY
  ;;
stop)
  stop_vllama
  log "stopped; left: $(pgrep -fc 'vllm serve|VLLM::' || true) vLLM processes; GPU $(gpu)"
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac; done
