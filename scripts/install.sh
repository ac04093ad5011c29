#!/usr/bin/env bash
# Install tessera into the current Python environment.
#   bash scripts/install.sh        runtime only
#   bash scripts/install.sh test   runtime plus what the test suite needs
# A machine without torch gets the CPU build 2.13.0 (no CUDA packages); an existing torch, for
# example a GPU user's CUDA build, is left exactly as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip setuptools wheel
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install --quiet "torch==2.13.0"
fi
extra=""
if [ "${1:-}" = "test" ]; then extra="[test]"; fi
python -m pip install --quiet -e ".${extra}"
python -c "import torch; print('tessera installed; torch', torch.__version__)"
