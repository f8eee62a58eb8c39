#!/usr/bin/env bash
# Issue 31 (and 32) on the lent GPU(s): a fleet of vllama nodes behind vLLM's router (vllm-router) behind
# a vllama front, on a multi-turn chat workload with shared system prompts (docs/fleet.md).
# From the repo root, in phases (servers are started with setsid and outlive one device call while the
# machine stays warm, so the phases may be split over calls).
#
# Prerequisites as benchmarks/README.md ("On the lent GPU machine"): the vLLM wheel chunks stashed by earlier calls; the call with
# `install` carries the last chunk, $DEV (a copy of shared/device) and .whl (vllama's deps the image
# lacks). vllm-router's wheel (23 MB, abi3, so Python 3.12 takes it) travels in a call of its own,
# `router-wheel`, carrying .whl-router: `pip download vllm-router==0.1.17 --no-deps -d .whl-router`.
#
#   install   $DEV/install-vllm.sh install
#   router-wheel  .whl-router into /tmp/vsite (vllm-router)
#   setup     .whl (and .whl-router if carried) into /tmp/vsite; the random Qwen2.5-1.5B-shaped model $MODEL
#   size      the KV cache per engine (--kv-cache-memory-bytes), from the workload counted with the model's
#             tokenizer: KV_FRACTION (0.75) of all G system prompts + the sessions half of C in flight add:
#             one engine cannot hold every group's prefix and all sessions, two engines with the groups
#             split between them can, two that each see every group (round robin) cannot; bytes per token
#             from config.json (2 x layers x KV heads x head dim x 2)
#   start     TOPOLOGY (fleet | one | dpN), NODES (2) nodes a, b, c, d... on :11501+i (vLLM :8101+i):
#             fleet: the router (no workers: the nodes join it), engines a and b started one after the
#                    other (two starting at once on one GPU misjudge their KV cache), each
#                    `vllama serve --model $MODEL --register-with $ROUTER` on :11501/:11502 with its vLLM on
#                    :8101/:8102; PLACEMENT=shared: both on GPU 0 (--gpu-memory-utilization $GPU_UTIL, 0.4),
#                    split: CUDA_VISIBLE_DEVICES 0 and 1; then two fronts `vllama serve --upstream $ROUTER`: on :11434
#                    with the default session key (--session-key conversation), on :11435 with --session-key system
#                    (both find the router at start: --request-sessions on; the second's chats without a system
#                    prompt go under one-request keys it releases, the first's keep their conversation keys)
#                    (PLACEMENT=split: node i on GPU i, all NODES started at once: each has its own GPU)
#             one:   one node on :11434 (its vLLM on :8101), no router (the baseline)
#             dpN:   one node on :11434 whose vLLM runs `--data-parallel-size N` (GPUs 0..N-1: vLLM's own balancer)
#   run-CONFIG  fleet only, CONFIG = POLICY[+system][+balanced]: the router restarted with --policy POLICY
#             (round_robin, cache_aware, consistent_hash, sticky_least_loaded, power_of_two; +balanced adds
#             $BALANCE_ARGS, cache_aware spreading load once 4 requests apart); the nodes join it again; every
#             engine's prefix cache reset; then the workload through the front (+system: the one on :11435
#             whose session key is model + system prompt): loadgen --conversations G,S,T at C sessions in
#             flight, TTFT/ITL/tok/s per turn and the cluster prefix-cache hit rate (sum of the engines'
#             hits / queries); $OUT/CONFIG-r0.json (+ written . in file names)
#   rounds    every configuration of CONFIGS in turn, ROUNDS (4) times (alternating, a seed per run);
#             $OUT/CONFIG-rN.json, also kept in $LOGS/runs
#   summarize benchmarks/fleet_summary.py over $LOGS/runs: per configuration the pooled hit rate and its
#             ratio to round robin's, TTFT p50/p90 over every turn, per-round p50s; $OUT/summary-rounds.md
#   run       one and dpN: the same workload against the node ($OUT/$TOPOLOGY.json)
#   throughput  issue 43's throughput-bound workload: distinct prompts, PROMPT_WORDS (128) in / TOKENS_T (128)
#             out, STREAMS (1,024) in flight, REQUESTS (3 x STREAMS; REQUESTS=$((10*STREAMS)) for a longer run)
#             requests, through the front; fleet: each of THROUGHPUT_CONFIGS (sticky_least_loaded+system round_robin,
#             CONFIG as run-CONFIG: +system goes through the --session-key system front, whose chats without a
#             system prompt go under one-request keys released at the router: placed by requests in flight) in
#             turn, THROUGHPUT_ROUNDS (1) times; each engine's requests answered and its running/waiting
#             sampled every second (p50/max per engine: a node falling behind shows as waiting);
#             one and dpN: against the node; $OUT/throughput-$TOPOLOGY[NODES-CONFIG-rN].json, load-*.json; beside each run
#             the listen queues of the fronts, router, nodes and vLLMs, the connections seen to each and the kernel's
#             listen overflows and drops (benchmarks/session_turnaround.py --listen-watch): listen-*.txt
#   hop       fleet, issue 43's hop: the router restarted on round_robin, then in HOP_ROUNDS (2) alternating rounds the
#             throughput workload (3 x STREAMS requests) five ways: node a's vLLM alone at STREAMS/NODES (alone), NODES
#             loadgens at once each straight at one node's vLLM (vllm) or its vllama's /v1 (node), one at the router
#             (router, OpenAI chat), one at the front (front, Ollama chat); each engine core's CPU affinity logged;
#             $OUT/hop-PATH-rN-TAG.json, the table (benchmarks/router_hop.py --summarize-loadgen) in $OUT/hop.md
#   drain     fleet, under the conversation workload (FAILOVER_CONFIG): FAIL_AT s in, the last node gets
#             SIGTERM (it leaves the router, answers 503 to new requests, finishes its streams, stops) and
#             is started again; turns lost (none expected), how long the drain took, when the new node
#             was back in rotation; $OUT/drain.json, drain.txt
#   nodekill  fleet, under the conversation workload (FAILOVER_CONFIG): FAIL_AT s in, the last node SIGKILLed with its
#             vLLM (a host that dies) and started again; turns lost, the front's resumed streams and their pauses;
#             $OUT/nodekill.json, nodekill.txt
#   failover  fleet, FAILOVER_CONFIG (sticky_least_loaded+system): the workload with 3 x S sessions per group, FAIL_AT (4) s into it engine a's EngineCore gets
#             SIGKILL; which turns failed (and whether each was in flight at the kill), when the last
#             failure ended, how long until a's supervisor had it ready and the router took it back;
#             $OUT/failover.json, failover.txt
#   stop      SIGTERM everything; leftover processes and GPU memory; logs to $OUT
#
# The lead's calls, back to back after the two stash calls (servers outlive a call while the machine is warm):
#   1. carry .whl-router (~5 s):       benchmarks/fleet.sh router-wheel
#   2. carry the last chunk, $DEV, .whl (timeout_s 600, ~4-5 min: two engines start one after the other):
#        OUT=$OUT DEV=.devscripts benchmarks/fleet.sh install setup size start
#   3. no carry (timeout_s 600, ~5 min: 6 configurations x 4 rounds, ~10 s each):
#        OUT=$OUT benchmarks/fleet.sh rounds summarize
#   4. no carry (timeout_s 600, ~2 min: the killed engine's restart takes ~65 s):
#        OUT=$OUT benchmarks/fleet.sh failover stop
# Outputs in $OUT: summary.txt (one line per run), CONFIG-rN.json per run, summary-rounds.md, failover.json
# (loadgen JSON: pooled summary, per-turn timeline with TTFT, each engine's prefix-cache counters),
# failover.txt, {front,front2,a,b,router}.log.gz.
# Issue 32 on nvidia-h200-x2: PLACEMENT=split for the fleet; TOPOLOGY=one and TOPOLOGY=dp2 with `start run stop`.
# Issue 43 on nvidia-h100-x4 (or -h200-x4), every call that kind (the machine stays warm between them), after
# the two stash calls and call 1 above (carry .whl-router); X="NODES=4 PLACEMENT=split GPU_UTIL=0.85":
#   2. carry the last chunk, $DEV, .whl (timeout_s 600, ~5 min: install, 4 nodes started at once, 2 policies
#      x 3,072 requests at 1,024 streams, each engine with its whole KV cache):
#        OUT=$OUT DEV=.devscripts $X benchmarks/fleet.sh install setup start throughput
#   3. no carry (timeout_s 600, ~4 min: a drain and a kill under the conversation workload, each node restarting):
#        OUT=$OUT $X FAIL_AT=6 benchmarks/fleet.sh drain failover stop
#   4. no carry (timeout_s 600, ~4 min: the cache-bound workload, KV per engine from `size`, 2 rounds):
#        OUT=$OUT $X KV_FRACTION=0.5 CONFIGS="round_robin sticky_least_loaded+system" ROUNDS=2 \
#          benchmarks/fleet.sh size start rounds summarize stop
#   5. no carry (timeout_s 600, ~5 min: the baselines with the whole KV cache, one GPU and vLLM's DP 4):
#        rm -f /tmp/gpu-logs/kv_bytes; OUT=$OUT GPU_UTIL=0.85 TOPOLOGY=one benchmarks/fleet.sh start throughput stop
#        && OUT=$OUT GPU_UTIL=0.85 TOPOLOGY=dp4 benchmarks/fleet.sh start throughput stop
#   6. no carry (timeout_s 600, ~3 min: DP 4 on the cache-bound workload, the KV of call 4):
#        OUT=$OUT GPU_UTIL=0.85 KV_FRACTION=0.5 TOPOLOGY=dp4 benchmarks/fleet.sh size start run stop
#   7. issue 43's hop (after `install setup` in an earlier call of this lease; timeout_s 600, ~5 min: 4 nodes start
#      at once, 5 paths x 2 rounds of ~15 s):
#        OUT=$OUT $X NODE_CPUS=12 LOADGEN_PROCS=8 benchmarks/fleet.sh start hop stop
#   8. if `vllm` (four nodes at once, no router) is already slow: the same with each engine core not pinned to one CPU
#        OUT=$OUT/pin-off $X NODE_CPUS=12 LOADGEN_PROCS=8 VLLAMA_EXTRA="--pin-engine-core off" benchmarks/fleet.sh start hop stop
#   9. issue 43's load placement (after `install setup` in an earlier call of this lease; timeout_s 600, ~6 min:
#      4 nodes start at once, 2 configurations x 2 rounds of 10,240 requests, ~25 s each at 60-90k tok/s):
#        OUT=$OUT $X NODE_CPUS=12 LOADGEN_PROCS=8 REQUESTS=10240 THROUGHPUT_ROUNDS=2 \
#          benchmarks/fleet.sh start throughput stop
#      (look for: sticky_least_loaded+system's output tok/s and TTFT p90 vs round_robin's, and each engine's
#      waiting p50/max: round robin let one node hold ~190 waiting; by load none should)
# Dry run against the stand-in (no GPU; vllm-router from the venv): PATH=$PWD/tests/bin:.venv/bin:$PATH
#   MODEL=<dir with a config.json> VLLAMA_EXTRA="--no-gpu-check --vllm-executable $PWD/tests/bin/vllm" NO_GPU=1
#   G=2 S=2 T=2 C=4 SYSTEM_WORDS=50 ROUNDS=2 benchmarks/fleet.sh start rounds summarize failover stop
#   (throughput: NODES=2 STREAMS=16 PROMPT_WORDS=16 TOKENS_T=16 REQUESTS=64 THROUGHPUT_ROUNDS=2 ... start throughput stop)
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs} DEV=${DEV:-shared/device} MODEL=${MODEL:-/tmp/model}
TOPOLOGY=${TOPOLOGY:-fleet} PLACEMENT=${PLACEMENT:-shared} GPU_UTIL=${GPU_UTIL:-0.4}
G=${G:-8} S=${S:-8} T=${T:-4} C=${C:-32} SYSTEM_WORDS=${SYSTEM_WORDS:-3000} TURN_WORDS=${TURN_WORDS:-64} TOKENS=${TOKENS:-64}
KV_FRACTION=${KV_FRACTION:-0.75} FAIL_AT=${FAIL_AT:-4} SERVED=qwen-random NODES=${NODES:-2}
STREAMS=${STREAMS:-1024} PROMPT_WORDS=${PROMPT_WORDS:-128} TOKENS_T=${TOKENS_T:-128} REQUESTS=${REQUESTS:-3*c}
THROUGHPUT_CONFIGS=${THROUGHPUT_CONFIGS:-sticky_least_loaded+system round_robin} THROUGHPUT_ROUNDS=${THROUGHPUT_ROUNDS:-1}
# the configurations `rounds` alternates (POLICY[+system][+balanced], see run-CONFIG), ROUNDS times each
CONFIGS=${CONFIGS:-round_robin sticky_least_loaded+system cache_aware+balanced consistent_hash+system cache_aware sticky_least_loaded}
ROUNDS=${ROUNDS:-4} FAILOVER_CONFIG=${FAILOVER_CONFIG:-sticky_least_loaded+system}
BALANCE_ARGS=${BALANCE_ARGS:---balance-abs-threshold 4 --balance-rel-threshold 1.2}
# ports: the front, the router and its Prometheus listener, nodes a and b and their vLLMs
PF=${PF:-11434} PF2=${PF2:-11435} PR=${PR:-30000} PP=${PP:-29000} PA=${PA:-11501} PB=${PB:-11502} VA=${VA:-8101} VB=${VB:-8102}
ROUTER=http://127.0.0.1:$PR FRONT=http://127.0.0.1:$PF FRONT_SYSTEM=http://127.0.0.1:$PF2
NAMES=(a b c d e f g h)  # fleet node i: ${NAMES[i]} on :PA+i, its vLLM on :VA+i
# NODE_CPUS=N: CPU sets, as the fleet recipe advises for instances sharing a host: node i (and with
# TOPOLOGY=one the node, dpK the node's K GPUs' worth) on N CPUs of its own, whole cores together
# (SMT siblings adjacent); the fronts, the router and the load generator on the rest.
NODE_CPUS=${NODE_CPUS:-} CPU_SLOTS=${CPU_SLOTS:-$NODES}
cpuset() {  # first count: CPUs [first*N, (first+count)*N) of the host ordered by core; "rest": what no slot takes
  python3 - "$1" "${2:-1}" "$NODE_CPUS" "$CPU_SLOTS" <<'PY'
import glob, os, sys
first, count, n, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def key(c):
    t = f"/sys/devices/system/cpu/cpu{c}/topology/"
    read = lambda f: int(open(t + f).read()) if os.path.exists(t + f) else 0
    return (read("physical_package_id"), read("core_id"), c)
cpus = sorted(os.sched_getaffinity(0), key=key)
pick = cpus[slots * n:] if first == "rest" else cpus[int(first) * n:(int(first) + count) * n]
print(",".join(map(str, sorted(pick))))
PY
}
pin() {  # slot count: PIN=(taskset -c CPUS) for that CPU set (slot "rest": the fronts, router, clients), or () without NODE_CPUS
  PIN=(); [ -n "$NODE_CPUS" ] && PIN=(taskset -c "$(cpuset "$1" "$2")"); return 0
}
mkdir -p "$OUT" "$LOGS/runs"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/vsite/bin:/tmp/site/bin:$PATH \
  VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLM_SERVER_DEV_MODE=1
ulimit -n "$(ulimit -Hn)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
now() { date +%s.%N; }
wait_url() {  # url pid seconds
  local t0; t0=$(now)
  until curl -sf "$1" > /dev/null; do
    if ! kill -0 "$2" 2>/dev/null; then log "$1: process exited"; return 1; fi
    if awk "BEGIN{exit !($(now) - $t0 > $3)}"; then log "$1 not ready after $3 s"; return 1; fi
    sleep 0.5
  done
  log "$1 ready after $(awk "BEGIN{printf \"%.1f\", $(now) - $t0}") s"
}
kv_args() { [ -f $LOGS/kv_bytes ] && echo "--kv-cache-memory-bytes $(cat $LOGS/kv_bytes)"; }
node() {  # name port vllm_port gpu [extra vllama flags...]: a node supervising its vLLM
  local name=$1 port=$2 vport=$3 gpu=$4; shift 4
  local placement=() gpus=(${gpu//,/ })
  pin "${gpus[0]}" "${#gpus[@]}"
  [ -z "${NO_GPU:-}" ] && placement=(env CUDA_VISIBLE_DEVICES=$gpu)
  VLLAMA_STATE_DIR=$LOGS/state-$name setsid "${placement[@]}" "${PIN[@]}" python3 -m vllama_proxy serve --model "$MODEL" \
    --served-model-name $SERVED --port "$port" --vllm-port "$vport" --keep-alive -1 --log-format json \
    ${VLLAMA_EXTRA:-} "$@" -- --max-model-len 16384 --enable-prefix-caching \
    $([ -z "${NO_GPU:-}" ] && echo "--gpu-memory-utilization $GPU_UTIL") $(kv_args) ${VLLM_ARGS:-} \
    > $LOGS/$name.log 2>&1 < /dev/null &
  echo $! > $LOGS/$name.pid
  wait_url "http://127.0.0.1:$port/readyz" "$(cat $LOGS/$name.pid)" 900 || { tail -30 $LOGS/$name.log; return 1; }
}
router() {  # policy [router flags...]: (re)start vllm-router with no workers; the nodes join it (--register-with)
  [ -f $LOGS/router.pid ] && kill -TERM "$(cat $LOGS/router.pid)" 2>/dev/null && sleep 1
  echo "[$(date -u +%H:%M:%S)] router: --policy $*" >> $LOGS/router.log
  # sticky_least_loaded logs each session it opens and finishes at info: 2 lines per request with the front's
  # one-request keys (--request-sessions), so that policy logs from warning up, as under vllama --router
  pin rest 1; RUST_LOG=${ROUTER_RUST_LOG:-info,vllm_router_rs::policies::sticky_least_loaded=warn} \
    setsid "${PIN[@]}" vllm-router --host 127.0.0.1 --port $PR --prometheus-port $PP --policy "$@" \
    --health-check-interval-secs 2 --health-failure-threshold 1 --health-success-threshold 1 \
    --worker-startup-check-interval 1 >> $LOGS/router.log 2>&1 < /dev/null &
  echo $! > $LOGS/router.pid
  wait_url $ROUTER/liveness "$(cat $LOGS/router.pid)" 30 || return 1
}
wait_workers() {  # n: until the router lists n healthy workers
  for _ in $(seq 120); do
    [ "$(curl -s $ROUTER/workers | python3 -c 'import json,sys; print(sum(w["is_healthy"] for w in json.load(sys.stdin)["workers"]))' 2>/dev/null)" = "$1" ] && return 0
    sleep 0.5
  done
  log "router: not $1 healthy workers after 60 s: $(curl -s $ROUTER/workers)"; return 1
}
metrics_urls() {
  if [ "$TOPOLOGY" = fleet ]; then
    local i urls=(); for i in $(seq 0 $((NODES - 1))); do urls+=("http://127.0.0.1:$((VA + i))/metrics"); done
    (IFS=,; echo "${urls[*]}")
  else echo http://127.0.0.1:$VA/metrics; fi
}
start_node() {  # i: fleet node i (waits until ready)
  local gpu=0; [ "$PLACEMENT" = split ] && gpu=$1
  node "${NAMES[$1]}" $((PA + $1)) $((VA + $1)) $gpu --register-with $ROUTER --register-interval 1
}
resumed_since() {  # t (date +%s.%N): the streams the fronts continued after a break since t, and their pauses
  grep -h '"stream_resumed"' $LOGS/front*.log 2>/dev/null | python3 -c "
import datetime, json, sys
t = datetime.datetime.fromtimestamp(float(sys.argv[1]), datetime.timezone.utc).isoformat().replace('+00:00', 'Z')
p = sorted(e['paused_s'] for e in map(json.loads, filter(lambda x: x.startswith('{'), sys.stdin)) if e['timestamp'] >= t)
print(f'  fronts: {len(p)} streams resumed' + (f', paused p50 {p[len(p) // 2]:.2f} s, max {p[-1]:.2f} s' if p else ''))" "$1"
}
turns_lost() {  # json t_event label: failed turns of a conversation run, in flight at t_event or started after
  python3 - "$@" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
at = float(sys.argv[2]) - r["t0_unix"]
failed = [t for t in r["timeline"] if not t[2]]
in_flight = [t for t in failed if t[0] <= at <= t[0] + t[1]]
print(f"  {sys.argv[3]} at {at:.1f} s: {len(failed)} turns failed ({len(in_flight)} in flight "
      f"then, {len([t for t in failed if t[0] > at])} started after); {r['ok']}/{r['requests']} turns ok")
EOF
}
reset_caches() {  # every engine's prefix cache emptied (vLLM's dev-mode route), so each run starts cold
  for u in $(metrics_urls | tr ',' ' '); do curl -s -X POST "${u%/metrics}/reset_prefix_cache" -o /dev/null -w "%{http_code} "; done
}
workload() {  # target json [extra loadgen args]
  pin rest 1; "${PIN[@]}" python3 benchmarks/loadgen.py --targets "x=ollama-chat:$1" --model $SERVED --conversations $G,$S,$T \
    --system-words $SYSTEM_WORDS --turn-words $TURN_WORDS --output-tokens $TOKENS --levels $C --no-check-tokens \
    --engine-metrics "$(metrics_urls)" --json "$2" "${@:3}"
}
config() {  # CONFIG: POLICY[+system][+balanced] -> $policy (with its router flags) and $front
  policy=${1%%+*} front=$FRONT
  case $1 in *+system*) front=$FRONT_SYSTEM ;; esac  # the front whose session key is the system prompt's
  case $1 in *+balanced*) policy="$policy $BALANCE_ARGS" ;; esac  # cache_aware spreading once 4 requests apart
}
run_config() {  # CONFIG ROUND: the router restarted for CONFIG, caches reset, the workload; $OUT/CONFIG-rROUND.json
  config "$1"
  # shellcheck disable=SC2086
  router $policy || return 1
  wait_workers $NODES || return 1
  log "$1 round $2: router --policy $policy, front $front; prefix caches reset ($(reset_caches)); G=$G S=$S T=$T, $C in flight"
  # a seed of its own per run: the same sizes, other words, so no run finds an earlier run's prefixes cached
  # even where the reset is refused (vLLM answers it only with VLLM_SERVER_DEV_MODE=1)
  local f=${1//+/.}-r$2  # file names of plain characters (what comes back from the device): + as .
  workload "$front" "$OUT/$f.json" --seed "$(cksum <<< "$1-$2" | cut -c1-6)" > "$LOGS/$f.txt" 2>&1
  cp "$OUT/$f.json" $LOGS/runs/
  report "$OUT/$f.json" "$1 r$2"
}
report() {  # json name
  python3 - "$1" "$2" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
c = r.get("cache") or {}
per = " ".join(f"{e['hits']:.0f}/{e['queries']:.0f} ({e['requests']:.0f} turns)" for e in c.get("engines", []))
print(f"  {sys.argv[2]}: {r['ok']}/{r['requests']} turns ok, cluster prefix-cache hit rate {c.get('cluster_hit_rate')} "
      f"(hits/queries per engine: {per}), TTFT p50 {r['ttft_ms']['p50']} ms p90 {r['ttft_ms']['p90']} ms, "
      f"ITL p50 {r['itl_ms']['p50']} ms, {r['output_tok_s']} output tok/s, wall {r['wall_s']} s")
EOF
}

for phase in "$@"; do case $phase in
install) "$DEV/install-vllm.sh" install || exit 1 ;;
setup)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl/*.whl
  [ -d .whl-router ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl-router/*.whl
  [ -f "$MODEL/config.json" ] || python3 "$DEV/make_random_model.py" "$MODEL"
  log "vllm $(python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null); vllm-router $(python3 -c 'import importlib.metadata as m; print(m.version("vllm-router"))'); $(nproc) CPUs; GPU: $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | tr '\n' ' ')"
  ;;
size)
  python3 - "$MODEL" $G $SYSTEM_WORDS $KV_FRACTION $C $T $TURN_WORDS $TOKENS > $LOGS/kv_bytes <<'EOF' || exit 1
import json, random, sys
sys.path.insert(0, "benchmarks")
from loadgen import VOCAB
from transformers import AutoTokenizer
model, groups, words, fraction = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
c, turns, turn_words, tokens = (int(x) for x in sys.argv[5:9])
cfg = json.load(open(f"{model}/config.json"))
head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2  # K and V, bf16
rng = random.Random(0)  # as loadgen's run_conversations makes the system prompts
tok = AutoTokenizer.from_pretrained(model)
systems = sum(len(tok(" ".join(rng.choices(VOCAB, k=words)))["input_ids"]) for _ in range(groups))
turn = len(tok(" ".join(rng.choices(VOCAB, k=turn_words)))["input_ids"])
session = turns * (turn + tokens + 8)  # what a session adds beyond its system prompt (+ chat template)
# One engine cannot hold every group's system prompt and the sessions in flight (it needs systems +
# c x session); with the groups split between two, each needs systems/2 + c/2 x session, which fits;
# round robin gives each engine every group again.
cache = int(fraction * systems + c / 2 * session)
print(cache * per_token)
print(f"system prompts {groups} x {systems // groups} tokens, a session {session} tokens beyond; KV {per_token} B/token; "
      f"per engine {cache} tokens = {cache * per_token / 2**30:.2f} GiB (all on one engine needs {systems + c * session})",
      file=sys.stderr)
EOF
  log "KV cache per engine: $(cat $LOGS/kv_bytes) bytes (--kv-cache-memory-bytes)"
  ;;
router-wheel)  # its own call: the vllm-router wheel (23 MB) does not fit beside a vLLM chunk in one carry
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/vsite .whl-router/*.whl || exit 1
  log "vllm-router $(python3 -c 'import importlib.metadata as m; print(m.version("vllm-router"))') in /tmp/vsite"
  ;;
start)
  case $TOPOLOGY in
  fleet)
    router cache_aware || exit 1
    if [ "$PLACEMENT" = split ]; then  # a GPU each: all at once
      pids=(); for i in $(seq 0 $((NODES - 1))); do start_node "$i" & pids+=($!); done
      for p in "${pids[@]}"; do wait "$p" || exit 1; done
    else  # sharing GPU 0: one after the other (two starting at once misjudge their KV cache)
      for i in $(seq 0 $((NODES - 1))); do start_node "$i" || exit 1; done
    fi
    wait_workers $NODES || exit 1
    pin rest 1; VLLAMA_STATE_DIR=$LOGS/state-front setsid "${PIN[@]}" python3 -m vllama_proxy serve --upstream $ROUTER --port $PF --log-format json \
      > $LOGS/front.log 2>&1 < /dev/null &
    echo $! > $LOGS/front.pid
    wait_url $FRONT/readyz "$(cat $LOGS/front.pid)" 60 || exit 1
    # a second front whose session key is the model and system prompt (--session-key system)
    VLLAMA_STATE_DIR=$LOGS/state-front2 setsid "${PIN[@]}" python3 -m vllama_proxy serve --upstream $ROUTER --port $PF2 --log-format json \
      --session-key system > $LOGS/front2.log 2>&1 < /dev/null &
    echo $! > $LOGS/front2.pid
    wait_url $FRONT_SYSTEM/readyz "$(cat $LOGS/front2.pid)" 60 || exit 1
    log "fleet up ($PLACEMENT): router $(curl -s $ROUTER/list_workers); front $(curl -s $FRONT/readyz | head -c 300)"
    ;;
  one) node a $PF $VA 0 || exit 1 ;;
  dp*) n=${TOPOLOGY#dp}; VLLM_ARGS="--data-parallel-size $n ${VLLM_ARGS:-}" node a $PF $VA "$(seq -s, 0 $((n - 1)))" || exit 1 ;;
  esac
  log "GPU: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
  ;;
run-*) run_config "${phase#run-}" 0 || exit 1 ;;
rounds)  # every CONFIG once per round, ROUNDS rounds, in the same order each round (alternating)
  for r in $(seq "$ROUNDS"); do for c in $CONFIGS; do run_config "$c" "$r" || exit 1; done; done
  ;;
summarize)  # every run so far ($LOGS/runs): per configuration, the median over rounds and the pooled turns
  python3 benchmarks/fleet_summary.py $LOGS/runs | tee "$OUT/summary-rounds.md"
  ;;
run)
  log "$TOPOLOGY: prefix caches reset ($(reset_caches)); workload G=$G S=$S T=$T, $C sessions in flight"
  workload $FRONT "$OUT/$TOPOLOGY.json" --seed "$(cksum <<< "$TOPOLOGY" | cut -c1-6)" > $LOGS/$TOPOLOGY.txt 2>&1
  report "$OUT/$TOPOLOGY.json" "$TOPOLOGY"
  ;;
failover)
  config "$FAILOVER_CONFIG"
  # shellcheck disable=SC2086
  router $policy || exit 1
  wait_workers $NODES || exit 1
  log "failover under $FAILOVER_CONFIG (router --policy $policy, front $front)"
  reset_caches > /dev/null
  restarts0=$(curl -s http://127.0.0.1:$PA/readyz | python3 -c 'import json,sys; print(json.load(sys.stdin)["restarts"])')
  workload "$front" "$OUT/failover.json" --conversations $G,$((S * 3)),$T --seed 99 > $LOGS/failover.txt 2>&1 &
  lg=$!
  sleep "$FAIL_AT"
  root=$(curl -s http://127.0.0.1:$PA/readyz | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
  engine=$(python3 -c "import psutil,sys; print(next((p.pid for p in psutil.Process($root).children(recursive=True) if p.name().startswith('VLLM::EngineCor')), $root))")
  t_kill=$(now); kill -9 "$engine"
  log "failover: SIGKILL to engine a's engine core ($engine) at $FAIL_AT s"
  for _ in $(seq 1200); do  # 10 min at most
    [ "$(curl -s http://127.0.0.1:$PA/readyz | python3 -c 'import json,sys; b=json.load(sys.stdin); print(b["state"] == "ready" and b["restarts"])' 2>/dev/null)" = "$((restarts0 + 1))" ] && break
    sleep 0.5
  done
  t_ready=$(now)
  wait_workers $NODES; t_back=$(now)
  wait $lg
  python3 - "$OUT/failover.json" "$t_kill" "$t_ready" "$t_back" <<'EOF' | tee -a "$OUT/summary.txt" "$OUT/failover.txt"
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
kill, ready, back = (float(x) - r["t0_unix"] for x in sys.argv[2:5])
failed = [t for t in r["timeline"] if not t[2]]
in_flight = [t for t in failed if t[0] <= kill <= t[0] + t[1]]
after = [t for t in failed if t[0] > kill]
last_end = max((t[0] + t[1] for t in failed), default=kill)
print(f"  kill at {kill:.1f} s: {len(failed)} turns failed ({len(in_flight)} in flight at the kill, {len(after)} started after it); "
      f"last failure ended {last_end - kill:.2f} s after the kill; engine a ready again {ready - kill:.1f} s after, "
      f"back in the router's rotation {back - kill:.1f} s after; {r['ok']}/{r['requests']} turns ok")
EOF
  resumed_since "$t_kill" | tee -a "$OUT/summary.txt" "$OUT/failover.txt"
  report "$OUT/failover.json" failover
  ;;
throughput)  # distinct prompts, 128 in / 128 out, STREAMS in flight, through the front (or the node)
  tput() {  # name [front]: the run, each engine's load sampled beside it
    python3 - "$(metrics_urls)" "$LOGS/load-$1.json" <<'EOF' &
import json, re, signal, sys, time, urllib.request
# every second, each engine's vllm:num_requests_running / _waiting; at SIGTERM its requests answered meanwhile
urls, out = sys.argv[1].split(","), sys.argv[2]
def read(u, name):
    try:
        text = urllib.request.urlopen(u, timeout=2).read().decode()
    except OSError:
        return None
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
first = [read(u, "vllm:request_success_total") for u in urls]
samples = [[] for _ in urls]
def done(*_):
    last = [read(u, "vllm:request_success_total") for u in urls]
    json.dump({"urls": urls, "samples": samples, "answered": [(b or 0) - (a or 0) for a, b in zip(first, last)]}, open(out, "w"))
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
while True:
    for i, u in enumerate(urls):
        samples[i].append((read(u, "vllm:num_requests_running"), read(u, "vllm:num_requests_waiting")))
    time.sleep(1)
EOF
    local sampler=$!
    # the first wave opens ~STREAMS connections at once: a listen queue that overflows drops connects, retried
    # after 1 s (issue 43: 208-585 of the 1,024 first requests waited 1-3 s between front and nodes)
    local ports="$PF,$PF2,$PR" i; for i in $(seq 0 $((NODES - 1))); do ports="$ports,$((PA + i)),$((VA + i))"; done
    python3 benchmarks/session_turnaround.py --listen-watch 0 --ports "$ports" > "$OUT/listen-$1.txt" 2>&1 &
    local watcher=$! w; for w in $(seq 100); do [ -s "$OUT/listen-$1.txt" ] && break; sleep 0.1; done  # its SIGTERM handler set
    pin rest 1; "${PIN[@]}" python3 benchmarks/loadgen.py --targets "x=ollama-chat:${2:-$FRONT}" --model $SERVED --levels "$STREAMS" --cpu-by-kind \
      --requests-per-level "$REQUESTS" --prompt-words "$PROMPT_WORDS" --output-tokens "$TOKENS_T" --no-check-tokens \
      --procs "${LOADGEN_PROCS:-4}" --seed "$(cksum <<< "$1" | cut -c1-6)" --raise-nofile --json "$OUT/throughput-$1.json" > "$LOGS/throughput-$1.txt" 2>&1
    kill -TERM $sampler $watcher; wait $sampler $watcher
    cp "$LOGS/load-$1.json" "$OUT/"; echo "    $(tail -1 "$OUT/listen-$1.txt")" | tee -a "$OUT/summary.txt"
    python3 - "$OUT/throughput-$1.json" "$1" "$LOGS/load-$1.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, statistics, sys
r = json.load(open(sys.argv[1]))["levels"][0]["runs"][0]
load = json.load(open(sys.argv[3]))
def spread(i):  # p50/max running and waiting over the samples where the engine had any request
    s = [x for x in load["samples"][i] if None not in x and sum(x) > 0] or [(0, 0)]
    run, wait = [x[0] for x in s], [x[1] for x in s]
    return f"{statistics.median(run):.0f}/{max(run):.0f} running, {statistics.median(wait):.0f}/{max(wait):.0f} waiting"
engines = "; ".join(f"{chr(97 + i)}: {n:.0f} answered, {spread(i)}" for i, n in enumerate(load["answered"]))
print(f"  throughput {sys.argv[2]}: {r['ok']}/{r['requests']} ok, {r['output_tok_s']} output tok/s, "
      f"TTFT p50 {r['ttft_ms']['p50']} ms p90 {r['ttft_ms']['p90']} ms, ITL p50 {r['itl_ms']['p50']} ms, wall {r['wall_s']} s; "
      f"cores busy {r.get('machine_cores')}\n    engines (p50/max): {engines}")
EOF
  }
  if [ "$TOPOLOGY" = fleet ]; then
    for r in $(seq "$THROUGHPUT_ROUNDS"); do for c in $THROUGHPUT_CONFIGS; do
      config "$c"
      # shellcheck disable=SC2086
      router $policy || exit 1; wait_workers $NODES || exit 1
      log "throughput round $r: $NODES nodes, router --policy $policy, front $front, $STREAMS streams, $PROMPT_WORDS words in / $TOKENS_T tokens out, $REQUESTS requests"
      tput "$TOPOLOGY$NODES-${c//+/.}-r$r" "$front"  # file names of plain characters: + as .
    done; done
  else
    log "throughput: $TOPOLOGY, $STREAMS streams, $PROMPT_WORDS words in / $TOKENS_T tokens out"; tput "$TOPOLOGY"
  fi
  ;;
drain|nodekill)  # the last node under the conversation workload, FAIL_AT s in: drain, SIGTERM (its drain);
  # nodekill, SIGKILLed whole with its vLLM (a host that dies: the front continues each of its streams through the
  # router on another node); then started again
  config "$FAILOVER_CONFIG"
  # shellcheck disable=SC2086
  router $policy || exit 1
  wait_workers $NODES || exit 1
  last=$((NODES - 1)) name=${NAMES[$((NODES - 1))]} seed=98
  [ "$phase" = nodekill ] && seed=97
  log "$phase of node $name under $FAILOVER_CONFIG (router --policy $policy, front $front)"
  workload "$front" "$OUT/$phase.json" --conversations $G,$((S * 3)),$T --seed $seed > $LOGS/$phase.txt 2>&1 &
  lg=$!
  sleep "$FAIL_AT"
  pid=$(cat $LOGS/$name.pid); t_event=$(now)
  if [ "$phase" = drain ]; then
    what="its SIGTERM" label="drain (SIGTERM)"
    kill -TERM "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    log "drain: node $name (pid $pid) got SIGTERM at $FAIL_AT s, exited $(awk "BEGIN{printf \"%.1f\", $(now) - $t_event}") s later; starting it again"
  else
    what="the kill" label="node killed (SIGKILL)"
    python3 -c "import psutil; p = psutil.Process($pid); [q.kill() for q in [*p.children(recursive=True), p]]"
    log "nodekill: node $name (pid $pid) and its vLLM SIGKILLed at $FAIL_AT s; starting it again"
  fi
  start_node "$last" || exit 1
  wait_workers $NODES; t_back=$(now)
  log "$phase: node $name back in the router's rotation $(awk "BEGIN{printf \"%.1f\", $t_back - $t_event}") s after $what"
  wait $lg
  turns_lost "$OUT/$phase.json" "$t_event" "$label" | tee -a "$OUT/summary.txt" "$OUT/$phase.txt"
  resumed_since "$t_event" | tee -a "$OUT/summary.txt" "$OUT/$phase.txt"
  report "$OUT/$phase.json" $phase
  ;;
hop)  # issue 43's hop, fleet up, the router on round_robin: the same 1,024 streams (STREAMS) four ways, in
  # alternating rounds (HOP_ROUNDS, 2): NODES loadgens in parallel, each straight at one node's vLLM (vllm),
  # or at its vllama's /v1 passthrough (node); one loadgen at the router (router, OpenAI chat); one at the
  # front (front, Ollama chat); and node a's vLLM alone at STREAMS/NODES (alone: the earlier diag's one node,
  # as a baseline in the same call). Earlier diags ran one node alone, never all of them at once without the
  # router. Also logged: each engine core's CPU affinity and threads (vllama pins each to one CPU).
  router round_robin || exit 1; wait_workers $NODES || exit 1
  for pid in $(pgrep -f '^VLLM::EngineCore'); do
    log "hop: engine core $pid: $(taskset -cp "$pid" 2>/dev/null | sed 's/.*: //') CPUs, $(ls /proc/$pid/task | wc -l) threads, $(ps -o psr= -L -p "$pid" | sort -u | tr '\n' ' ')on CPUs now"
  done
  engine_ticks() {  # "pid ticks" of each engine core (user+system, all its threads), and the time
    echo "t $(now)"; for pid in $(pgrep -f '^VLLM::EngineCore'); do echo "$pid $(awk '{print $14 + $15}' /proc/$pid/stat)"; done
  }
  hop_run() {  # path round
    local path=$1 r=$2 i pids=() per=$((STREAMS / NODES)) procs=$(( ${LOADGEN_PROCS:-8} / NODES > 0 ? ${LOADGEN_PROCS:-8} / NODES : 1 ))
    local before; before=$(engine_ticks)
    lg() {  # tag target streams procs
      pin rest 1; "${PIN[@]}" python3 benchmarks/loadgen.py --targets "x=$2" --model $SERVED --levels "$3" --cpu-by-kind \
        --requests-per-level "$((3 * $3))" --prompt-words "$PROMPT_WORDS" --output-tokens "$TOKENS_T" --no-check-tokens \
        --warmup 2 --procs "$4" --seed "$((r * 10 + ${#path}))" --raise-nofile --json "$OUT/hop-$path-r$r-$1.json" > "$LOGS/hop-$path-r$r-$1.txt" 2>&1
    }
    case $path in
      vllm|node) for i in $(seq 0 $((NODES - 1))); do
          lg "${NAMES[$i]}" "openai-chat:http://127.0.0.1:$(( $([ $path = vllm ] && echo $VA || echo $PA) + i ))" $per $procs & pids+=($!)
        done; wait "${pids[@]}" ;;
      alone) lg a "openai-chat:http://127.0.0.1:$VA" $per "$procs" ;;
      router) lg all "openai-chat:$ROUTER" "$STREAMS" "${LOADGEN_PROCS:-8}" ;;
      front) lg all "ollama-chat:$FRONT" "$STREAMS" "${LOADGEN_PROCS:-8}" ;;
    esac
    python3 - "$before" "$(engine_ticks)" "$path" "$r" "$(getconf CLK_TCK)" <<'PY' | tee -a "$OUT/summary.txt"
import sys
a, b = ({l.split()[0]: float(l.split()[1]) for l in x.splitlines()} for x in sys.argv[1:3])
wall, tck = b.pop("t") - a.pop("t"), float(sys.argv[5])
print(f"  hop {sys.argv[3]} r{sys.argv[4]}: engine cores busy (CPU/wall, {wall:.1f} s incl. the loadgens' start): "
      + ", ".join(f"{p} {(b[p] - a[p]) / tck / wall:.2f}" for p in b if p in a))
PY
  }
  log "hop: $NODES nodes, round_robin, $STREAMS streams, $PROMPT_WORDS words in / $TOKENS_T tokens out, ${HOP_ROUNDS:-2} rounds"
  for r in $(seq 1 "${HOP_ROUNDS:-2}"); do
    order="alone vllm node router front"; [ $((r % 2)) = 0 ] && order="front router node vllm alone"
    for p in $order; do hop_run $p $r; done
  done
  python3 benchmarks/router_hop.py --summarize-loadgen "$OUT" | tee -a "$OUT/summary.txt" "$OUT/hop.md"
  ;;
stop)
  for f in front front2 router a b c d e f g h; do
    [ -f $LOGS/$f.pid ] || continue; pid=$(cat $LOGS/$f.pid); kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid"; for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    rm -f $LOGS/$f.pid
  done
  sleep 2
  log "stopped; vLLM processes left: $(pgrep -fc '^VLLM::|vllm serve' || true), routers left: $(pgrep -fc 'vllm-router|vllm::router' || true); GPU $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
  for f in front front2 a b c d e f g h router; do [ -f $LOGS/$f.log ] && gzip -c $LOGS/$f.log > "$OUT/$f.log.gz"; done
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac; done
