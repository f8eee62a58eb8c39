#!/usr/bin/env bash
# Issue 21: train the tool/thinking model on the lent GPU, check it through vLLM 0.26's own
# parsers under vllama (gpu_tools.sh: the issue-13 transcript with the real ollama client), and
# bring the model back to ship as a test asset (tests/assets/tool-model, ~21 MB in bf16).
#
# Prerequisites: as gpu_tools.sh (vLLM 0.26 in /tmp/site, vllama's deps in /tmp/vsite, the
# client wheels in .whl/tool-wheels). From the repo root, one device call (~6 minutes):
#   OUT=$OUT benchmarks/tool_model/gpu_ship.sh
# $OUT gets at most 8 files of at most 16 MiB each (the device tool's limits), so the model and
# the run's outputs come back as one tar split into 15 MiB pieces: tool-run.tar.NN, plus the
# transcript and training summaries beside them. Put it back together here with
#   cat tool-run.tar.* | tar -x -C DIR        (DIR/toolmodel: the model, DIR/run: the outputs)
# Knobs: TRAIN_MINUTES (3.5), SEED (0), TRAIN_ARGS.
set -u
FINAL=${OUT:-/tmp/gpu-out}
WORK=/tmp/tool-ship
rm -rf "$WORK" && mkdir -p "$WORK/run" "$FINAL"
OUT=$WORK/run TRAIN_MINUTES=${TRAIN_MINUTES:-3.5} TRAIN_ARGS="--seed ${SEED:-0} ${TRAIN_ARGS:-}" \
  bash benchmarks/tool_model/gpu_tools.sh
rc=$?
echo "gpu_tools.sh exit $rc"
if [ -f /tmp/toolmodel/model.safetensors ]; then
  cp -r /tmp/toolmodel "$WORK/toolmodel"
  (cd "$WORK/toolmodel" && sha256sum ./* > SHA256SUMS && cat SHA256SUMS && du -b model.safetensors)
fi
tar -cf - -C "$WORK" . | split -b 15m -d -a 2 - "$FINAL/tool-run.tar."
cp "$WORK/run/e2e_tools.out" "$WORK/run/train_report.json" "$FINAL/" 2>/dev/null
grep -E "held-out|saved|stopping|params" "$WORK/run/train.log" | tail -8 > "$FINAL/train-summary.txt"
ls -la "$FINAL"
exit $rc
