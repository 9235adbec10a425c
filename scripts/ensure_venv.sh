#!/usr/bin/env bash
# Create (if missing) and fill the virtual environment that `make demo` and
# `make test` run in.  Usage: scripts/ensure_venv.sh PYTHON VENV_DIR
#
# torch: where PYTHON already imports torch >= 2.11 (a GPU machine with a CUDA
# build), the venv sees that torch through --system-site-packages; otherwise
# `pip install torch==2.13.0` (the CPU build where one is offered).
set -euo pipefail
python=${1:-python3}
venv=${2:-.venv}
stamp="$venv/.torchweld-installed"

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi

has_torch() {
  "$1" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(p) for p in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
}

if [ ! -x "$venv/bin/python" ]; then
  if has_torch "$python"; then
    echo "ensure_venv: using the torch that $python already has"
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
# --no-cache-dir: the CUDA build of torch that a Python without a CPU wheel gets
# is several GB of wheels; caching them too doubled the disk CI needs (a CI run
# ran out of space on a host with little free).
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
if ! has_torch "$venv/bin/python"; then
  echo "ensure_venv: installing torch==2.13.0 into $venv"
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".[dev]"
touch "$stamp"
