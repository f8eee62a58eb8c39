#!/usr/bin/env bash
# On the lent GPU: a burst is held (5,000 and 20,000 requests at once through vllama to the real vLLM) and an idle
# engine is never called hung (sweep, c1split, batch as hop_cost.sh's phases run them, CYCLES (3) times, with no
# restart; vLLM's gauges read on every API server after each batch). From the repo root, in phases, after
# hop_cost.sh's `install setup` (the same prerequisites: its header) and `start` (vllama with its defaults on :11434,
# its vLLM on :8100). vllama keeps running between calls while the machine stays warm.
#
#   burst    BURSTS ("5000 20000") non-streamed /api/generate requests at once (BURST_TOKENS 32 output tokens,
#            128-word prompts, 4 client processes), one burst after the other; per burst: answered / ok / errors by
#            kind (loadgen's burst table), vllama's restarts before and after (/readyz), the upstream_retry and
#            engine_gauge_* lines of its log. 20,000 is beyond the default admission bound (max_running 1,024 +
#            --max-queue 8,192): start vllama with VLLAMA_EXTRA="--max-queue 20000" to have every request admitted
#            (otherwise the rest get Ollama's 503 "server busy" at once, which is admission, not a failed burst).
#            BURST_NOFILE (e.g. 1048576): the load generator's RLIMIT_NOFILE, soft and hard, raised to that for its
#            processes alone where the kernel lets it (not on the lent H200: its hard limit of 20,000 stands, even for
#            root); vllama keeps the limit it started with, and its --max-connections-per-address (a quarter of that
#            limit per process) closes a single client's connections beyond it: a 20,000 burst from one address needs it raised.
#            Per burst also: the kernel's TCP counters that tell a dropped or reset connect (listen overflows and
#            drops, resets sent, aborts, SYN cookies: /proc/net/netstat and snmp, after minus before), the listen
#            sockets of :PB with their backlog, and the most descriptors each client and vllama process held
#            (benchmarks/fd_peak.py) beside its limit.
#   cycle    CYCLES (3) times: hop_cost.sh sweep (SWEEP_LEVELS "16 64 256", SWEEP_BLOCKS 6 to fit a call), c1split,
#            batch (BATCH_N 5000, no -c); after each batch: vLLM's num_requests_running / waiting /
#            generation_tokens_total on 16 fresh connections, and as each API server process last wrote them
#            (benchmarks/vllm_gauges.py: value, age, process alive: a stale writer vs requests vLLM kept), again 10 s and
#            130 s later (GAUGE_WAITS "10 120": past --hang-timeout 120 s), then `vllama stop` and the seconds until /readyz says sleeping
#            (or unloaded), then one request to wake it. Pass: restarts unchanged, no "engine hung" in the log, the
#            stop slept the model. The engine_gauge_stale / engine_gauge_ignored lines say when a gauge was stale.
#   gauges   the 16-connection read of vLLM's gauges alone; GAUGE_LABEL names its file (gauges-LABEL.txt)
#   warnings vllama's warning and error lines so far, counted by text: vllama-warnings.txt
#
# Calls (timeout_s 600 each; the machine must stay warm between them):
#   0: OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh install setup start             (~3.5 min)
#      (for the 20,000 burst: VLLAMA_EXTRA="--max-queue 20000" on that call)
#   1: OUT=$OUT benchmarks/burst_gpu.sh burst                                           (~2-4 min)
#   2-4: OUT=$OUT CYCLES=1 benchmarks/burst_gpu.sh cycle                                (~8 min each; once per call)
#   then: OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh stop
# Outputs in $OUT: summary.txt (every result), burst-<N>.json, gauges-*.txt.
# Dry run on the stand-in (no GPU), as hop_cost.sh's: PATH=$PWD/tests/bin:$PATH FAKE_VLLM_PYTHON=$(command -v python3)
# MODEL=<a model dir> VLLAMA_EXTRA=--no-gpu-check NO_GPU=1 hop_cost.sh start, then BURSTS=500 burst_gpu.sh burst and
# SWEEP_LEVELS=4 SWEEP_BLOCKS=1 SPLIT_ROUNDS=2 BATCH_N=50 TOKENS=8 GAUGE_WAITS="1" CYCLES=1 burst_gpu.sh cycle.
set -u
OUT=${OUT:-/tmp/gpu-out} LOGS=${LOGS:-/tmp/gpu-logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=$LOGS/state
PB=${PB:-11434} PC=${PC:-8100}
B=http://127.0.0.1:$PB C=http://127.0.0.1:$PC SERVED=qwen-random
ulimit -n "$(ulimit -Hn)"
HERE=$(cd "$(dirname "$0")" && pwd)
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
say() { tee -a "$OUT/summary.txt"; }
readyz() { curl -s "$B/readyz" | python3 -c "import json, sys; d = json.load(sys.stdin); print(d.get('$1'))"; }
vllama_log() { ls -t $LOGS/vllama*.log 2>/dev/null | head -1; }
log_lines() { grep -ac "\"$1\"" "$(vllama_log)" 2>/dev/null || true; }
tcp_counters() {  # name value lines of /proc/net/netstat (TcpExt) and /proc/net/snmp (Tcp), sorted for join
  awk '$1 == "TcpExt:" || $1 == "Tcp:" { if (!($1 in hdr)) { hdr[$1] = $0; next } split(hdr[$1], h); for (i = 2; i <= NF; i++) print h[1] h[i], $i; delete hdr[$1] }' \
    /proc/net/netstat /proc/net/snmp | LC_ALL=C sort
}
gauges() {  # $1: label. 16 reads of vLLM's /metrics, each on a new connection (curl), so that several API servers answer
  { echo "gauges $1 ($(date -u +%H:%M:%S)):"
    for _ in $(seq 16); do
      curl -s "$C/metrics" | grep -aE '^vllm:(num_requests_running|num_requests_waiting|generation_tokens_total)' \
        | awk '{split($1, n, "{"); v[n[1]] += $2} END {printf "running %s waiting %s tokens %s\n", v["vllm:num_requests_running"], v["vllm:num_requests_waiting"], v["vllm:generation_tokens_total"]}'
    done | sort | uniq -c
    python3 benchmarks/vllm_gauges.py; } | tee "$OUT/gauges-$1.txt" | say
}

for phase in "$@"; do case $phase in
burst)
  log "sysctl: $(for k in net.core.somaxconn net.ipv4.tcp_max_syn_backlog net.ipv4.tcp_abort_on_overflow net.ipv4.tcp_syncookies fs.nr_open fs.file-max; do printf '%s=%s ' $k "$(sysctl -n $k 2>/dev/null)"; done); this shell's nofile $(ulimit -Sn)/$(ulimit -Hn)"
  ss -ltnp "sport = :$PB" | say
  for n in ${BURSTS:-5000 20000}; do
    r0=$(readyz restarts)
    log "burst $n at once: non-streamed /api/generate, ${BURST_TOKENS:-32} tokens; restarts before $r0; $(grep -m1 -ao '"connects_per_worker":[0-9]*' "$(vllama_log)")"
    tcp_counters > $LOGS/tcp-before-$n.txt
    python3 benchmarks/fd_peak.py --match 'benchmarks/loadgen\.py' --match 'vllama_proxy serve' --seconds 600 > $LOGS/fds-$n.txt 2>&1 &
    fdp=$!
    ( if [ -n "${BURST_NOFILE:-}" ]; then ulimit -Hn "$BURST_NOFILE" && ulimit -Sn "$BURST_NOFILE" || echo "could not raise nofile to $BURST_NOFILE"; fi
      echo "load generator's nofile: $(ulimit -Sn)/$(ulimit -Hn)"
      exec python3 benchmarks/loadgen.py --model $SERVED --output-tokens "${BURST_TOKENS:-32}" --prompt-words 128 --raise-nofile \
        --targets "b=ollama-nostream:$B" --burst "$n" --warmup 0 --procs 4 --json "$OUT/burst-$n.json" ) > $LOGS/burst-$n.txt 2>&1 \
      || log "burst $n: loadgen reported errors"
    kill -TERM $fdp; wait $fdp
    grep -aE "nofile|RLIMIT" $LOGS/burst-$n.txt | say
    grep -E '^\|' $LOGS/burst-$n.txt | say
    python3 -c "import json, sys; [print('errors by kind:', s['error_samples']) for s in json.load(open(sys.argv[1])).get('burst', [])]" \
      "$OUT/burst-$n.json" 2>&1 | say
    tcp_counters > $LOGS/tcp-after-$n.txt
    { echo "TCP counters, after - before (non-zero):"; LC_ALL=C join $LOGS/tcp-before-$n.txt $LOGS/tcp-after-$n.txt | awk '$3 != $2 {printf "  %s %d\n", $1, $3 - $2}'
      echo "peak descriptors:"; head -12 $LOGS/fds-$n.txt; } | say
    log "burst $n: restarts after $(readyz restarts); upstream_retry lines $(log_lines upstream_retry); engine_gauge_stale $(log_lines engine_gauge_stale)"
  done
  ;;
gauges) gauges "${GAUGE_LABEL:-now}" ;;
warnings)  # vllama's warning and error lines, counted by text (timestamps and request ids cut): vllama-warnings.txt
  grep -aE '"level":"(warning|error|critical)"' "$(vllama_log)" | sed -E 's/"(timestamp|request_id|id)":"[^"]*",?//g' | cut -c1-260 \
    | sort | uniq -c | sort -rn | head -60 > "$OUT/vllama-warnings.txt"
  log "vllama's warning/error lines: $(awk '{n += $1} END {print n + 0}' "$OUT/vllama-warnings.txt") ($OUT/vllama-warnings.txt)"
  head -8 "$OUT/vllama-warnings.txt" | cut -c1-200 | say
  ;;
cycle)
  for i in $(seq 1 "${CYCLES:-3}"); do
    r0=$(readyz restarts) hung0=$(grep -ac "engine hung" "$(vllama_log)" || true)
    log "cycle $i: restarts before $r0"
    OUT=$OUT SWEEP_LEVELS=${SWEEP_LEVELS:-16 64 256} SWEEP_BLOCKS=${SWEEP_BLOCKS:-6} bash "$HERE/hop_cost.sh" sweep c1split batch
    gauges "cycle$i-0s"; waited=0
    for w in ${GAUGE_WAITS:-10 120}; do sleep "$w"; waited=$(( waited + w )); gauges "cycle$i-${waited}s"; done
    t=$(date +%s.%N)
    OLLAMA_HOST=$B python3 -m vllama_proxy stop $SERVED > /dev/null 2>&1 || log "vllama stop failed"
    for _ in $(seq 240); do s=$(readyz state); [ "$s" = sleeping ] || [ "$s" = unloaded ] && break; sleep 0.5; done
    log "cycle $i: after vllama stop: state $(readyz state) in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t}") s"
    curl -s "$B/api/generate" -d "{\"model\": \"$SERVED\", \"prompt\": \"hi\", \"stream\": false, \"options\": {\"num_predict\": 4}}" \
      | cut -c1-120 | say
    hung=$(( $(grep -ac "engine hung" "$(vllama_log)" || true) - hung0 ))
    log "cycle $i: restarts after $(readyz restarts) (before $r0); new 'engine hung' lines $hung; engine_gauge_stale $(log_lines engine_gauge_stale), engine_gauge_ignored $(log_lines engine_gauge_ignored)"
    [ "$(readyz restarts)" = "$r0" ] && [ "$hung" = 0 ] && log "cycle $i: PASS (no restart)" || log "cycle $i: FAIL (restarted)"
  done
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac; done
