#!/usr/bin/env bash
# Set up gspo-megatron for training on this machine:  bash launch/setup.sh
#
# 1. torch (launch/install_torch.sh: the tested release for the interpreter, the CPU build where no
#    NVIDIA GPU is visible);
# 2. the package in editable mode: what training needs (no SGLang, triton, torchvision, test tools).
# The tests need more: launch/setup_tests.sh. PYTHON=<interpreter> picks the environment (default
# python3). Idempotent: a second run installs nothing; GSPO_REINSTALL=1 reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# shellcheck source=launch/install_torch.sh
source launch/install_torch.sh

start=$(date +%s)
install_torch "$PYTHON"
# Skip the (slow) resolver pass when the package is already installed -- from this checkout: -I leaves the
# working directory off sys.path, so an editable install of another clone (moved or deleted since: every
# subprocess that is not started from the repository root fails "No module named gspo_megatron") is reinstalled.
installed_here() {
  "$PYTHON" -I -c 'import sys, pathlib, gspo_megatron, megatron.core, hydra, transformers
sys.exit(pathlib.Path(gspo_megatron.__file__).resolve().parents[1] != pathlib.Path(sys.argv[1]).resolve())' "$PWD" 2>/dev/null
}
if ! installed_here || [ "${GSPO_REINSTALL:-0}" = 1 ]; then
  echo "[setup] installing gspo-megatron (editable) and what training needs"
  "$PYTHON" -m pip install -q -e .
fi
"$PYTHON" -c 'from importlib.metadata import version as v; print("[setup] ready to train: torch", v("torch") + ", megatron-core", v("megatron-core") + ", transformers", v("transformers"), end="")'
echo " ($(( $(date +%s) - start )) s)"
