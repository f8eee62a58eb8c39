#!/usr/bin/env bash
# Installs vllama as a systemd service (deploy/systemd/vllama.service). Idempotent: run it
# again to upgrade vllama in place; an existing /etc/vllama/vllama.env is kept.
#
#   sudo scripts/install-systemd.sh [--no-vllm] [--start]
#
#   --no-vllm   install vllama without the `vllm` extra (vllm already in the venv, or you
#               point VLLAMA_VLLM_EXECUTABLE at another install)
#   --start     also start (or restart) the service now; otherwise it is only enabled
#
# Environment: PYTHON (python3), PREFIX (/opt/vllama), VLLM_SPEC (extra pip requirement,
# e.g. 'vllm==0.26.0', to pin the vLLM version).
#
# Steps: system user and group `vllama`; venv in $PREFIX/venv with vllama (and vLLM) from
# this checkout; unit in /etc/systemd/system; env file in /etc/vllama; daemon-reload; enable.
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
PREFIX=${PREFIX:-/opt/vllama}
VLLM_SPEC=${VLLM_SPEC:-}
UNIT_DIR=/etc/systemd/system
CONF_DIR=/etc/vllama
with_vllm=1
start=0

for arg in "$@"; do
  case "$arg" in
    --no-vllm) with_vllm=0 ;;
    --start) start=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "install-systemd.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

if [ "$(id -u)" -ne 0 ]; then
  echo "install-systemd.sh: run as root (sudo)" >&2
  exit 1
fi
if [ "$PREFIX" != /opt/vllama ]; then
  echo "install-systemd.sh: note: the unit runs /opt/vllama/venv/bin/vllama; override ExecStart= in a drop-in for PREFIX=$PREFIX" >&2
fi

# 1. the service user: no login, home = the unit's StateDirectory
if ! getent group vllama >/dev/null; then
  groupadd --system vllama
fi
if ! id -u vllama >/dev/null 2>&1; then
  useradd --system --gid vllama --home-dir /var/lib/vllama --no-create-home \
    --shell /usr/sbin/nologin --comment "vllama (Ollama API on vLLM)" vllama
fi
# GPU device nodes are group-restricted on some distributions
for g in video render; do
  if getent group "$g" >/dev/null && ! id -nG vllama | tr ' ' '\n' | grep -qx "$g"; then
    usermod -aG "$g" vllama
  fi
done

# 2. the virtualenv, owned by root: the service cannot modify its own code
install -d -m 0755 "$PREFIX"
if [ ! -x "$PREFIX/venv/bin/python" ]; then
  "$PYTHON" -m venv "$PREFIX/venv"
fi
"$PREFIX/venv/bin/python" -m pip install --quiet --upgrade pip
# build from a copy: pip builds in the source tree otherwise (build/, *.egg-info)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -r "$SRC/pyproject.toml" "$SRC/README.md" "$SRC/vllama_proxy" "$stage/"
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
spec="$stage"
if [ "$with_vllm" -eq 1 ]; then
  spec="${stage}[vllm]"
fi
# shellcheck disable=SC2086  # VLLM_SPEC is empty or one requirement
"$PREFIX/venv/bin/python" -m pip install --quiet --upgrade "$spec" $VLLM_SPEC
"$PREFIX/venv/bin/vllama" serve --help >/dev/null

# 3. unit and settings
install -m 0644 "$SRC/deploy/systemd/vllama.service" "$UNIT_DIR/vllama.service"
install -d -m 0750 -o root -g vllama "$CONF_DIR"
if [ -e "$CONF_DIR/vllama.env" ]; then
  echo "kept $CONF_DIR/vllama.env (the shipped example is $SRC/deploy/systemd/vllama.env)"
else
  install -m 0640 -o root -g vllama "$SRC/deploy/systemd/vllama.env" "$CONF_DIR/vllama.env"
  echo "wrote $CONF_DIR/vllama.env: set VLLAMA_MODEL and friends there"
fi

# 4. systemd (absent in containers and chroots: then only the files are installed)
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
  systemctl daemon-reload
  systemctl enable vllama.service
  if [ "$start" -eq 1 ]; then
    systemctl restart vllama.service
    echo "started; it is active once the model is loaded: systemctl status vllama"
  else
    echo "enabled; start it with: systemctl start vllama   (returns once the model is loaded)"
  fi
else
  echo "systemd is not running here: files installed, nothing enabled"
fi
