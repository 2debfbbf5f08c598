# Sourced by deploy/*.sh: install what the project needs, once, idempotently.
#   ensure_memcached        the memcached server from Debian's packages
#   ensure_python EXTRAS    a virtualenv at $LOOKUP_TABLE_VENV (default .venv) with
#                           this package installed editable with [EXTRAS]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LOOKUP_TABLE_VENV:-$REPO/.venv}"
PY="$VENV/bin/python"

_sudo() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

_apt_install() {
  echo "==> installing $* (Debian packages)"
  _sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive _sudo apt-get install -y -qq "$@" >/dev/null
}

ensure_memcached() {
  if command -v memcached >/dev/null 2>&1 || [ -x /usr/bin/memcached ]; then return 0; fi
  _apt_install memcached
  # Debian's package may start a system memcached on 11211; ours use their own ports.
}

ensure_python() {
  local extras="$1"
  if [ ! -x "$PY" ]; then
    echo "==> creating virtualenv $VENV"
    # --system-site-packages: reuse big packages (tensorflow) already on the machine;
    # pip still installs into the venv whatever is missing or out of range.
    if ! python3 -m venv --system-site-packages "$VENV" 2>/dev/null; then
      _apt_install python3-venv
      python3 -m venv --system-site-packages "$VENV"
    fi
  fi
  local stamp="$VENV/.installed-$extras-$(sha1sum "$REPO/pyproject.toml" | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    echo "==> installing the lookup-table package [$extras] into $VENV"
    "$PY" -m pip install -q --disable-pip-version-check -e "$REPO[$extras]"
    touch "$stamp"
  fi
}
