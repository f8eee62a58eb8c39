#!/usr/bin/env bash
# Does vLLM refuse a second instance at 0.5 of a GPU beside one at 0.5 (issue 7, --gpu-context-share)?
#   raw:    `vllm serve` A at 0.5, then B at 0.5 on the same GPU: B's fate and its error line.
#   vllama: the same two models in a vllama config, both preloaded: the pool keeps B unloaded.
# Prerequisites as benchmarks/gpu_run.sh (vLLM in /tmp/site, deps in /tmp/vsite, /tmp/model).
# Usage: OUT=dir benchmarks/context_share_check.sh
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 \
  VLLAMA_STATE_DIR=/tmp/vllama-state
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
gpu() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | head -1; }
[ -d /tmp/model2 ] || cp -r /tmp/model /tmp/model2

log "raw: GPU before $(gpu)"
setsid vllm serve /tmp/model --host 127.0.0.1 --port 8101 --max-model-len 4096 --gpu-memory-utilization 0.5 > /tmp/raw-a.log 2>&1 < /dev/null &
A=$!
for i in $(seq 600); do curl -sf http://127.0.0.1:8101/health > /dev/null && break; kill -0 $A 2>/dev/null || break; sleep 0.5; done
log "raw: A (0.5) ready=$(curl -sf -o /dev/null -w '%{http_code}' http://127.0.0.1:8101/health); GPU $(gpu)"
setsid vllm serve /tmp/model2 --host 127.0.0.1 --port 8102 --max-model-len 4096 --gpu-memory-utilization 0.5 > /tmp/raw-b.log 2>&1 < /dev/null &
B=$!
for i in $(seq 600); do curl -sf http://127.0.0.1:8102/health > /dev/null && break; kill -0 $B 2>/dev/null || break; sleep 0.5; done
if kill -0 $B 2>/dev/null && curl -sf http://127.0.0.1:8102/health > /dev/null; then
  log "raw: B (0.5) beside A: READY; GPU $(gpu)"
else
  log "raw: B (0.5) beside A: exited ($(wait $B; echo code $?)); its error:"
  grep -E "Free memory|memory utilization|Error|error" /tmp/raw-b.log | grep -v "^\s*$" | tail -4 | cut -c1-300 | sed 's/^/    /'
fi
kill -TERM -$A -$B 2>/dev/null; for i in $(seq 120); do kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null || break; sleep 0.5; done
sleep 3; log "raw: stopped; GPU $(gpu)"

printf '%s\n' 'keep_alive = "-1"' '[[models]]' 'model = "/tmp/model"' 'name = "qwen-a"' 'gpu_memory_utilization = 0.5' \
  'max_model_len = 4096' '[[models]]' 'model = "/tmp/model2"' 'name = "qwen-b"' 'gpu_memory_utilization = 0.5' 'max_model_len = 4096' > /tmp/ctx.toml
setsid python3 -m vllama_proxy serve --config /tmp/ctx.toml --log-format json > /tmp/ctx.log 2>&1 < /dev/null &
V=$!
for i in $(seq 600); do
  s=$(curl -s http://127.0.0.1:11434/readyz | python3 -c 'import json,sys; print(" ".join(m["model"]+"="+m["state"] for m in json.load(sys.stdin)["models"]))' 2>/dev/null)
  [ "$s" = "qwen-a=ready qwen-b=unloaded" ] && break; sleep 0.5
done
log "vllama: $s; GPU $(gpu)"
curl -s http://127.0.0.1:11434/readyz | python3 -c 'import json,sys; [print("    ", m["model"], m["state"], m["last_error"]) for m in json.load(sys.stdin)["models"]]'
log "vllama: request for qwen-b: $(curl -s -o /dev/null -w '%{time_total} s %{http_code}' http://127.0.0.1:11434/api/generate -d '{"model":"qwen-b","prompt":"hi","stream":false,"options":{"num_predict":8}}')"
curl -s http://127.0.0.1:11434/readyz | python3 -c 'import json,sys; [print("    ", m["model"], m["state"]) for m in json.load(sys.stdin)["models"]]'
kill -TERM $V; for i in $(seq 240); do kill -0 $V 2>/dev/null || break; sleep 0.5; done
log "vllama: stopped; GPU $(gpu)"
gzip -c /tmp/raw-b.log > "$OUT/raw-b.log.gz"; gzip -c /tmp/ctx.log > "$OUT/ctx.log.gz"
