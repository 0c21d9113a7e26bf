#!/usr/bin/env bash
# Set up what the tests need:  bash launch/setup_tests.sh && python3 -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder
#
# 1. launch/setup.sh (torch and the package);
# 2. the package's test extra: pytest, pytest-timeout, pytest-xdist (the two workers of the full run), ruff, mypy,
#    openai (the agents' endpoint tests);
# 3. the SGLang tiers' venv, .venv-sglang/ (launch/setup_sglang.sh: SGLang 0.5.23 for CPU, for the contract
#    tier's checks against SGLang's own classes and the live tier's real server; about 10 minutes the
#    first time on 2 cores), made IN THE BACKGROUND where it is missing or out of date
#    (launch/setup_sglang_background.sh): this script returns, pytest runs the other tiers meanwhile, and the
#    two SGLang tiers wait for it (tests/sglang_venv_setup.py); GSPO_SKIP_SGLANG=1 skips it and both tiers
#    (otherwise they fail without it).
# The SGLang venv stays out of the training environment (SGLang's pins never enter it). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
start=$(date +%s)
bash launch/setup.sh
if ! "$PYTHON" -c "import pytest, pytest_timeout, xdist, ruff, mypy, openai" 2>/dev/null || [ "${GSPO_REINSTALL:-0}" = 1 ]; then
  echo "[setup] installing the test extra (pytest, pytest-xdist, ruff, mypy)"
  "$PYTHON" -m pip install -q -e ".[test]"
fi
bash launch/setup_sglang_background.sh  # starts nothing under GSPO_SKIP_SGLANG=1
echo "[setup] ready to test ($(( $(date +%s) - start )) s)"
