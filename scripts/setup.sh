#!/usr/bin/env bash
# Create the virtualenv and install mirror-mlx; `setup.sh VENV test` adds its test extras.
# `setup.sh --which-python` only says which Python it would use (exit 1 when none fits).
# The package needs Python >= 3.10; a stock Mac's python3 is 3.9, so the first suitable one of
# $PYTHON (if set, and then only it), python3, python3.13 .. python3.10 on PATH, uv's, or Homebrew's is used.
# On Linux as root, also install Debian's BLIS and OpenBLAS: MLX's CPU wheel links the slow reference
# BLAS, and mirror_mlx preloads the faster of them for the machine (mirror_mlx/blas.py, docs/cpu.md). With
# the test extras, also Debian's chromium and chromium-driver: the chat page's tests drive a real browser.
set -euo pipefail

MIN_MINOR=10
HINT="install one with 'brew install python@3.12' or 'uv python install 3.12', or set PYTHON=/path/to/python3.12"

# "3.12.1" for a working interpreter, nothing for a missing or broken one (a pyenv shim of an
# uninstalled version exits 127).
py_version() {
  local out
  out=$("$1" --version 2>&1) || return 1
  [[ $out =~ ^Python\ ([0-9]+\.[0-9]+(\.[0-9]+)?) ]] || return 1
  echo "${BASH_REMATCH[1]}"
}

suitable() {  # VERSION -> is it >= 3.MIN_MINOR
  local major=${1%%.*} rest=${1#*.}
  local minor=${rest%%.*}
  [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge "$MIN_MINOR" ]; }
}

candidates() {  # one path or command name a line, in order of preference
  local v
  for v in python3 python3.13 python3.12 python3.11 python3.10; do
    command -v "$v" 2>/dev/null || true
  done
  if command -v uv >/dev/null 2>&1; then
    uv python find ">=3.$MIN_MINOR" 2>/dev/null || true
  fi
  local brew
  brew=$(command -v brew 2>/dev/null || true)
  local home=${HOMEBREW_PREFIX:-/opt/homebrew}  # Apple silicon's default; a fresh install is not on PATH yet
  [ -n "$brew" ] || { [ -x "$home/bin/brew" ] && brew="$home/bin/brew"; } || true
  if [ -n "$brew" ]; then
    local prefix
    prefix=$("$brew" --prefix 2>/dev/null || true)
    for v in 13 12 11 10; do
      [ -n "$prefix" ] && [ -x "$prefix/bin/python3.$v" ] && echo "$prefix/bin/python3.$v"
    done
  fi
  return 0
}

# Print the chosen interpreter's path on stdout and one line saying so on stderr; or one line
# saying how to get one, and return 1.
choose_python() {
  local ver="" seen=""
  if [ -n "${PYTHON:-}" ]; then
    if ver=$(py_version "$PYTHON") && suitable "$ver"; then
      echo "setup: using Python $ver ($PYTHON, from PYTHON)" >&2
      echo "$PYTHON"
      return 0
    fi
    echo "setup: PYTHON=$PYTHON is ${ver:+Python }${ver:-not a working Python}; mirror-mlx needs Python >= 3.$MIN_MINOR: $HINT" >&2
    return 1
  fi
  local cand
  while IFS= read -r cand; do
    [ -n "$cand" ] || continue
    if ver=$(py_version "$cand"); then
      if suitable "$ver"; then
        echo "setup: using Python $ver ($cand)" >&2
        echo "$cand"
        return 0
      fi
      [ -n "$seen" ] || seen=" (found $cand: Python $ver)"
    fi
  done < <(candidates)
  echo "setup: no Python >= 3.$MIN_MINOR found$seen; $HINT" >&2
  return 1
}

if [ "${1:-}" = "--which-python" ]; then
  choose_python
  exit
fi

VENV=${1:-.venv}
EXTRAS=${2:+[$2]}

PY=""
if [ -x "$VENV/bin/python" ]; then
  ver=$(py_version "$VENV/bin/python" || echo "a Python that does not run")
  if ! [[ $ver =~ ^[0-9] ]] || ! suitable "$ver"; then
    echo "setup: $VENV holds ${ver/#[0-9]/Python &}; mirror-mlx needs Python >= 3.$MIN_MINOR: remove $VENV (make clean) and run again" >&2
    exit 1
  fi
else
  PY=$(choose_python)
fi
ARCH_DIR=/usr/lib/$(uname -m)-linux-gnu
if [ "$(uname -s)" = "Linux" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  UPDATED=""
  apt_install() {  # PACKAGE... (one `apt-get update` for all)
    { [ -n "$UPDATED" ] || apt-get update -qq; } && UPDATED=1 \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  }
  if [ ! -e "$ARCH_DIR/blis-openmp/libblis.so.4" ] || [ ! -e "$ARCH_DIR/openblas-pthread/libopenblas.so.0" ]; then
    echo "setup: installing libblis4-openmp and libopenblas0-pthread (apt)"
    apt_install libblis4-openmp libopenblas0-pthread \
      || echo "setup: could not install BLIS and OpenBLAS; MLX will use a slower BLAS (mirror-mlx doctor says which)"
  fi
  if [ "${2:-}" = "test" ] && ! { command -v chromium && command -v chromedriver; } >/dev/null; then
    echo "setup: installing chromium and chromium-driver (apt), for the chat page's browser tests"
    apt_install chromium chromium-driver \
      || echo "setup: could not install chromium and chromium-driver; the chat page's browser tests skip without them (under CI they fail)"
  fi
fi
[ -z "$PY" ] || "$PY" -m venv "$VENV"

# pip's and setuptools' chatter (pages of build warnings) goes to a log; on failure its tail is shown.
LOG="$VENV/setup.log"
echo "setup: installing mirror-mlx${EXTRAS} into $VENV (log: $LOG)"
if ! { "$VENV/bin/python" -m pip install -q --upgrade pip && "$VENV/bin/python" -m pip install -q -e ".$EXTRAS"; } >"$LOG" 2>&1; then
  tail -n 40 "$LOG" >&2
  echo "setup: pip install failed (whole log: $LOG)" >&2
  exit 1
fi
echo "setup: done"
