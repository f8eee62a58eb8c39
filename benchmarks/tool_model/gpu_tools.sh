#!/usr/bin/env bash
# Issue 13 on the lent GPU, in one device call from the repo root (about 6 minutes):
#   1. train.py: the tiny Qwen2 tool model -> /tmp/toolmodel (an untrained copy of the same shape
#      -> /tmp/toolembed at once, for the pooling server)
#   2. meanwhile: vllama serve --model /tmp/toolembed -- --runner pooling   (:11435, vLLM on :8200)
#   3. vllama serve --model /tmp/toolmodel -- --enable-auto-tool-choice --tool-call-parser hermes
#      --reasoning-parser qwen3   (:11434, vLLM on :8100)
#   4. e2e_tools.py: the real ollama client and langchain-ollama through vllama -> $OUT/e2e_tools.json
#   5. record.py against vLLM's private ports -> $OUT/fixtures/*.json (copy to tests/fixtures/vllm-0.26/)
#   6. SIGTERM both vllamas (each stops its vLLM's process group); GPU memory must read 0
#
# Prerequisites (as benchmarks/gpu_run.sh): vLLM 0.26 in /tmp/site (shared/device/install-vllm.sh),
# vllama's missing deps in /tmp/vsite; the client wheels of benchmarks/tool_model/device-wheels.txt either there
# already or carried in .whl/tool-wheels/ (installed into /tmp/vsite first).
# Knobs: OUT (/tmp/gpu-out), TRAIN_MINUTES (3), TRAIN_ARGS (more train.py args), REASONING_PARSER (qwen3),
# VLLM_EXTRA (more vLLM args), VLLAMA_FLAGS (more vllama flags). A CPU dry run with the stand-in:
#   PATH=$PWD/tests/bin:$PATH VLLAMA_FLAGS=--no-gpu-check TRAIN_ARGS="--steps 30 --batch 8 --samples 2000 --eval-n 4" \
#   benchmarks/tool_model/gpu_tools.sh
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=/tmp/gpu-logs
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ulimit -n "$(ulimit -Hn)"
T0=$(date +%s)
log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
wait_ready() {  # url pid-file seconds
  local t0; t0=$(date +%s)
  until curl -sf "$1/readyz" > /dev/null; do
    if ! kill -0 "$(cat "$2")" 2>/dev/null; then log "$1: vllama exited"; return 1; fi
    if (( $(date +%s) - t0 > $3 )); then log "$1 not ready after $3 s: $(curl -s "$1/readyz")"; return 1; fi
    sleep 0.5
  done
  log "$1 ready after $(( $(date +%s) - t0 )) s"
}
vllama() {  # name port vllm-port model [-- vllm args]
  local name=$1 port=$2 vport=$3 model=$4; shift 4
  setsid python3 -m vllama_proxy serve --model "$model" --served-model-name "$name" --vllm-port "$vport" --port "$port" \
    --workers 1 --log-format json --keep-alive -1 --state-dir "/tmp/vllama-state-$name" ${VLLAMA_FLAGS:-} "$@" \
    > "$LOGS/vllama-$name.log" 2>&1 < /dev/null &
  echo $! > "/tmp/vllama-$name.pid"
}
stop_all() {
  for name in toolmodel toolembed; do
    f=/tmp/vllama-$name.pid; [ -f "$f" ] || continue
    pid=$(cat "$f"); kill -0 "$pid" 2>/dev/null || continue
    log "SIGTERM to vllama $name ($pid)"; kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { log "vllama $name still running: SIGKILL to its group"; kill -KILL -- "-$pid"; }
  done
  sleep 1
  log "GPU memory used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
  for name in toolmodel toolembed; do [ -f "$LOGS/vllama-$name.log" ] && gzip -c "$LOGS/vllama-$name.log" > "$OUT/vllama-$name.log.gz"; done
}
trap stop_all EXIT

if ls .whl/tool-wheels/*.whl > /dev/null 2>&1; then  # carried client wheels (device-wheels.txt)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite --upgrade .whl/tool-wheels/*.whl 2>&1 | grep -v "^WARNING" | tail -3
fi
log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null), ollama $(python3 -c 'import importlib.metadata as m; print(m.version("ollama"))' 2>&1 | tail -1), langchain-ollama $(python3 -c 'import importlib.metadata as m; print(m.version("langchain-ollama"))' 2>&1 | tail -1), GPU: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader)"

# 1 + 2: train; the pooling server starts on the untrained copy as soon as it exists
rm -rf /tmp/toolmodel /tmp/toolembed /tmp/vllama-toolmodel.pid /tmp/vllama-toolembed.pid
python3 benchmarks/tool_model/train.py /tmp/toolmodel --init-dir /tmp/toolembed --minutes "${TRAIN_MINUTES:-3}" ${TRAIN_ARGS:-} \
  > "$OUT/train.log" 2>&1 &
TRAIN=$!
for _ in $(seq 240); do [ -f /tmp/toolembed/model.safetensors ] && break; kill -0 $TRAIN 2>/dev/null || break; sleep 0.5; done
if [ -f /tmp/toolembed/model.safetensors ]; then
  log "untrained copy saved: starting the pooling vLLM under vllama"
  vllama toolembed 11435 8200 /tmp/toolembed -- --runner pooling --convert embed --max-model-len 2048 \
    --gpu-memory-utilization 0.15 --enforce-eager --api-server-count 1
fi
wait $TRAIN; rc=$?
grep -E "tokenizer|params|held-out|wrong|saved|budget|stopping" "$OUT/train.log" | tail -20
log "train.py exit $rc"
cp /tmp/toolmodel/train_report.json "$OUT/" 2>/dev/null
[ -f /tmp/toolmodel/model.safetensors ] || { log "no model: stop"; tail -30 "$OUT/train.log"; exit 1; }
ls -la /tmp/toolmodel; cat /tmp/toolmodel/config.json | tr -d '\n ' | head -c 600; echo

# 3: the tool model with vLLM's own parsers
vllama toolmodel 11434 8100 /tmp/toolmodel -- --enable-auto-tool-choice --tool-call-parser hermes \
  --reasoning-parser "${REASONING_PARSER:-qwen3}" --max-model-len 2048 --gpu-memory-utilization 0.5 --enforce-eager --api-server-count 1 ${VLLM_EXTRA:-}
wait_ready http://127.0.0.1:11434 /tmp/vllama-toolmodel.pid 300 || { tail -40 "$LOGS/vllama-toolmodel.log"; exit 1; }
EMBED_ARGS=()
if [ -f /tmp/vllama-toolembed.pid ] && wait_ready http://127.0.0.1:11435 /tmp/vllama-toolembed.pid 120; then
  EMBED_ARGS=(--embed-url http://127.0.0.1:11435 --embed-model toolembed)
else
  tail -20 "$LOGS/vllama-toolembed.log" 2>/dev/null
fi

# 4: the transcript
log "e2e: ollama client + langchain-ollama through vllama"
timeout 120 python3 benchmarks/tool_model/e2e_tools.py --url http://127.0.0.1:11434 --model toolmodel "${EMBED_ARGS[@]}" \
  --out "$OUT/e2e_tools.json" 2>&1 | tee "$OUT/e2e_tools.out" | cut -c1-400

# 5: real vLLM bytes
log "record.py against vLLM directly"
REC=(--url http://127.0.0.1:8100 --model toolmodel)
[ ${#EMBED_ARGS[@]} -gt 0 ] && REC+=(--embed-url http://127.0.0.1:8200 --embed-model toolembed)
timeout 120 python3 benchmarks/tool_model/record.py "${REC[@]}" --out "$OUT/fixtures" 2>&1 | tee "$OUT/record.out" | cut -c1-300
log "/api/ps: $(curl -s http://127.0.0.1:11434/api/ps | head -c 400)"
grep -hE "tool|reasoning|parser|Traceback|Error" "$LOGS"/vllama-toolmodel.log | grep -v '"GET ' | tail -15 | cut -c1-400
log "done; stopping"
