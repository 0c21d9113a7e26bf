# Sourced by launch/setup.sh and launch/setup_sglang.sh:  install_torch PYTHON
#
# Installs torch before anything else, so that pip never resolves an unpinned torch to a multi-GB
# CUDA build on a machine without a GPU: torch==${GSPO_TORCH_VERSION:-the tested release} -- 2.13.0 on
# Python < 3.12, 2.15.0 on 3.12+ (docs/development.md, "Tested versions") -- as the CUDA build where an NVIDIA
# driver is visible, the CPU build where none is; an interpreter that already has a torch within
# pyproject's range (2.6 to 2.15) keeps it. Where the packages come from is pip's own configuration (pip.conf,
# PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS): the repository names no package index.

_have_torch() {
  "$1" - <<'PY' 2>/dev/null
import sys
try:
    import torch
except Exception:
    sys.exit(1)
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (2, 6) <= (major, minor) <= (2, 15) else 1)
PY
}

_tested_torch() {
  "$1" -c 'import sys; print("2.15.0" if sys.version_info >= (3, 12) else "2.13.0")'
}

install_torch() {
  local python=$1 version
  version=${GSPO_TORCH_VERSION:-$(_tested_torch "$1")}
  if _have_torch "$python"; then
    return 0
  fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] NVIDIA GPU found: installing torch==${version} (CUDA build)"
    "$python" -m pip install -q "torch==${version}"
    return 0
  fi
  echo "[setup] no GPU: installing the CPU build of torch==${version}"
  "$python" -m pip install -q "torch==${version}"
  if "$python" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null; then
    return 0
  fi
  echo "[setup] warning: pip chose a CUDA build of torch (${version}) on a machine without a GPU: it" \
       "works on CPU but is several GB. Point pip at a CPU wheel index (docs/development.md, "Set-up in detail") and run" \
       "'$python -m pip install --force-reinstall torch==${version}'." >&2
}
