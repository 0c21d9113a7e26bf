#!/usr/bin/env bash
# Set up gspo-megatron on this machine:  bash launch/setup.sh
#
# Installs torch first so that pip never resolves an unpinned torch to a multi-GB CUDA build on a
# machine without a GPU: the CPU wheel torch==2.13.0 where no NVIDIA driver is visible, the CUDA
# build where one is (or whatever torch is already installed, if it is >= 2.6). Then installs the
# package in editable mode with its test extra. Idempotent: a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${GSPO_TORCH_VERSION:-2.13.0}

have_torch() {
  "$PYTHON" - <<'PY' 2>/dev/null
import sys
try:
    import torch
except Exception:
    sys.exit(1)
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 6) else 1)
PY
}

if ! have_torch; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] NVIDIA GPU found: installing torch==${TORCH_VERSION} (CUDA build)"
    "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}"
  else
    echo "[setup] no GPU: installing the CPU build torch==${TORCH_VERSION}"
    # A torch wheel the machine already holds (pip's find-links) is used as is, its dependencies
    # from PyPI; otherwise PyTorch's CPU index, since PyPI's Linux torch wheels are CUDA builds.
    probe=$(mktemp -d)
    if "$PYTHON" -m pip download -q --no-deps --no-index -d "$probe" "torch==${TORCH_VERSION}" >/dev/null 2>&1; then
      "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}"
    else
      "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
        --extra-index-url https://pypi.org/simple
    fi
    rm -rf "$probe"
  fi
fi

# Skip the (slow) resolver pass when the package and its test extra are already installed.
if ! "$PYTHON" -c "import gspo_megatron, megatron.core, hydra, transformers, pytest, pytest_timeout, ruff, mypy" 2>/dev/null \
   || [ "${GSPO_REINSTALL:-0}" = 1 ]; then
  echo "[setup] installing gspo-megatron (editable) with its test extra"
  "$PYTHON" -m pip install -q -e ".[test]"
fi
# Contract tier (tests/contract): SGLang's own request classes, validators, argument parser and HTTP app,
# imported without CUDA. Pure-Python dependencies through pip's resolver; SGLang and the packages that
# declare a CUDA torch with --no-deps (requirements/sglang-contract-nodeps.txt says why each is there).
# A machine with a real SGLang install keeps it. GSPO_SKIP_SGLANG_CONTRACT=1 skips the install, and the
# tier then skips too; without that variable a missing SGLang fails the tier.
if [ "${GSPO_SKIP_SGLANG_CONTRACT:-0}" != 1 ] && { [ "${GSPO_REINSTALL:-0}" = 1 ] || ! "$PYTHON" - <<'PY' 2>/dev/null
import warnings
warnings.simplefilter("ignore")
import fastapi, starlette, sglang.srt.entrypoints.http_server, sglang.srt.server_args
PY
}; then
  echo "[setup] installing the SGLang contract tier (SGLang without CUDA: requirements/sglang-contract*.txt)"
  "$PYTHON" -m pip install -q -r requirements/sglang-contract.txt
  "$PYTHON" -m pip install -q --no-deps -r requirements/sglang-contract-nodeps.txt
fi
echo "[setup] ready: torch $("$PYTHON" -c 'import torch; print(torch.__version__)')," \
     "megatron-core $("$PYTHON" -c 'import megatron.core as m; print(m.__version__)')"
