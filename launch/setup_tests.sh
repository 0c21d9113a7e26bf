#!/usr/bin/env bash
# Set up what the tests need:  bash launch/setup_tests.sh && python3 -m pytest -q
#
# 1. launch/setup.sh (torch and the package);
# 2. the package's test extra: pytest, pytest-timeout, ruff, mypy;
# 3. the SGLang contract tier's venv, .venv-sglang-contract/ (launch/setup_sglang_contract.sh: SGLang's
#    own request classes and HTTP app without CUDA; about 7 minutes the first time on 2 cores);
#    GSPO_SKIP_SGLANG_CONTRACT=1 skips it (the tier then skips too; otherwise it fails without it);
# 4. the live SGLang tier's venv, .venv-sglang-live/ (launch/setup_sglang_live.sh: a real SGLang 0.5.23
#    server on CPU; about 10 minutes the first time); GSPO_SKIP_SGLANG_LIVE=1 skips it (and the tier).
# Both SGLang venvs stay out of the training environment (SGLang's pins never enter it). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
start=$(date +%s)
bash launch/setup.sh
if ! "$PYTHON" -c "import pytest, pytest_timeout, ruff, mypy" 2>/dev/null || [ "${GSPO_REINSTALL:-0}" = 1 ]; then
  echo "[setup] installing the test extra (pytest, ruff, mypy)"
  "$PYTHON" -m pip install -q -e ".[test]"
fi
if [ "${GSPO_SKIP_SGLANG_CONTRACT:-0}" != 1 ]; then
  bash launch/setup_sglang_contract.sh
fi
if [ "${GSPO_SKIP_SGLANG_LIVE:-0}" != 1 ]; then
  bash launch/setup_sglang_live.sh
fi
echo "[setup] ready to test ($(( $(date +%s) - start )) s)"
