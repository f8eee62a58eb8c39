#!/usr/bin/env bash
# Removes what scripts/install-systemd.sh installed. Idempotent.
#
#   sudo scripts/uninstall-systemd.sh [--purge]
#
#   --purge   also delete /etc/vllama (settings, HF_TOKEN), the model cache
#             (/var/cache/vllama), /var/lib/vllama and the vllama user and group
#
# Environment: PREFIX (/opt/vllama), as given to install-systemd.sh.
set -euo pipefail

PREFIX=${PREFIX:-/opt/vllama}
purge=0
for arg in "$@"; do
  case "$arg" in
    --purge) purge=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "uninstall-systemd.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

if [ "$(id -u)" -ne 0 ]; then
  echo "uninstall-systemd.sh: run as root (sudo)" >&2
  exit 1
fi

have_systemd=0
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
  have_systemd=1
  # stop drains in-flight requests and stops vLLM (up to TimeoutStopSec)
  systemctl disable --now vllama.service 2>/dev/null || true
fi
rm -f /etc/systemd/system/vllama.service
rm -rf /etc/systemd/system/vllama.service.d
if [ "$have_systemd" -eq 1 ]; then
  systemctl daemon-reload
  systemctl reset-failed vllama.service 2>/dev/null || true
fi
rm -rf "$PREFIX/venv"
rmdir "$PREFIX" 2>/dev/null || true

if [ "$purge" -eq 1 ]; then
  rm -rf /etc/vllama /var/cache/vllama /var/lib/vllama
  if id -u vllama >/dev/null 2>&1; then
    userdel vllama
  fi
  if getent group vllama >/dev/null; then
    groupdel vllama
  fi
  echo "vllama removed, with its settings, model cache and user"
else
  echo "vllama removed; kept /etc/vllama, /var/cache/vllama (models), /var/lib/vllama and the vllama user (--purge deletes them)"
fi
