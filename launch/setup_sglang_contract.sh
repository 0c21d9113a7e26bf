#!/usr/bin/env bash
# The SGLang contract tier's own virtual environment:  bash launch/setup_sglang_contract.sh
#
# tests/contract checks the project's SGLang wire format against SGLang 0.5.23's own request
# classes, validators, argument parser and HTTP app, imported without CUDA. SGLang pins a CUDA torch
# and imports triton, torchvision and xgrammar at module level, none of which training needs, so the
# tier lives in .venv-sglang-contract/ (git-ignored), never in the training environment:
#   - torch (CPU build where there is no GPU: launch/install_torch.sh),
#   - this package, editable, with its test and sglang-contract extras (pyproject.toml: SGLang's
#     pure-Python dependencies, resolved by pip),
#   - SGLang and the packages that declare a CUDA torch with --no-deps
#     (requirements/sglang-contract-nodeps.txt says why each is there).
# `python3 -m pytest` in the training environment runs the tier in this venv
# (tests/contract/test_contract_tier_in_its_venv.py). Idempotent: a second run installs nothing
# unless the package's dependencies or the --no-deps list changed; GSPO_REINSTALL=1 starts the venv afresh.
# GSPO_CONTRACT_VENV=<dir> builds it elsewhere (the tier looks for it only in the default place).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${GSPO_CONTRACT_VENV:-$REPO/.venv-sglang-contract}
BASE_PYTHON=${BASE_PYTHON:-python3}
# the venv stands on its own: a PYTHONPATH of the caller's must not leak into its pip or its checks
unset PYTHONPATH
# shellcheck source=launch/install_torch.sh
source launch/install_torch.sh

# what the venv was made from: the package's dependencies and extras, and the --no-deps list
stamp=$({ sed -n '/^\[project\]/,/^\[project.scripts\]/p' pyproject.toml; cat requirements/sglang-contract-nodeps.txt; } \
        | sha256sum | cut -d' ' -f1)
stamp_file=$VENV/.gspo-contract-stamp
imports_ok() {
  "$VENV/bin/python" - "$REPO" <<'PY'
import os, sys, warnings
warnings.simplefilter("ignore")
import gspo_megatron, jsonschema, pytest, sglang.srt.entrypoints.http_server, sglang.srt.server_args
# the editable install must point at this checkout, not at one the venv was made from elsewhere
sys.exit(0 if os.path.dirname(os.path.dirname(os.path.abspath(gspo_megatron.__file__))) == sys.argv[1] else 1)
PY
}
ready() {
  [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] && imports_ok 2>/dev/null
}
if [ "${GSPO_REINSTALL:-0}" != 1 ] && ready; then
  echo "[setup] SGLang contract venv ready: $VENV"
  exit 0
fi
echo "[setup] making the SGLang contract venv $VENV (SGLang 0.5.23 without CUDA; a few minutes)"
rm -rf "$VENV"
"$BASE_PYTHON" -m venv "$VENV"
install_torch "$VENV/bin/python"
"$VENV/bin/python" -m pip install -q -e ".[test,sglang-contract]"
"$VENV/bin/python" -m pip install -q --no-deps -r requirements/sglang-contract-nodeps.txt
imports_ok || { echo "[setup] the SGLang contract venv does not import SGLang's app (errors above)" >&2; exit 1; }
echo "$stamp" > "$stamp_file"
echo "[setup] SGLang contract venv ready: $VENV"
