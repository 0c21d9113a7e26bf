#!/usr/bin/env bash
# The newest stack this project supports, in its own venv .venv-newest/ (CI's second leg, .ci/newest_stack):
#   bash launch/setup_newest_stack.sh
#
# Python 3.12 (NEWEST_PYTHON, default python3.12) with torch, megatron-core and transformers at the upper
# bounds pyproject.toml allows (requirements/newest-stack.txt, given to pip as constraints), installed by
# launch/setup_tests.sh exactly as on the main interpreter (without the SGLang tiers: they run on the main leg).
# Beside it, megatron-core 0.16.1 unpacked into .venv-newest/megatron-core-0.16.1/ (no dependencies: the
# venv's own serve it) for the test that resumes a 0.16.1 checkpoint under the newest megatron-core and
# back (tests/e2e/test_megatron_versions.py). On a machine without a GPU and without a CPU wheel index in
# pip's configuration, torch is PyPI's CUDA build (about 2.8 GB to download; it runs on the CPU).
# Idempotent: a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-newest
OLDEST_MCORE=0.16.1
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  PY=${NEWEST_PYTHON:-python3.12}
  if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
    echo "[setup] no Python 3.12 at '$PY': set NEWEST_PYTHON to a python3.12 (with pyenv: PYENV_VERSION=3.12.1)" >&2
    exit 2
  fi
  "$PY" -m venv "$VENV"
fi
PIP_CONSTRAINT="$PWD/requirements/newest-stack.txt" PYTHON="$VENV/bin/python" \
  GSPO_SKIP_SGLANG=1 bash launch/setup_tests.sh
if [ ! -d "$VENV/megatron-core-$OLDEST_MCORE/megatron" ]; then
  "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/megatron-core-$OLDEST_MCORE" \
    "megatron-core==$OLDEST_MCORE"
fi
echo "[setup] newest stack ready in $VENV ($(( $(date +%s) - start )) s): $("$VENV/bin/python" --version)," \
  "megatron-core $OLDEST_MCORE beside it"
