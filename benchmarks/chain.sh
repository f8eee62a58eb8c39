#!/usr/bin/env bash
# A lease's measurements as one chain in the background, and the device calls that wait for it.
#
# The lent machine goes back 30 s after a call ends, with every file on it: a chain that runs longer than one
# call (10 minutes) lives only while the calls that wait for it follow one another at once, and what it wrote
# comes back only through a call's $OUT. So each wait brings back everything the chain has written so far, and a
# machine given back early loses only the command in flight (session 15 lost three phases and their raw files).
#
#   benchmarks/chain.sh start NAME 'CMD' ['CMD' ...]
#       runs the commands one after another in the background (setsid, no terminal), from the repository root,
#       each with OUT=/tmp/chain/NAME/<i> (a folder of its own), its console in /tmp/chain/NAME/<i>.log, its
#       start, end and exit status in /tmp/chain/NAME/chain.txt; returns at once
#   benchmarks/chain.sh wait NAME [SECONDS]
#       waits until the chain has ended or SECONDS (570) have passed, then puts /tmp/chain/NAME (every command's
#       OUT folder and console) into $OUT/NAME.tar.gz and prints chain.txt and the running command's last lines;
#       exit status 0 once the chain has ended, 3 while it runs (call it again at once, timeout_s 600)
#
# Example (issue 42, after the stash calls; each line one device call, the next made as soon as one returns):
#   OUT=$OUT DEV=.devscripts benchmarks/hop_cost.sh install setup start && benchmarks/chain.sh start s42 \
#       'SWEEP_LEVELS="16 64 256" SWEEP_BLOCKS=40 benchmarks/hop_cost.sh sweep' \
#       'SPLIT_ROUNDS=24 benchmarks/hop_cost.sh c1split' 'BATCH_ALT=3 benchmarks/hop_cost.sh batchalt'
#   OUT=$OUT benchmarks/chain.sh wait s42          (again while it exits 3)
# Dry run on any machine: `benchmarks/chain.sh start t 'echo a > $OUT/a' 'false'; benchmarks/chain.sh wait t 5`.
set -u
cd "$(dirname "$0")/.."
verb=${1:-} name=${2:-}
[ -n "$verb" ] && [ -n "$name" ] || { sed -n '9,18p' "$0"; exit 2; }
dir=/tmp/chain/$name
case $verb in
start)
  shift 2
  mkdir -p "$dir" && : > "$dir/chain.txt"
  i=0; script="cd '$PWD'"
  for cmd in "$@"; do
    i=$((i + 1))
    q=$(printf '%q' "$cmd")
    script+="; mkdir -p $dir/$i; echo \"[\$(date -u +%T)] $i start: \"$q >> $dir/chain.txt"
    script+="; (export OUT=$dir/$i; bash -c $q) > $dir/$i.log 2>&1; rc=\$?; echo \"[\$(date -u +%T)] $i exit \$rc\" >> $dir/chain.txt"
  done
  script+="; echo \"[\$(date -u +%T)] chain ended\" >> $dir/chain.txt"
  (setsid bash -c "$script" < /dev/null > /dev/null 2>&1 &)
  echo "chain $name: $i commands, started; benchmarks/chain.sh wait $name"
  ;;
wait)
  [ -f "$dir/chain.txt" ] || { echo "no chain $name"; exit 2; }
  end=$((SECONDS + ${3:-570}))
  until grep -q "chain ended" "$dir/chain.txt" || [ $SECONDS -ge $end ]; do sleep 2; done
  mkdir -p "${OUT:-/tmp/out}"
  tar -czf "${OUT:-/tmp/out}/$name.tar.gz" -C /tmp/chain "$name"
  cat "$dir/chain.txt"
  if grep -q "chain ended" "$dir/chain.txt"; then exit 0; fi
  running=$(ls -t "$dir"/*.log 2> /dev/null | head -1)
  [ -n "$running" ] && { echo "--- $running"; tail -5 "$running"; }
  exit 3
  ;;
*) sed -n '9,18p' "$0"; exit 2 ;;
esac
