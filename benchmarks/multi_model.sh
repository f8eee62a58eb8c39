#!/usr/bin/env bash
# Several models on one GPU through vllama (issue 7), with the real `vllm serve`:
#   swap: two models that do not fit together (0.6 + 0.6 of the GPU) are swapped on demand:
#         the least recently used one is put to sleep (vLLM sleep mode level 1) and the other
#         woken or, the first time, cold-started. Times each request that needed a swap.
#   side: two models that fit (0.4 + 0.4) serve side by side; concurrent requests to both.
# Prerequisites as benchmarks/gpu_run.sh (vLLM in /tmp/site, deps in /tmp/vsite, /tmp/model).
# Usage: OUT=dir benchmarks/multi_model.sh [swap] [side]
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 \
  VLLAMA_STATE_DIR=/tmp/vllama-state
URL=http://127.0.0.1:11434
PHASES=${*:-swap side}
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
states() { curl -s $URL/readyz | python3 -c 'import json,sys; print(" ".join(m["model"]+"="+m["state"] for m in json.load(sys.stdin)["models"]))' 2>/dev/null; }
wait_states() { for i in $(seq 1200); do [ "$(states)" = "$1" ] && return 0; sleep 0.25; done; log "never reached: $1 (now: $(states))"; return 1; }
gen() {  # $1 model: prints "<wall s> <http status>" of one 16-token request
  curl -s -o /dev/null -w '%{time_total} %{http_code}' $URL/api/generate \
    -d "{\"model\":\"$1\",\"prompt\":\"Once upon a time\",\"stream\":false,\"options\":{\"num_predict\":16,\"ignore_eos\":true}}"
}
gpu() { nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1; }
[ -d /tmp/model2 ] || cp -r /tmp/model /tmp/model2  # a second model directory (same random weights)

start() {  # $1 name of the run, $2 config text
  printf '%s\n' "$2" > "/tmp/$1.toml"
  setsid python3 -m vllama_proxy serve --config "/tmp/$1.toml" --log-format json > "/tmp/$1.log" 2>&1 < /dev/null &
  PID=$!
}
finish() {  # $1 name of the run
  kill -TERM $PID; for i in $(seq 240); do kill -0 $PID 2>/dev/null || break; sleep 0.5; done
  log "[$1] stopped; GPU $(gpu)"
  gzip -c "/tmp/$1.log" > "$OUT/$1.log.gz"
}

for phase in $PHASES; do
  if [ "$phase" = swap ]; then
    start swap 'keep_alive = "-1"
health_interval = 1
[[models]]
model = "/tmp/model"
name = "qwen-a"
gpu_memory_utilization = 0.6
max_model_len = 4096
sleep_mode = true
[[models]]
model = "/tmp/model2"
name = "qwen-b"
gpu_memory_utilization = 0.6
max_model_len = 4096
sleep_mode = true
preload = false'
    t0=$(date +%s.%N)
    wait_states "qwen-a=ready qwen-b=unloaded" || { tail -40 /tmp/swap.log; exit 1; }
    log "[swap] qwen-a cold start: $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s; GPU $(gpu)"
    log "[swap] qwen-a warm request: $(gen qwen-a)"
    log "[swap] qwen-b first request (qwen-a to sleep + qwen-b cold start): $(gen qwen-b); $(states); GPU $(gpu)"
    log "[swap] qwen-b warm request: $(gen qwen-b)"
    for round in 1 2 3; do
      log "[swap] round $round qwen-a (qwen-b to sleep + qwen-a wake): $(gen qwen-a); $(states); GPU $(gpu)"
      log "[swap] round $round qwen-a warm: $(gen qwen-a)"
      log "[swap] round $round qwen-b (qwen-a to sleep + qwen-b wake): $(gen qwen-b); $(states); GPU $(gpu)"
    done
    finish swap
    zcat "$OUT/swap.log.gz" | python3 -c '
import json, sys
for line in sys.stdin:
    try: e = json.loads(line)
    except ValueError: continue
    if e.get("event") in ("woke_up", "ready", "evicting") or (e.get("event") == "state" and e.get("to") in ("sleeping", "ready", "starting")):
        print("   ", e.get("timestamp", ""), e.get("event"), e.get("model"), e.get("to", ""), e.get("reason", ""), e.get("seconds", ""), e.get("startup_s", ""))'
  fi
  if [ "$phase" = side ]; then
    start side 'keep_alive = "-1"
[[models]]
model = "/tmp/model"
name = "qwen-a"
gpu_memory_utilization = 0.4
max_model_len = 4096
[[models]]
model = "/tmp/model2"
name = "qwen-b"
gpu_memory_utilization = 0.4
max_model_len = 4096'
    t0=$(date +%s.%N)
    wait_states "qwen-a=ready qwen-b=ready" || { tail -40 /tmp/side.log; exit 1; }
    log "[side] both ready (started together): $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s; GPU $(gpu)"
    curl -s $URL/api/ps | python3 -c 'import json,sys; [print("    ps:", m["name"], "size_vram", m["size_vram"]) for m in json.load(sys.stdin)["models"]]'
    log "[side] one request each, sequential: a $(gen qwen-a), b $(gen qwen-b)"
    python3 - <<'EOF'
import asyncio, time, aiohttp
URL = "http://127.0.0.1:11434/api/generate"
async def one(s, model):
    body = {"model": model, "prompt": "Once upon a time", "stream": False, "options": {"num_predict": 128, "ignore_eos": True}}
    async with s.post(URL, json=body) as r:
        d = await r.json()
        return r.status, d.get("eval_count", 0)
async def run(models, n):
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(s, models[i % len(models)]) for i in range(n)))
        dt = time.perf_counter() - t0
        ok = sum(1 for st, _ in res if st == 200); toks = sum(t for _, t in res)
        print(f"    {n} concurrent x 128 tokens over {','.join(models)}: {ok}/{n} ok, {dt:.2f} s, {toks / dt:.0f} output tokens/s")
for models in (["qwen-a"], ["qwen-b"], ["qwen-a", "qwen-b"]):
    asyncio.run(run(models, 64))
EOF
    finish side
    zcat "$OUT/side.log.gz" | python3 -c '
import json, sys
for line in sys.stdin:
    try: e = json.loads(line)
    except ValueError: continue
    text = e.get("line", "")
    if "KV cache" in text or "non-torch memory" in text or (e.get("event") == "state" and e.get("to") in ("starting", "ready")):
        print("   ", e.get("timestamp", ""), e.get("model"), e.get("event"), e.get("to", ""), text[-150:])'
  fi
done
log "done"
