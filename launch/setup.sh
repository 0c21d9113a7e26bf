#!/usr/bin/env bash
# Set up gspo-megatron on this machine:  bash launch/setup.sh
#
# 1. torch (launch/install_torch.sh: the CPU build where no NVIDIA GPU is visible);
# 2. the package in editable mode with its test extra: what training needs plus pytest, ruff, mypy
#    (no SGLang, triton or torchvision: training never imports them);
# 3. the SGLang contract tier in its own virtual environment, .venv-sglang-contract/
#    (launch/setup_sglang_contract.sh), so that SGLang's pins never enter the training environment;
#    GSPO_SKIP_SGLANG_CONTRACT=1 skips it (the tier then skips too; otherwise it fails without it);
# 4. the live SGLang tier's venv, .venv-sglang-live/ (launch/setup_sglang_live.sh: a real SGLang 0.5.23
#    server on CPU, about 10 minutes to install on 2 cores); GSPO_SKIP_SGLANG_LIVE=1 skips it (and the tier).
# PYTHON=<interpreter> picks the training environment (default python3). Idempotent: a second run
# installs nothing; GSPO_REINSTALL=1 reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# shellcheck source=launch/install_torch.sh
source launch/install_torch.sh

install_torch "$PYTHON"
# Skip the (slow) resolver pass when the package and its test extra are already installed.
if ! "$PYTHON" -c "import gspo_megatron, megatron.core, hydra, transformers, pytest, pytest_timeout, ruff, mypy" 2>/dev/null \
   || [ "${GSPO_REINSTALL:-0}" = 1 ]; then
  echo "[setup] installing gspo-megatron (editable) with its test extra"
  "$PYTHON" -m pip install -q -e ".[test]"
fi
if [ "${GSPO_SKIP_SGLANG_CONTRACT:-0}" != 1 ]; then
  bash launch/setup_sglang_contract.sh
fi
if [ "${GSPO_SKIP_SGLANG_LIVE:-0}" != 1 ]; then
  bash launch/setup_sglang_live.sh
fi
"$PYTHON" -c 'from importlib.metadata import version as v; print("[setup] ready: torch", v("torch") + ", megatron-core", v("megatron-core"))'
