#!/usr/bin/env bash
# The whole GPU run of issue 4, on the lent H200 (device tool), from the repo root.
# Prerequisites on the device (see benchmarks/README.md "GPU run"): vLLM installed into
# /tmp/site (shared/device/install-vllm.sh), vllama's missing deps into /tmp/vsite, and
# the random-weight model in /tmp/model (shared/device/make_random_model.py).
#
#   vllama serve --model /tmp/model  (the supervisor launching the real `vllm serve`)
#   -> e2e transcript with the real ollama client (benchmarks/e2e_ollama.py)
#   -> concurrency sweep, proxy (Ollama NDJSON) vs direct vLLM (SSE), alternating
#   -> 5,000-request burst through the proxy and direct
#   -> `vllm bench serve` against the proxy's /v1 and against vLLM directly
#   -> SIGTERM: drain, stop vLLM's group, GPU memory back to 0
#
# Usage: OUT=dir benchmarks/gpu_run.sh   (PARTS="e2e sweep burst bench" to choose)
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
PARTS=${PARTS:-"e2e sweep burst bench"}
PROXY=http://127.0.0.1:11434 DIRECT=http://127.0.0.1:8100 SERVED=qwen-random
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null), GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader)"
t0=$(date +%s.%N)
setsid python3 -m vllama_proxy serve --model /tmp/model --served-model-name $SERVED \
  --alias qwen2.5:1.5b=$SERVED --vllm-port 8100 --port 11434 --log-format json \
  -- --max-model-len 4096 --gpu-memory-utilization 0.85 > "$OUT/vllama.log" 2>&1 &
pid=$!
log "vllama serve pid $pid; first answers while vLLM loads:"
sleep 3
curl -s -w ' [%{http_code}]\n' $PROXY/api/tags; curl -s -w ' [%{http_code}]\n' $PROXY/readyz
until curl -sf $PROXY/readyz > /dev/null; do
  if ! kill -0 $pid 2>/dev/null; then log "vllama exited"; tail -50 "$OUT/vllama.log"; exit 1; fi
  if awk "BEGIN{exit !($(date +%s.%N) - $t0 > 480)}"; then log "not ready after 480 s"; curl -s $PROXY/readyz; kill -TERM $pid; exit 1; fi
  sleep 0.5
done
log "ready after $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s: $(curl -s $PROXY/readyz)"

case " $PARTS " in *" e2e "*)
  log "e2e transcript (ollama client)"
  python3 benchmarks/e2e_ollama.py --url $PROXY --model qwen2.5:1.5b --out "$OUT/e2e.json"
  curl -s $PROXY/api/ps; echo
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$OUT/nvidia-smi.txt"
  ;; esac

case " $PARTS " in *" sweep "*)
  log "sweep: proxy vs direct, alternating"
  python3 benchmarks/loadgen.py --targets proxy=ollama:$PROXY,direct=openai:$DIRECT --model $SERVED \
    --levels "${LEVELS:-1,10,64,256,1024}" --output-tokens 128 --prompt-words 128 --warmup 16 --raise-nofile \
    --procs "${PROCS:-4}" --json "$OUT/sweep.json"
  ;; esac

case " $PARTS " in *" burst "*)
  for tgt in proxy=ollama:$PROXY direct=openai:$DIRECT; do
    log "burst ${BURST:-5000}: $tgt"
    python3 benchmarks/loadgen.py --targets $tgt --model $SERVED --burst "${BURST:-5000}" --output-tokens 128 \
      --prompt-words 128 --warmup 0 --raise-nofile --procs "${PROCS:-4}" --json "$OUT/burst-${tgt%%=*}.json"
  done
  ;; esac

case " $PARTS " in *" bench "*)
  for base in $PROXY $DIRECT; do
    log "vllm bench serve --base-url $base"
    timeout 240 vllm bench serve --backend openai --base-url $base --endpoint /v1/completions --model $SERVED \
      --tokenizer /tmp/model --dataset-name random --random-input-len 128 --random-output-len 128 \
      --num-prompts 1024 --max-concurrency 256 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el \
      --metric-percentiles 50,90,99 --save-result --result-dir "$OUT" --result-filename "vllm-bench-$(echo $base | tr -dc 0-9 | tail -c 5).json" 2>&1 \
      | grep -vE "it/s\]|^\s*$" | tail -40
  done
  ;; esac

log "SIGTERM to vllama (drain, stop vLLM's group)"
kill -TERM $pid
for i in $(seq 120); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
wait $pid; rc=$?
log "vllama exit code $rc; left in its session: $(ps -e -o sid=,pid=,comm= | awk -v s=$pid '$1==s' | wc -l); GPU used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
grep -c '"component": "vllm"\|"component":"vllm"' "$OUT/vllama.log" | xargs -I{} echo "vLLM log lines captured: {}"
