#!/usr/bin/env bash
# The SGLang tiers' own virtual environment:  bash launch/setup_sglang.sh
#
# One venv, .venv-sglang/ (git-ignored), serves both SGLang test tiers and never the training environment
# (SGLang pins a CUDA torch and imports triton, torchvision and xgrammar at module level; training needs
# none of them):
#   - tests/contract checks the project's wire format against SGLang 0.5.23's own request classes,
#     validators, argument parser and HTTP app, imported without CUDA;
#   - tests/live_sglang starts a REAL SGLang 0.5.23 server on CPU from it and drives it with the
#     project's SGLangEngine.
# It holds:
#   - torch (the CPU build where there is no GPU: launch/install_torch.sh),
#   - this package, editable, with its test and sglang-contract extras (pyproject.toml: SGLang's
#     pure-Python dependencies, resolved by pip),
#   - SGLang and the packages that declare a CUDA torch, with --no-deps
#     (requirements/sglang-contract-nodeps.txt says why each is there),
#   - what a running server needs beyond that (requirements/sglang-live.txt).
# sglang-kernel is not installed (CUDA-only on PyPI): launch/sglang_cpu/launch_server.py starts the
# server with a torch stand-in for the one symbol a CPU server calls, and the start-up fix for
# --enable-return-routed-experts on CPU (docs/sglang.md).
# `python3 -m pytest` in the training environment runs both tiers with this venv. Idempotent: a second run
# installs nothing unless the package's dependencies or the requirement lists changed; GSPO_REINSTALL=1
# starts the venv afresh. GSPO_SGLANG_VENV=<dir> builds it elsewhere (the tiers look only in the default place).
# `--check` makes nothing: exit 0 (and says so) where the venv is current, 1 where a run would install.
# launch/setup_tests.sh runs this script in the background (launch/setup_sglang_background.sh); a run of it by
# hand that makes or finds the venv ready clears an ended background run's files (.sglang-setup/).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${GSPO_SGLANG_VENV:-$REPO/.venv-sglang}
BASE_PYTHON=${BASE_PYTHON:-python3}
# the venv stands on its own: a PYTHONPATH of the caller's must not leak into its pip or its checks
unset PYTHONPATH
# shellcheck source=launch/install_torch.sh
source launch/install_torch.sh

# what the venv was made from: the package's dependencies and extras, and both requirement lists
stamp=$({ sed -n '/^\[project\]/,/^\[project.scripts\]/p' pyproject.toml
          cat requirements/sglang-contract-nodeps.txt requirements/sglang-live.txt; } | sha256sum | cut -d' ' -f1)
stamp_file=$VENV/.gspo-sglang-stamp
imports_ok() {
  # the contract tier's modules, then the server's, imported with the CPU workarounds in place (as the
  # launcher does it); the editable install must point at this checkout, not one the venv was made from
  "$VENV/bin/python" - "$REPO" <<'PY'
import os, runpy, sys, warnings
warnings.simplefilter("ignore")
repo = sys.argv[1]
import gspo_megatron, jsonschema, pytest, sglang.srt.entrypoints.http_server, sglang.srt.server_args
launcher = runpy.run_path(os.path.join(repo, "launch", "sglang_cpu", "launch_server.py"))
launcher["install_cpu_workarounds"]()
import sglang.launch_server, sglang.srt.managers.scheduler, sglang.srt.managers.detokenizer_manager
import sglang.srt.models.qwen3_moe
sys.exit(0 if os.path.dirname(os.path.dirname(os.path.abspath(gspo_megatron.__file__))) == repo else 1)
PY
}
ready() {
  [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] && imports_ok 2>/dev/null
}
# a background set-up that has ended (launch/setup_sglang_background.sh) stops speaking for the venv once a
# run of this script finds it ready: its status, a failure perhaps, must not fail the tiers any longer
forget_ended_background_setup() {
  if [ "$VENV" = "$REPO/.venv-sglang" ] && [ -f "$REPO/.sglang-setup/status" ]; then rm -rf "$REPO/.sglang-setup"; fi
}
if [ "${GSPO_REINSTALL:-0}" != 1 ] && ready; then
  echo "[setup] SGLang venv ready: $VENV"
  forget_ended_background_setup
  exit 0
fi
[ "${1:-}" != --check ] || exit 1
echo "[setup] making the SGLang venv $VENV (SGLang 0.5.23 for CPU, both SGLang tiers; about 10 minutes on 2 cores)"
started=$SECONDS
if [ ! -x "$VENV/bin/python" ] || [ "${GSPO_REINSTALL:-0}" = 1 ]; then
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
fi
install_torch "$VENV/bin/python"
"$VENV/bin/python" -m pip install -q -e ".[test,sglang-contract]" -r requirements/sglang-live.txt
"$VENV/bin/python" -m pip install -q --no-deps -r requirements/sglang-contract-nodeps.txt
imports_ok || { echo "[setup] the SGLang venv does not import SGLang's app and server (errors above)" >&2; exit 1; }
echo "$stamp" > "$stamp_file"
forget_ended_background_setup  # in the background job itself there is no status yet: nothing to forget
echo "[setup] SGLang venv ready: $VENV ($((SECONDS - started)) s)"
