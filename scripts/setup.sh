#!/usr/bin/env bash
# Create the virtualenv and install mirror-mlx; `setup.sh VENV test` adds its test extras.
# On Linux as root, also install Debian's OpenBLAS: MLX's CPU wheel links the slow reference
# BLAS, and mirror_mlx preloads OpenBLAS when it is present (float32 matmuls ~30x faster).
set -euo pipefail
VENV=${1:-.venv}
EXTRAS=${2:+[$2]}
if [ "$(uname -s)" = "Linux" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null \
   && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  echo "setup: installing libopenblas0-pthread (apt)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread) \
    || echo "setup: could not install OpenBLAS; MLX will use its slow reference BLAS"
fi
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".$EXTRAS"
