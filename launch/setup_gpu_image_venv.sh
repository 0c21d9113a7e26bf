#!/usr/bin/env bash
# A stand-in for the lent GPU machine's image, in its own venv .venv-gpu-image/ (the GPU-day test,
# tests/e2e/test_gpu_day_dry_run.py, layers a fresh venv on it and installs the kit there offline):
#   bash launch/setup_gpu_image_venv.sh
#
# Python 3.12 (NEWEST_PYTHON, default python3.12) with only what the project needs of the image, at the
# image's versions where the device notes record them (`python3 tools/gpu_kit.py image-requirements`:
# torch 2.11.0, transformers 5.17.0, numpy 2.5.2, ...; the rest at the newest pyproject allows). torch is
# the registry's build of 2.11.0 for cp312 (no CPU build of it is on the registries this machine
# reaches; the CUDA build runs on the CPU, about 3 GB with its CUDA libraries). tools/gpu_kit.py runs in
# the new venv once `packaging` (the image has it) is there. Idempotent: a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-gpu-image
start=$(date +%s)
if [ -f "$VENV/.complete" ]; then
  echo "[setup] image stand-in ready in $VENV (made earlier)"
  exit 0
fi
PY=${NEWEST_PYTHON:-python3.12}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
  echo "[setup] no Python 3.12 at '$PY': set NEWEST_PYTHON to a python3.12 (with pyenv: PYENV_VERSION=3.12.1)" >&2
  exit 2
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
"$VENV/bin/python" -m pip install -q packaging
"$VENV/bin/python" tools/gpu_kit.py image-requirements >"$requirements"
"$VENV/bin/python" -m pip install -q --no-compile -r "$requirements"
touch "$VENV/.complete"
echo "[setup] image stand-in ready in $VENV ($(( $(date +%s) - start )) s): $("$VENV/bin/python" -c \
  'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
