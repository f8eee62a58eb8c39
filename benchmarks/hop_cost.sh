#!/usr/bin/env bash
# Issue 28 on the lent GPU: does the hop cost anything? vllama vs its own vLLM (alternating, 3 rounds)
# at c = 1, 16, 64, 256, 1024 with vllama's stage timings;
# `vllama batch` with no concurrency flag vs vLLM's offline LLM.generate; a model's first answer
# (cold start vs vanilla `vllm serve`, a second start with the compile cache kept, A -> B -> A of two
# on-demand models with the defaults). From the repo root, in phases (servers run under setsid and
# outlive one device call while the machine stays warm, so the phases may be split over calls).
#
# Prerequisites as benchmarks/README.md ("On the lent GPU machine"): the vLLM 0.26 wheel chunks stashed by two earlier calls
# (`$DEV/install-vllm.sh stash`, carrying .whl-cache/chunks/{SHA256SUMS,wheels.tar.00}, then
# .whl-cache/chunks/wheels.tar.01); the call with `install` carries the last chunk, $DEV (a copy of
# shared/device) and .whl (vllama's deps the image lacks).
#
#   install  $DEV/install-vllm.sh install
#   setup    .whl into /tmp/vsite; the random-weight 1.5 B Qwen2 at /tmp/model; versions
#   start    (b) `vllama serve --model /tmp/model` with vllama's defaults on :11434, its vLLM (c) on :8100,
#            with a fresh compile cache (VLLM_CACHE_ROOT=$LOGS/cache-b): a cold start, timed from launch
#            to the first generated token
#   c1       c = 1, one client process, $ROUNDS (3) alternating rounds x $C1_REQUESTS (32); stage timings
#   c1fake   (before start) c1split's d r p g with vllama (its defaults) and the relay in front of the stand-in
#            (tests/bin/vllm, FAKE_TOKEN_DELAY 0.02 s per token, FAKE_TOKENS 4, FAKE_ROUNDS 24 x 8): the hop on this
#            host's CPUs without vLLM's own variance: c1fake.json. FAKE_VLLAMA_PATH: another vllama_proxy's parent
#            folder first on PYTHONPATH (e.g. an older commit's `git archive`), FAKE_LABEL: c1fake-LABEL.json
#   c1split  (after start) c = 1 with $SPLIT_TOKENS (32) output tokens, $SPLIT_ROUNDS (36) alternating rounds x
#            $SPLIT_REQUESTS (8: the targets interleave 8 requests at a time; reported in 6 blocks of rounds), one
#            client process, five targets: d = vLLM direct /v1/completions, r = a bare
#            aiohttp byte relay in front of the same vLLM (benchmarks/aiohttp_floor.py, its /v1/completions),
#            p = vllama's /v1/completions pass-through, g = vllama's /api/generate (raw), v = vLLM direct with
#            exactly the body vllama sends it for g (loadgen's openai-vllama). TTFT / ITL p50 per round and pooled
#            and the steps r-d (the hop), p-r, g-p (the translation), v-d (the body): c1split.json
#   c1w1     (after start) vllama restarted with --workers 1 (compile cache of start kept), c1split's run again
#            without v (c1split-w1.json), then vllama restarted with its defaults (the same cache) for the phases after
#   sweep    (issue 42) c = 16, 64, 256 (SWEEP_LEVELS), per level $SWEEP_BLOCKS (30) short interleaved blocks: each
#            block runs vLLM direct and vllama $SWEEP_WAVES (3) x c requests each, back to back (the first target
#            alternates block by block), 4 client processes, CPU by process kind; per level the throughput ratio
#            over the paired blocks with its 95 % confidence interval (t over blocks and a bootstrap:
#            `hop_report.py ci`), whether it tells 0.97 from 1.0, TTFT / ITL p50 deltas with theirs, and the blocks
#            of that spread a ±1.5 % interval needs; vllama's stage timings per level; sweep.json, ci.jsonl.
#            About 7 minutes for 16 64 256 on the H100 (est. 1.2, 1.5, 4 s per block pair). The old 3 long rounds:
#            SWEEP_BLOCKS=3 SWEEP_WAVES=4. Alone, on a machine where vllama already runs (`start` done):
#              OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh sweep     (timeout_s 600; ~7 min + 1 min of warm-up)
#   batch    $BATCH_N (5000) prompts of 128 words, 128 tokens (/v1/completions lines): `vllama batch` with
#            no concurrency flag (it reads max_running from /api/version)
#   batchalt (issue 42, after start) $BATCH_ALT (3) runs, each: `vllama batch` with no -c on its own $BATCH_N prompts,
#            (BATCH_ALT_OLD=1) a control with the old default -c (max_running + a quarter) on other prompts,
#            then `vllama stop` (the model sleeps) and offline LLM.generate on the run's prompts with the same GPU
#            share; the ratio per run; the GPU's clocks/temperature/power before each half, offline's load and
#            scheduler limits, the server's max_num_batched_tokens: what varies between runs
#   batchvar $BATCH_N prompts per variant, each variant its own prompts (no prefix-cache hits between them),
#            BATCH_VARIANTS (default c2x all generate direct): `vllama batch` with no -c (its default), with
#            -c 2 x max_running, with -c $BATCH_N (all in flight), the same prompts as /api/generate lines
#            (non-streamed Ollama requests: vllama streams upstream and aggregates), and `vllama batch --host
#            <vLLM>` with vllama's default concurrency (no hop); then loadgen's burst of $BATCH_N at once,
#            streamed vs non-streamed /v1/completions through vllama (what streaming costs vLLM): batchvar.json
#   batchfo  vllama restarted (compile cache of start kept) with its vLLM run with --enable-per-request-metrics,
#            so that non-streamed /api/generate reaches vLLM unstreamed (vllama >= i28b); then the `generate`
#            and `default` variants of batchvar again (BATCHFO_VARIANTS), new prompts; vllama stays up
#   stop     SIGTERM vllama; GPU memory and leftover vLLM processes; logs
#   offline  (GPU free: after stop) vLLM's LLM.generate on the same 5,000 prompts, same GPU share (0.85)
#   vanilla  (GPU free) `vllm serve /tmp/model` with vLLM's defaults and a fresh compile cache: launch to
#            first token, then stopped; with vLLM's start milestones in seconds after launch (hop_report startlog)
#   vanilla8 (GPU free) the same with --api-server-count as vllama chose it (8 on a 16-CPU host): does the API
#            servers' count explain vllama's longer start?
#   warm     (GPU free, after start) vllama's model again with the compile cache of `start` kept: the
#            second cold start, then stopped
#   cold     (GPU free) vllama's model with a fresh compile cache again, beside vanilla (never the machine's
#            first vLLM launch: run start first); milestones as vanilla's. Fair pairs: `vanilla cold` in one call,
#            `cold vanilla` in the next (ABBA: drift and order cancel); COLD_FLAGS: more vllama flags (before
#            its `--`) for cold and warm, e.g. "--pin-engine-core off"
#   stoprun  (GPU free, after start: its compile cache kept) issue 37.5: vllama with its defaults (it chooses sleep mode:
#            its sleep_on_stop line), then STOPRUN_ROUNDS (3) times `vllama stop` (seconds until /readyz says sleeping
#            or unloaded, GPU memory then, models `vllama ps` lists) and one request (seconds to its first token:
#            the return); then stopped
#   ondemand (GPU free) two random models placed in $HUB as Qwen/Qwen2.5-1.5B-Instruct and
#            meta-llama/Llama-3.2-1B-Instruct; `vllama serve` with no model and its defaults; the real
#            ollama client asks qwen2.5:1.5b, llama3.2:1b, qwen2.5:1.5b, llama3.2:1b, qwen2.5:1.5b (16 tokens
#            each: the third is A -> B -> A; the fourth and fifth separate a model's first sleep); then stopped
#
# Phases chained in the background outlive a call only while the machine stays warm, and it goes back 30 s after
# a call ends: `benchmarks/chain.sh` runs them (each into its own OUT) and its `wait` calls, made one after another
# at once, bring back what has ended, so that a machine given back early loses only the phase in flight (session
# 15 lost three); its header has issue 42's lease as the example.
#
# After the two stash calls, three calls back to back (the machine must stay warm: vllama keeps running
# between them; timeout_s 600 each): the install call (with the last chunk), then two calls of measurements:
#   0: OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh install setup start           (~3.5 min)
#   1: OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh c1 sweep batch stop offline   (~8 min)
#   2: OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh vanilla warm ondemand          (~8 min)
#   stop then run (issue 37.5), after the stash calls (~4 min):
#      OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh install setup start stop stoprun
#   issue 42's mid-concurrency ratios with confidence intervals, after the stash calls (two calls, timeout_s 600):
#      OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh install setup start        (~3.5 min)
#      OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh sweep                      (~8 min: c = 16, 64, 256)
#      (should it near 600 s on a slower host: SWEEP_LEVELS="16 64" in one call, SWEEP_LEVELS=256 in the next;
#      each level's table and ci.jsonl line are written as the level ends)
#   issue 42's batch vs offline, alternating 3 times (after the stash calls; `start` in the first call):
#      OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh install setup start        (~3.5 min)
#      OUT=$OUT DEV=.devscripts BATCH_ALT=3 benchmarks/hop_cost.sh batchalt       (~6-9 min: per run ~30 s of batch,
#               ~8 s to sleep and wake, offline's load 40-75 s and generate 20-35 s; each run's lines are in summary.txt
#               as it ends, so a call cut at 600 s keeps the runs before)
#      with OFFLINE_MATCH=1 each run also times offline with the server's scheduler limits (max_num_batched_tokens
#      from vllama's log, max_num_seqs = max_running): what of the gap is vLLM's offline defaults (+~1.5 min a run,
#      so 2 runs a call; the next call BATCH_ALT_FROM=3 BATCH_ALT=1 for new prompts)
#      and the control, old default vs new, in a call of its own:
#      OUT=$OUT DEV=.devscripts BATCH_ALT=2 BATCH_ALT_OLD=1 benchmarks/hop_cost.sh batchalt   (~7-9 min)
#   ondemand alone (DEV carried: it makes the models a fresh machine lacks, ~1 min, then ~4-6 min):
#      OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh ondemand
# (`cold` adds ~2.5 min: vllama with a fresh compile cache right beside `vanilla`; `start` is the first.)
# The second run (c1split, c1w1, more sweep rounds, batchvar, fair cold starts): abcf5ef:benchmarks/results/PLAN-i28b.md
# (benchmarks/RESULTS.md says how to fetch it). The phases wake, floor (the hop without vLLM, RESULTS.md's third
# pass) and spread (connections over vLLM's API servers): `git show abcf5ef:benchmarks/hop_cost.sh`, their
# scripts in abcf5ef:benchmarks/.
# Outputs in $OUT (one call's; at most 8 files): summary.txt (every result, tables), c1.json and
# sweep.json (benchmarks/loadgen.py JSON; sweep.json has every level), ci.jsonl (sweep's intervals),
# stages.jsonl, logs.tar.gz.
# Dry run against the stand-in (tests/bin/vllm on PATH, no GPU): MODEL (a model dir), VLLAMA_EXTRA
# (--no-gpu-check), NO_GPU=1 (skips nvidia-smi), C1_REQUESTS, SWEEP_LEVELS, BATCH_N,
# TOKENS, PB / PC / PR ports, HUB, SPLIT_ROUNDS, SPLIT_REQUESTS, SPLIT_TOKENS, SWEEP_BLOCKS, SWEEP_WAVES, BATCH_VARIANTS.
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device} MODEL=${MODEL:-/tmp/model}
HUB=${HUB:-/tmp/hf/hub}
mkdir -p "$OUT" "$LOGS" "$HUB"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state HF_HOME=$(dirname "$HUB") HF_HUB_CACHE=$HUB
PB=${PB:-11434} PC=${PC:-8100} PR=${PR:-8200} ROUNDS=${ROUNDS:-3} TOKENS=${TOKENS:-128}
B=http://127.0.0.1:$PB C=http://127.0.0.1:$PC SERVED=qwen-random
VLLM_SHAPE="--max-model-len 4096 --gpu-memory-utilization 0.85"
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
say() { tee -a "$OUT/summary.txt"; }
gpu() { [ -n "${NO_GPU:-}" ] && echo "-" || nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '; }
loadgen() { python3 benchmarks/loadgen.py --model $SERVED --output-tokens "$TOKENS" --prompt-words 128 --raise-nofile --baseline c "$@"; }
report() { python3 benchmarks/hop_report.py "$@"; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop_pid() {  # pidfile: SIGTERM, wait up to 60 s
  alive "$1" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1"); kill -TERM "$pid"
  for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && { log "still running after 60 s: SIGKILL to $pid's group"; kill -KILL -- "-$pid" 2>/dev/null; }
  rm -f "$1"
}
page_cache() { cat "$MODEL"/*.safetensors > /dev/null 2>&1 || true; }  # every start reads the weights from RAM
# vllama serve --model $MODEL with its defaults; $1: its log file, $2: VLLM_CACHE_ROOT, $3: more vllama flags,
# $4: more vLLM arguments.
# Prints "seconds to first token"; T0 (epoch seconds of the launch) is left in $LOGS/t0.
vllama_start() {
  page_cache
  date +%s.%N > $LOGS/t0
  VLLM_CACHE_ROOT=$2 setsid python3 -m vllama_proxy serve --model "$MODEL" --served-model-name $SERVED --vllm-port $PC \
    --port $PB --keep-alive -1 --log-format json ${VLLAMA_EXTRA:-} ${3:-} -- $VLLM_SHAPE ${4:-} > "$1" 2>&1 < /dev/null &
  echo $! > $LOGS/b.pid
  report first $B ollama --model $SERVED --timeout 590
}
milestones() { report startlog "$1" "$(cat $LOGS/t0)"; }  # vLLM's start stages, seconds after the launch
# c=1, the five targets of c1split (or SPLIT_TARGETS); $1: the JSON file. The relay must be up on $PR.
c1split_run() {
  loadgen --targets "${SPLIT_TARGETS:-d=openai:$C,r=openai:http://127.0.0.1:$PR,p=openai:$B,g=ollama:$B,v=openai-vllama:$C}" \
    --levels 1 --rounds "${SPLIT_ROUNDS:-36}" --requests-per-level "${SPLIT_REQUESTS:-8}" --procs 1 --warmup 16 \
    --output-tokens "${SPLIT_TOKENS:-32}" --baseline d --json "$1" > "${1%.json}.txt" 2>&1 || log "c1split: loadgen reported errors"
  report split "$1" | say
}
relay_up() {
  alive $LOGS/r.pid && return 0
  setsid python3 benchmarks/aiohttp_floor.py --upstream $C --port $PR > $LOGS/relay.log 2>&1 < /dev/null &
  echo $! > $LOGS/r.pid
  for _ in $(seq 60); do curl -sf http://127.0.0.1:$PR/ > /dev/null && return 0; sleep 0.25; done
  log "the relay did not start: $(tail -5 $LOGS/relay.log)"; return 1
}
run_n=0  # counts the starts of this call (vanilla, cold); their logs are named by the time they began
compile_lines() {  # what vLLM said about its compile cache and start (the lines worth comparing)
  grep -aE 'torch.compile takes|Compiling a graph|Directly load the compiled graph|init engine .* took|Graph capturing finished|Loading weights took|Model loading took' "$1" \
    | sed -E 's/^.*"line":"?//' | cut -c1-200 | head -20
}

for phase in "$@"; do case $phase in
install) "$DEV/install-vllm.sh" install || exit 1 ;;
setup)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  [ -f "$MODEL/config.json" ] || python3 "$DEV/make_random_model.py" "$MODEL" > /dev/null || exit 1
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null); $(nproc) CPUs; $(free -g | awk '/Mem/{print $2" GiB RAM, "$7" available"}'); GPU: $([ -n "${NO_GPU:-}" ] || nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader)"
  ;;
c1fake)
  # The same c=1 split with the stand-in for vLLM (tests/fake_vllm.py: each token FAKE_TOKEN_DELAY after the last,
  # no engine, no GPU): the hop's cost on this host's CPUs without vLLM's own TTFT variance. Run before `start`.
  log "c1fake${FAKE_LABEL:+ $FAKE_LABEL}: c1split's d r p g against the stand-in (${FAKE_TOKEN_DELAY:-0.02} s per token), vllama's defaults${FAKE_VLLAMA_PATH:+, vllama from $FAKE_VLLAMA_PATH}"
  FB=http://127.0.0.1:${PFB:-11500} FC=http://127.0.0.1:${PFC:-8300}
  # python -m puts its working directory first on sys.path: FAKE_VLLAMA_PATH's vllama_proxy is the one that runs
  here=$PWD; ( cd "${FAKE_VLLAMA_PATH:-.}" && VLLAMA_STATE_DIR=$LOGS/state-fake VLLAMA_VLLM_EXECUTABLE=$here/tests/bin/vllm \
    FAKE_VLLM_PYTHON=$(command -v python3) FAKE_VLLM_TOKEN_DELAY=${FAKE_TOKEN_DELAY:-0.02} exec setsid python3 -m vllama_proxy serve \
    --model "$MODEL" --served-model-name $SERVED --vllm-port ${PFC:-8300} --port ${PFB:-11500} --keep-alive -1 --log-format json \
    --no-gpu-check > $LOGS/vllama-fake${FAKE_LABEL:+-$FAKE_LABEL}.log 2>&1 < /dev/null ) &
  echo $! > $LOGS/f.pid
  report first $FB ollama --model $SERVED --timeout 120 > /dev/null || { tail -20 $LOGS/vllama-fake${FAKE_LABEL:+-$FAKE_LABEL}.log; exit 1; }
  log "c1fake: vllama_proxy from $(readlink -f /proc/$(cat $LOGS/f.pid)/cwd)"
  setsid python3 benchmarks/aiohttp_floor.py --upstream $FC --port ${PFR:-8400} > $LOGS/relay-fake.log 2>&1 < /dev/null &
  echo $! > $LOGS/fr.pid
  for _ in $(seq 60); do curl -sf http://127.0.0.1:${PFR:-8400}/ > /dev/null && break; sleep 0.25; done
  SPLIT_TARGETS=d=openai:$FC,r=openai:http://127.0.0.1:${PFR:-8400},p=openai:$FB,g=ollama:$FB SPLIT_TOKENS=${FAKE_TOKENS:-4} \
    SPLIT_ROUNDS=${FAKE_ROUNDS:-24} c1split_run "$OUT/c1fake${FAKE_LABEL:+-$FAKE_LABEL}.json"
  stop_pid $LOGS/fr.pid; stop_pid $LOGS/f.pid
  ;;
start)
  rm -rf "$LOGS/cache-b"
  s=$(vllama_start $LOGS/vllama.log $LOGS/cache-b) || { tail -40 $LOGS/vllama.log; exit 1; }
  log "cold start (vllama, fresh compile cache): launch to first token $s s"
  milestones $LOGS/vllama.log | say
  { grep -m1 '"front_end"' $LOGS/vllama.log; grep -m1 '"admission"' $LOGS/vllama.log; grep -m1 '"compile_cache"' $LOGS/vllama.log
    echo "/api/version: $(curl -s $B/api/version)"; compile_lines $LOGS/vllama.log; } | cut -c1-400 | say
  ;;
c1)
  log "c=1: b=vllama c=its vLLM, $ROUNDS rounds x ${C1_REQUESTS:-32} requests, one client process"
  report metrics $B $LOGS/m0.txt
  loadgen --targets "b=ollama:$B,c=openai:$C" --levels 1 --rounds "$ROUNDS" --requests-per-level "${C1_REQUESTS:-32}" \
    --procs 1 --warmup 16 --json "$OUT/c1.json" > $LOGS/c1.txt 2>&1
  report metrics $B $LOGS/m1.txt
  report rounds "$OUT/c1.json" | say
  report stages $LOGS/m0.txt $LOGS/m1.txt c=1 | tee -a "$OUT/summary.txt" | tail -1 >> "$OUT/stages.jsonl"
  ;;
c1split)
  relay_up || exit 1
  log "c1split: c=1, ${SPLIT_TOKENS:-32} output tokens, ${SPLIT_ROUNDS:-36} alternating rounds x ${SPLIT_REQUESTS:-8} requests; d=vLLM direct, r=bare relay, p=vllama /v1, g=vllama /api/generate, v=vLLM direct with vllama's body"
  report metrics $B $LOGS/m0.txt
  c1split_run "$OUT/c1split.json"
  report metrics $B $LOGS/m1.txt
  report stages $LOGS/m0.txt $LOGS/m1.txt c1split | tee -a "$OUT/summary.txt" | tail -1 >> "$OUT/stages.jsonl"
  stop_pid $LOGS/r.pid
  ;;
c1w1)
  stop_pid $LOGS/b.pid; sleep 2
  s=$(vllama_start $LOGS/vllama-w1.log $LOGS/cache-b "--workers 1") || { tail -40 $LOGS/vllama-w1.log; exit 1; }
  log "vllama --workers 1 (compile cache of start kept): launch to first token $s s; $(grep -m1 '"front_end"' $LOGS/vllama-w1.log | cut -c1-300)"
  relay_up || exit 1
  log "c1split with vllama --workers 1 (targets d r p g: v does not pass vllama)"
  SPLIT_TARGETS=${SPLIT_TARGETS_W1:-d=openai:$C,r=openai:http://127.0.0.1:$PR,p=openai:$B,g=ollama:$B} c1split_run "$OUT/c1split-w1.json"
  stop_pid $LOGS/r.pid
  stop_pid $LOGS/b.pid; sleep 2
  s=$(vllama_start $LOGS/vllama-again.log $LOGS/cache-b) || { tail -40 $LOGS/vllama-again.log; exit 1; }
  log "vllama with its defaults again (compile cache of start kept): launch to first token $s s"
  ;;
sweep)
  warm=16; rm -f $LOGS/sweep-*.json "$OUT/ci.jsonl"
  blocks=${SWEEP_BLOCKS:-${SWEEP_ROUNDS:-30}} waves=${SWEEP_WAVES:-3}  # SWEEP_ROUNDS: the old name
  for c in ${SWEEP_LEVELS:-16 64 256}; do
    log "c=$c: $blocks interleaved blocks x $(( waves * c )) requests per target, 4 client processes"
    report metrics $B $LOGS/m0.txt
    loadgen --targets "b=ollama:$B,c=openai:$C" --levels "$c" --rounds "$blocks" --requests-per-level "$(( waves * c ))" \
      --procs 4 --warmup $warm --cpu-by-kind --json "$LOGS/sweep-$c.json" > $LOGS/sweep-$c.txt 2>&1 || log "c=$c: loadgen reported errors"
    report metrics $B $LOGS/m1.txt
    warm=0
    report ci "$LOGS/sweep-$c.json" > $LOGS/ci-$c.txt
    grep -v '^{"ci"' $LOGS/ci-$c.txt | say; grep '^{"ci"' $LOGS/ci-$c.txt >> "$OUT/ci.jsonl"
    report rounds "$LOGS/sweep-$c.json" | say
    grep '^|' $LOGS/sweep-$c.txt | say  # loadgen's tables: pooled results, cores by process kind, ratios
    report stages $LOGS/m0.txt $LOGS/m1.txt "c=$c" | tee -a "$OUT/summary.txt" | tail -1 >> "$OUT/stages.jsonl"
    report merge "$OUT/sweep.json" $LOGS/sweep-*.json  # one file of every level so far (files that come back: 8 at most)
  done
  ;;
batch)
  n=${BATCH_N:-5000}
  report prompts "$n" $LOGS/batch.jsonl --words 128 --tokens "$TOKENS" --model $SERVED
  log "batch: $n prompts, /api/version says $(curl -s $B/api/version)"
  t=$(date +%s.%N)
  python3 -m vllama_proxy batch $LOGS/batch.jsonl -o $LOGS/batch-out.jsonl --restart --host $B > $LOGS/batch.txt 2>&1
  rc=$?
  grep -E 'concurrency|^vllama batch: [0-9]+/[0-9]+ .*skipped' $LOGS/batch.txt | say
  ok=$(grep -c '"status_code": *200' $LOGS/batch-out.jsonl || true)
  log "vllama batch: exit $rc, $ok/$n answered 200, wall $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t}") s"
  ;;
batchalt)
  # Issue 42: `vllama batch` with no -c and offline LLM.generate alternating BATCH_ALT (3) times in this call,
  # each run on its own prompts (vllama's vLLM keeps its prefix cache between runs), both halves of a run on
  # the same ones. vllama's model sleeps (`vllama stop`) while LLM.generate holds the same GPU share (0.85)
  # and wakes for the next batch; BATCH_ALT_OLD=1 adds a control run with the old default
  # concurrency (max_running + a quarter) on prompts of its own. What may vary between runs is printed:
  # the GPU's clocks, temperature and power before each half, offline's load time and scheduler limits.
  n=${BATCH_N:-5000}
  mr=$(curl -s $B/api/version | python3 -c 'import json, sys; print(json.load(sys.stdin).get("max_running") or 0)')
  [ "$mr" -gt 0 ] 2>/dev/null || { log "batchalt: /api/version has no max_running"; exit 1; }
  gpu_state() { [ -n "${NO_GPU:-}" ] && echo "-" || nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv,noheader | tr '\n' ' '; }
  state() { curl -s $B/readyz | python3 -c 'import json, sys; print(json.load(sys.stdin).get("state"))'; }
  batch_once() {  # $1 prompts file, $2 label, $3 flags; sets bt (tok/s by wall)
    local t rc wall tok
    t=$(date +%s.%N)
    python3 -m vllama_proxy batch "$1" -o $LOGS/alt-out.jsonl --restart --host $B $3 > $LOGS/alt-$2.txt 2>&1
    rc=$?; wall=$(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $t}")
    tok=$(python3 -c 'import json, sys
n = 0
for line in open(sys.argv[1]):
    b = ((json.loads(line).get("response") or {}).get("body")) or {}
    n += ((b.get("usage") or {}).get("completion_tokens") or 0) if isinstance(b, dict) else 0
print(n)' $LOGS/alt-out.jsonl)
    bt=$(awk "BEGIN{printf \"%.0f\", $tok / $wall}")
    log "batchalt $2 (${3:-no -c}): exit $rc, $(grep -c '"status_code": *200' $LOGS/alt-out.jsonl || true)/$n answered 200, $tok tokens, wall $wall s: $bt tok/s; $(grep -m1 -o 'concurrency [0-9]*' $LOGS/alt-$2.txt)"
  }
  log "batchalt: ${BATCH_ALT:-3} runs; $n prompts of 128 words, $TOKENS tokens; max_running $mr; the server's scheduler: $(grep -aoE 'max_num_batched_tokens=[0-9]+' $LOGS/vllama*.log | head -1)"
  first=${BATCH_ALT_FROM:-1}  # a later call goes on with new prompts: BATCH_ALT_FROM=3 after a call of 2 runs
  sbt=$(grep -aoE 'max_num_batched_tokens=[0-9]+' $LOGS/vllama*.log | head -1 | cut -d= -f2)
  for i in $(seq "$first" $(( first + ${BATCH_ALT:-3} - 1 ))); do
    report prompts "$n" $LOGS/alt-$i.jsonl --words 128 --tokens "$TOKENS" --model $SERVED --seed $(( 300 + i ))
    s=$(report first $B ollama --model $SERVED --timeout 590)
    log "run $i: vllama answers (after $s s; state $(state)); GPU before batch: $(gpu_state)"
    batch_once $LOGS/alt-$i.jsonl "run$i" ""; b=$bt
    if [ "${BATCH_ALT_OLD:-0}" = 1 ]; then
      report prompts "$n" $LOGS/alt-old.jsonl --words 128 --tokens "$TOKENS" --model $SERVED --seed $(( 400 + i ))
      batch_once $LOGS/alt-old.jsonl "run$i-old" "-c $(( mr + mr / 4 ))"; bo=$bt
    fi
    OLLAMA_HOST=$B python3 -m vllama_proxy stop $SERVED > /dev/null || log "run $i: vllama stop failed"
    for _ in $(seq 1200); do st=$(state); [ "$st" = sleeping ] || [ "$st" = unloaded ] && break; sleep 0.05; done
    log "run $i: vllama $st; GPU before offline: $(gpu_state)"
    if [ -n "${NO_GPU:-}" ]; then log "run $i: offline skipped (NO_GPU)"; continue; fi
    page_cache
    VLLM_CACHE_ROOT=$LOGS/cache-offline python3 benchmarks/offline_generate.py "$MODEL" $LOGS/alt-$i.jsonl --json $LOGS/offline-$i.json \
      > $LOGS/offline-$i.log 2>&1 || tail -20 $LOGS/offline-$i.log | say
    o=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["output_tok_s"])' $LOGS/offline-$i.json 2>/dev/null || echo 0)
    log "run $i: offline $(cat $LOGS/offline-$i.json 2>/dev/null | tr -d '\n ')"
    log "run $i: vllama batch / offline = $(awk "BEGIN{printf \"%.3f\", $b / ($o > 0 ? $o : 1)}")${bo:+; old default / offline = $(awk "BEGIN{printf \"%.3f\", $bo / ($o > 0 ? $o : 1)}")}"
    if [ "${OFFLINE_MATCH:-0}" = 1 ] && [ -n "$sbt" ]; then  # the control: offline with the server's scheduler limits
      page_cache
      VLLM_CACHE_ROOT=$LOGS/cache-offline python3 benchmarks/offline_generate.py "$MODEL" $LOGS/alt-$i.jsonl \
        --max-num-batched-tokens "$sbt" --max-num-seqs "$mr" --json $LOGS/offline-m-$i.json > $LOGS/offline-m-$i.log 2>&1 \
        || tail -20 $LOGS/offline-m-$i.log | say
      om=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["output_tok_s"])' $LOGS/offline-m-$i.json 2>/dev/null || echo 0)
      log "run $i: offline with the server's limits $(cat $LOGS/offline-m-$i.json 2>/dev/null | tr -d '\n ')"
      log "run $i: vllama batch / offline with the server's limits = $(awk "BEGIN{printf \"%.3f\", $b / ($om > 0 ? $om : 1)}")"
    fi
  done
  ;;
batchvar|batchfo)
  n=${BATCH_N:-5000}; variants=${BATCH_VARIANTS:-default c2x all generate direct}; seed=100
  if [ $phase = batchfo ]; then  # vLLM with per-request metrics: non-streamed /api/generate goes upstream unstreamed
    stop_pid $LOGS/b.pid; sleep 2
    s=$(vllama_start $LOGS/vllama-fo.log $LOGS/cache-b "" --enable-per-request-metrics) || { tail -40 $LOGS/vllama-fo.log; exit 1; }
    log "batchfo: vllama restarted, its vLLM with --enable-per-request-metrics (compile cache of start kept): first token $s s"
    variants=${BATCHFO_VARIANTS:-generate default}; seed=200
  fi
  mr=$(curl -s $B/api/version | python3 -c 'import json, sys; print(json.load(sys.stdin).get("max_running") or 0)')
  [ "$mr" -gt 0 ] 2>/dev/null || { log "batchvar: /api/version has no max_running"; mr=1024; }
  dflt=$(( 2 * mr ))  # what vllama batch picks with no -c (client/batch/concurrency.py choose_concurrency)
  log "$phase: $n prompts per variant; max_running $mr, vllama batch's default concurrency $dflt"
  for v in $variants; do
    seed=$(( seed + 1 )); url=/v1/completions; host=$B; flags=""
    case $v in
      default) ;;
      c2x) flags="-c $(( 2 * mr ))" ;;
      all) flags="-c $n" ;;
      generate) url=/api/generate ;;
      direct) host=$C; flags="-c $dflt" ;;  # vLLM itself: no /api/version there, so -c as vllama's default
      *) log "batchvar: unknown variant $v"; continue ;;
    esac
    report prompts "$n" $LOGS/batchvar.jsonl --words 128 --tokens "$TOKENS" --model $SERVED --url $url --seed $seed
    t=$(date +%s.%N)
    python3 -m vllama_proxy batch $LOGS/batchvar.jsonl -o $LOGS/batchvar-out.jsonl --restart --host $host $flags > $LOGS/batchvar-$v.txt 2>&1
    rc=$?; wall=$(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $t}")
    ok=$(grep -c '"status_code": *200' $LOGS/batchvar-out.jsonl || true)
    tok=$(python3 -c 'import json, sys
n = 0
for line in open(sys.argv[1]):
    b = ((json.loads(line).get("response") or {}).get("body")) or {}
    u = b.get("usage") if isinstance(b, dict) else None
    n += (u or {}).get("completion_tokens") or (b.get("eval_count") if isinstance(b, dict) else 0) or 0
print(n)' $LOGS/batchvar-out.jsonl)
    log "$phase $v ($url, host ${host##*:}, ${flags:-no -c}): exit $rc, $ok/$n answered 200, $tok tokens, wall $wall s: $(awk "BEGIN{printf \"%.0f\", $tok / $wall}") tok/s by wall; $(grep -E '^vllama batch: [0-9]+/[0-9]+ .*skipped' $LOGS/batchvar-$v.txt | cut -c1-160)"
    grep -m1 'concurrency' $LOGS/batchvar-$v.txt | say
  done
  [ $phase = batchfo ] && continue
  # what streaming costs: $n requests at once through vllama's /v1 pass-through, streamed vs not
  log "batchvar burst: $n /v1/completions at once through vllama, s = streamed, n = stream false"
  loadgen --targets "s=openai:$B,n=openai-nostream:$B" --burst "$n" --rounds 2 --procs 4 --warmup 0 --seed 7 --baseline n \
    --json "$OUT/batchvar.json" > $LOGS/batchvar-burst.txt 2>&1 || log "batchvar burst: loadgen reported errors"
  grep '^|' $LOGS/batchvar-burst.txt | say
  ;;
stop)
  stop_pid $LOGS/b.pid
  sleep 2
  log "stopped; GPU memory used: $(gpu); vLLM processes left: $(pgrep -fc '^VLLM::|bin/vllm serve' || true)"
  ;;
offline)
  [ -f $LOGS/batch.jsonl ] || report prompts "${BATCH_N:-5000}" $LOGS/batch.jsonl --words 128 --tokens "$TOKENS" --model $SERVED
  log "offline LLM.generate on the same prompts, gpu_memory_utilization 0.85 (GPU used before: $(gpu))"
  if [ -n "${NO_GPU:-}" ]; then log "offline: skipped (NO_GPU: the stand-in has no LLM class)"; continue; fi
  page_cache
  VLLM_CACHE_ROOT=$LOGS/cache-offline python3 benchmarks/offline_generate.py "$MODEL" $LOGS/batch.jsonl --json $LOGS/offline.json \
    > $LOGS/offline.log 2>&1 || tail -20 $LOGS/offline.log | say
  log "offline: $(cat $LOGS/offline.json 2>/dev/null)"
  ;;
vanilla|vanilla8)
  run_n=$(( run_n + 1 )); vlog=$LOGS/$phase-$(date +%H%M%S).log
  rm -rf $LOGS/cache-vanilla; page_cache
  asc=""
  if [ $phase = vanilla8 ]; then  # the API servers' count vllama chose (its front_end log line), else 8
    asc=$(grep -ahm1 '"front_end"' $LOGS/vllama.log 2>/dev/null | grep -oE '"count": ?[0-9]+' | head -1 | grep -oE '[0-9]+$')
    asc="--api-server-count ${asc:-8}"
  fi
  date +%s.%N > $LOGS/t0
  VLLM_CACHE_ROOT=$LOGS/cache-vanilla setsid vllm serve "$MODEL" --served-model-name $SERVED --port $PC $VLLM_SHAPE $asc \
    > $vlog 2>&1 < /dev/null &
  echo $! > $LOGS/v.pid
  s=$(report first $C openai --model $SERVED --timeout 590)
  log "cold start (vanilla vllm serve${asc:+ $asc}, fresh compile cache, run $run_n of this call): launch to first token $s s"
  { milestones $vlog; compile_lines $vlog; } | say
  stop_pid $LOGS/v.pid
  ;;
cold|warm)
  run_n=$(( run_n + 1 )); vlog=$LOGS/vllama-$phase-$(date +%H%M%S).log
  if [ $phase = cold ]; then cache=$LOGS/cache-cold; rm -rf $cache; else cache=$LOGS/cache-b; fi
  s=$(vllama_start $vlog $cache "${COLD_FLAGS:-}") || { tail -40 $vlog; }
  log "$([ $phase = cold ] && echo 'cold start (vllama, fresh compile cache)' || echo 'second start (vllama, compile cache of start kept)')${COLD_FLAGS:+ $COLD_FLAGS} run $run_n of this call: launch to first token $s s"
  { milestones $vlog; grep -m1 '"front_end"' $vlog | cut -c1-300; compile_lines $vlog; } | say
  stop_pid $LOGS/b.pid
  ;;
stoprun)
  vlog=$LOGS/vllama-stoprun-$(date +%H%M%S).log
  s=$(vllama_start $vlog $LOGS/cache-b "${COLD_FLAGS:-}") || { tail -40 $vlog; }
  log "stoprun: vllama with its defaults up (compile cache of start kept): launch to first token $s s; GPU memory used: $(gpu)"
  grep -a '"sleep_on_stop"' $vlog | cut -c1-300 | say
  state() { curl -s $B/readyz | python3 -c 'import json, sys; print(json.load(sys.stdin).get("state"))'; }
  for i in $(seq "${STOPRUN_ROUNDS:-3}"); do
    t=$(date +%s.%N)
    OLLAMA_HOST=$B python3 -m vllama_proxy stop $SERVED || log "stoprun $i: vllama stop failed"
    for _ in $(seq 1200); do st=$(state); [ "$st" = sleeping ] || [ "$st" = unloaded ] && break; sleep 0.05; done
    put=$(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $t}")
    listed=$(OLLAMA_HOST=$B python3 -m vllama_proxy ps | tail -n +2 | grep -c . || true)
    log "stoprun $i: vllama stop -> $st after $put s; GPU memory used: $(gpu); vllama ps lists $listed model(s)"
    s=$(report first $B ollama --model $SERVED --timeout 590)
    log "stoprun $i: then one request: its first token after $s s ($(state))"
  done
  grep -aE '"sleep_warmed"|"woke_up"|"to":"(sleeping|ready|unloaded)"' $vlog | cut -c1-300 | say
  stop_pid $LOGS/b.pid
  ;;
ondemand)
  t=$(date +%s)
  # a repo counts only when vllama's catalog loads it (config.json and safetensors in the main snapshot,
  # vllama_proxy/models/local.py), not when its folder exists: a folder left by a failed call (call 2 of
  # 2026-11-24 had no $DEV: empty snapshots) must be made again, and any failure stops the phase here
  catalog() { python3 -c 'from vllama_proxy.models import local
for m in local.scan(None): print(m.repo)'; }
  has() { catalog | grep -qx "$1"; }
  if [ -n "${NO_GPU:-}" ]; then  # the dry run: copies of $MODEL under both names
    for r in Qwen/Qwen2.5-1.5B-Instruct meta-llama/Llama-3.2-1B-Instruct; do
      has $r || { rm -rf $LOGS/src; cp -r "$MODEL" $LOGS/src; python3 benchmarks/on_demand_models.py place $LOGS/src "$HUB" $r || exit 1; }
    done
  else
    if ! has Qwen/Qwen2.5-1.5B-Instruct; then
      rm -rf /tmp/qwen-src
      python3 "$DEV/make_random_model.py" /tmp/qwen-src > /dev/null \
        && python3 benchmarks/on_demand_models.py place /tmp/qwen-src "$HUB" Qwen/Qwen2.5-1.5B-Instruct || exit 1
    fi
    if ! has meta-llama/Llama-3.2-1B-Instruct; then
      rm -rf /tmp/llama-src
      python3 benchmarks/on_demand_models.py llama /tmp/llama-src --tokenizer-from "$(echo "$HUB"/models--Qwen--Qwen2.5-1.5B-Instruct/snapshots/*)" \
        && python3 benchmarks/on_demand_models.py place /tmp/llama-src "$HUB" meta-llama/Llama-3.2-1B-Instruct || exit 1
    fi
  fi
  log "on-demand models in $HUB ($(( $(date +%s) - t )) s), as vllama's catalog sees them: $(catalog | tr '\n' ' ')"
  has Qwen/Qwen2.5-1.5B-Instruct && has meta-llama/Llama-3.2-1B-Instruct || { log "a model is missing from the catalog"; exit 1; }
  setsid python3 -m vllama_proxy serve --port $PB --log-format json ${VLLAMA_EXTRA:-} > $LOGS/ondemand.log 2>&1 < /dev/null &
  echo $! > $LOGS/d.pid
  for _ in $(seq 120); do curl -sf $B/readyz > /dev/null && break; sleep 0.5; done
  python3 benchmarks/on_demand_client.py $B ask ${ONDEMAND_MODELS:-qwen2.5:1.5b llama3.2:1b qwen2.5:1.5b llama3.2:1b qwen2.5:1.5b} 2>&1 | say
  grep -aE '"on_demand_sleep"|"compile_cache"|"woke_up"|"on_demand_unload"|"to":"(sleeping|ready|unloaded)"' $LOGS/ondemand.log | cut -c1-300 | say
  stop_pid $LOGS/d.pid
  log "stopped; GPU memory used: $(gpu)"
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac; done
# whatever ran, the logs so far (one file: at most 8 come back)
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" --exclude='cache-*' --exclude='state' --exclude='*.jsonl' --exclude='*.pid' . 2>/dev/null || true
