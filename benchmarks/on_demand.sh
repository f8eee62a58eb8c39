#!/usr/bin/env bash
# Issue 22 on the lent GPU: local models started on demand by the real `ollama` client, with the real vLLM.
# From the repo root, in phases (the server is started with setsid and outlives one device call while
# the machine stays warm, so the phases may be split over calls).
#
# Prerequisites as benchmarks/ttft_c1.sh: the vLLM wheel chunks stashed by earlier calls
# (`$DEV/install-vllm.sh stash`, one chunk of .whl-cache/chunks each); the call with `install` carries
# the last chunk, $DEV (a copy of shared/device) and .whl (vllama's deps the image lacks).
#
#   install  $DEV/install-vllm.sh install
#   setup    .whl into /tmp/vsite
#   models   a Qwen2.5-1.5B-shaped (make_random_model.py) and a Llama-3.2-1B-shaped random model
#            (benchmarks/on_demand_models.py), placed in $HUB as Qwen/Qwen2.5-1.5B-Instruct and
#            meta-llama/Llama-3.2-1B-Instruct, as `vllama pull qwen2.5:1.5b` / `llama3.2:1b` leave them;
#            meta-llama/Llama-3.3-70B-Instruct as a config and a header claiming 70.6 B parameters
#   start    `vllama serve` with no model configured (vllama's defaults, keep_alive forever)
#   list     /api/tags and /api/ps before anything ran
#   swap     the real ollama client asks qwen2.5:1.5b, llama3.2:1b, qwen2.5:1.5b (16 tokens each): each
#            is started on demand, the one before stopped for GPU room (vLLM's default 0.9 of the GPU each)
#   swap-sleep  with VLLM_ARGS=--enable-sleep-mode given to start: A, B, A, B, A (the later visits wake)
#   tools    a chat with a tool to qwen2.5:1.5b (its library arguments turn tool calling on); show
#   refuse   llama3.3:70b: refused by the fit check with its numbers, nothing launched
#   stop     SIGTERM, leftover processes, GPU memory
#   model    `vllama serve --model qwen2.5:1.5b`: the library name resolved at start (repo, served name,
#            tool flags in the argv), a tool chat; then stopped
# Outputs in $OUT: summary.txt (every result line), vllama.log.gz, model.log.gz.
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device}
HUB=${HUB:-/tmp/hf/hub} URL=http://127.0.0.1:11434
mkdir -p "$OUT" "$LOGS" "$HUB"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state HF_HOME=$(dirname "$HUB") HF_HUB_CACHE=$HUB
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
client() { python3 benchmarks/on_demand_client.py $URL "$@" 2>&1 | tee -a "$OUT/summary.txt"; }
gpu() { nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1; }
wait_ready() {  # pid seconds
  for _ in $(seq $(( $2 * 2 ))); do
    curl -sf $URL/readyz > /dev/null && return 0
    kill -0 "$1" 2>/dev/null || { log "vllama exited"; return 1; }
    sleep 0.5
  done
  log "not ready after $2 s"; return 1
}
events() {  # the supervisor's own account: claims, evictions, starts, stops, fit verdicts
  python3 - "$1" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    try: e = json.loads(line)
    except ValueError: continue
    ev = e.get("event")
    if ev in ("on_demand", "on_demand_claim", "on_demand_model", "evicting", "ready", "vllm_stopped", "fit_estimate", "model_does_not_fit") \
            or (ev == "state" and e.get("to") in ("starting", "ready", "unloaded")):
        keep = {k: v for k, v in e.items() if k not in ("level", "component", "request_id")}
        print("   ", json.dumps(keep)[:400])
EOF
}

for phase in "$@"; do case $phase in
install) "$DEV/install-vllm.sh" install || exit 1 ;;
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null); $(nproc) CPUs; GPU: $(nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader)"
  ;;
models)
  t=$(date +%s)
  python3 "$DEV/make_random_model.py" /tmp/qwen-src > /dev/null && python3 benchmarks/on_demand_models.py llama /tmp/llama-src --tokenizer-from /tmp/qwen-src \
    && python3 benchmarks/on_demand_models.py place /tmp/qwen-src "$HUB" Qwen/Qwen2.5-1.5B-Instruct \
    && python3 benchmarks/on_demand_models.py place /tmp/llama-src "$HUB" meta-llama/Llama-3.2-1B-Instruct \
    && python3 benchmarks/on_demand_models.py huge "$HUB" meta-llama/Llama-3.3-70B-Instruct || exit 1
  log "models made and placed in $(( $(date +%s) - t )) s: $(du -shL "$HUB" | cut -f1)"
  ;;
start)
  # VLLM_ARGS: vLLM arguments for every on-demand model (after --), e.g. --enable-sleep-mode
  setsid python3 -m vllama_proxy serve --keep-alive -1 --log-format json ${VLLM_ARGS:+-- $VLLM_ARGS} > $LOGS/vllama.log 2>&1 < /dev/null &
  echo $! > $LOGS/pid
  wait_ready "$(cat $LOGS/pid)" 60 || { tail -30 $LOGS/vllama.log; exit 1; }
  log "vllama up with no model configured: $(curl -s $URL/readyz)"
  ;;
list) client list ;;
llama)  # the Llama-shaped model again (the first run's tokenizer lacked <|python_tag|>: vLLM's llama3_json parser failed)
  python3 benchmarks/on_demand_models.py llama /tmp/llama-src --tokenizer-from "$(echo "$HUB"/models--Qwen--Qwen2.5-1.5B-Instruct/snapshots/*)" \
    && python3 benchmarks/on_demand_models.py place /tmp/llama-src "$HUB" meta-llama/Llama-3.2-1B-Instruct || exit 1 ;;
swap)
  log "GPU before: $(gpu)"
  client ask qwen2.5:1.5b llama3.2:1b qwen2.5:1.5b
  log "GPU after: $(gpu)"
  ;;
swap-sleep)  # with VLLM_ARGS=--enable-sleep-mode at start: the second visit of each is a wake
  log "GPU before: $(gpu)"
  client ask qwen2.5:1.5b llama3.2:1b qwen2.5:1.5b llama3.2:1b qwen2.5:1.5b
  log "GPU after: $(gpu)"
  ;;
tools)
  client tools qwen2.5:1.5b
  client show qwen2.5:1.5b
  ;;
refuse)
  client refuse llama3.3:70b
  client list
  ;;
stop)
  kill -TERM "$(cat $LOGS/pid)"; for _ in $(seq 240); do kill -0 "$(cat $LOGS/pid)" 2>/dev/null || break; sleep 0.5; done
  log "stopped; left: $(pgrep -fc 'vllm serve|VLLM::' || true) vLLM processes; GPU $(gpu)"
  events $LOGS/vllama.log
  gzip -c $LOGS/vllama.log > "$OUT/vllama.log.gz"
  ;;
model)
  setsid python3 -m vllama_proxy serve --model qwen2.5:1.5b --keep-alive -1 --log-format json > $LOGS/model.log 2>&1 < /dev/null &
  pid=$!
  t=$(date +%s)
  wait_ready $pid 400 || { tail -30 $LOGS/model.log; exit 1; }
  log "serve --model qwen2.5:1.5b ready in $(( $(date +%s) - t )) s"
  python3 - $LOGS/model.log <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    if '"launched"' in line or '"library_model"' in line:
        e = json.loads(line); print("   ", json.dumps({k: e[k] for k in ("event", "argv", "library", "repo", "vllm_args") if k in e}))
EOF
  client show qwen2.5:1.5b
  client tools qwen2.5:1.5b
  kill -TERM $pid; for _ in $(seq 240); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  log "stopped; GPU $(gpu)"
  gzip -c $LOGS/model.log > "$OUT/model.log.gz"
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac; done
