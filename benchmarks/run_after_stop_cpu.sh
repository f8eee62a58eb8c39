#!/bin/bash
# The README's CPU serving of tests/assets/tool-model: first start, vllama stop (returns once stopped), then the
# time of the next vllama run (vLLM started anew: no sleep mode on the CPU). OUT: where serve.log and state go.
cd "$(dirname "$0")/.."; mkdir -p "${OUT:-/tmp/run-after-stop}"
export VLLAMA_STATE_DIR=${OUT:-/tmp/run-after-stop}/state OLLAMA_HOST=127.0.0.1:31554 VLLAMA_LOG_FORMAT=json
.venv/bin/vllama serve --model tests/assets/tool-model --port 31554 > ${OUT:-/tmp/run-after-stop}/serve.log 2>&1 &
pid=$!
t0=$(date +%s.%N)
until curl -sf http://127.0.0.1:31554/readyz >/dev/null; do sleep 0.5; done
t1=$(date +%s.%N); echo "first start: $(echo "$t1-$t0"|bc) s"
.venv/bin/vllama run tool-model "hi" >/dev/null
uptime
t2=$(date +%s.%N); .venv/bin/vllama stop tool-model; t3=$(date +%s.%N); echo "stop: $(echo "$t3-$t2"|bc) s"
.venv/bin/vllama ps
t4=$(date +%s.%N); .venv/bin/vllama run tool-model "hi" > /dev/null; t5=$(date +%s.%N); echo "run after stop: $(echo "$t5-$t4"|bc) s"
uptime
kill $pid; wait $pid
