#!/usr/bin/env bash
# Issue 40 on the lent GPU, in one device call from the repo root (about 3 minutes):
#   1. vllama serve --model $MODEL (the shipped tool model) with NO parser flags: vllama must tell hermes
#      and qwen3 from its chat template (log line parsers_detected -> $OUT/parsers.json)
#   2. benchmarks/agents_replay.py: Claude Code's and Codex's request shapes (tests/fixtures/agents),
#      unstreamed and streamed, greedy -> $OUT/agents-greedy.json; then as the agents send them
#      (temperature 1) -> $OUT/agents-as-sent.json. Each line says which blocks came back.
#   3. think "max" and the three levels through /api/chat -> $OUT/think-levels.json (vLLM 0.26 may refuse "max")
#   4. SIGTERM vllama (it stops its vLLM's process group)
#
# Prerequisites (as benchmarks/gpu_run.sh): vLLM 0.26 in /tmp/site (shared/device/install-vllm.sh), vllama's
# missing deps in /tmp/vsite (httpx is all the replay needs). Knobs: OUT (/tmp/gpu-out), MODEL
# (tests/assets/tool-model), PORT (11434), VLLAMA_FLAGS (more vllama flags).
# A CPU dry run with the real vLLM for CPU of this venv:
#   PATH=$PWD/.venv/bin:$PATH VLLAMA_FLAGS="--no-gpu-check" VLLM_EXTRA="--max-model-len 2048 --kv-cache-memory-bytes 67108864" \
#   benchmarks/agents_gpu.sh
set -u
OUT=${OUT:-/tmp/gpu-out} MODEL=${MODEL:-tests/assets/tool-model} PORT=${PORT:-11434}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH \
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
URL=http://127.0.0.1:$PORT
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

setsid python3 -m vllama_proxy serve --model "$MODEL" --served-model-name toolmodel --port "$PORT" --workers 1 \
  --log-format json --keep-alive -1 --state-dir /tmp/vllama-state-agents ${VLLAMA_FLAGS:-} \
  ${VLLM_EXTRA:+-- $VLLM_EXTRA} > "$OUT/vllama-agents.log" 2>&1 &
PID=$!
t0=$(date +%s)
until curl -sf "$URL/readyz" > /dev/null; do
  kill -0 $PID 2>/dev/null || { log "vllama exited"; tail -30 "$OUT/vllama-agents.log"; exit 1; }
  (( $(date +%s) - t0 > 600 )) && { log "not ready after 600 s"; kill -TERM $PID; exit 1; }
  sleep 0.5
done
log "ready after $(( $(date +%s) - t0 )) s"
grep -h '"parsers_' "$OUT/vllama-agents.log" > "$OUT/parsers.json"; cat "$OUT/parsers.json"
python3 -c 'import vllm, sys; print("vllm", vllm.__version__)' | tee "$OUT/vllm-version.txt"

rc=0
python3 benchmarks/agents_replay.py --url "$URL" --model toolmodel --temperature 0 --out "$OUT/agents-greedy.json" || rc=1
python3 benchmarks/agents_replay.py --url "$URL" --model toolmodel --out "$OUT/agents-as-sent.json" || true  # sampled: informative
python3 - "$URL" > "$OUT/think-levels.json" <<'EOF'
import json, sys, httpx
out = {}
for think in (True, False, "low", "medium", "high", "max"):
    r = httpx.post(sys.argv[1] + "/api/chat", timeout=300, json={"model": "toolmodel", "stream": False, "think": think,
                   "options": {"temperature": 0}, "messages": [{"role": "user", "content": "Is 17 a prime number?"}]})
    body = r.json()
    out[str(think)] = {"status": r.status_code, "thinking": (body.get("message") or {}).get("thinking"),
                       "content": (body.get("message") or {}).get("content"), "error": body.get("error")}
print(json.dumps(out, indent=1))
EOF
cat "$OUT/think-levels.json"
kill -TERM $PID; wait $PID
log "done (replay rc=$rc)"
exit $rc
