"""The SGLang versions this engine speaks to, checked against what each server reports.

The engine relies on SGLang behaviour verified against 0.5.23's source (tests/contract): weight-update
sessions (``/begin_weight_update`` ... ``/end_weight_update``), ``meta_info.weight_versions``, HTTP 503
for a non-streaming abort, ``--tp-size``. Older 0.5.x releases lack some of these; 0.6 may change them.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

MIN_SGLANG = "0.5.23"  # inclusive
MAX_SGLANG = "0.6"  # exclusive
SUPPORTED_SGLANG = f">={MIN_SGLANG},<{MAX_SGLANG}"


class UnsupportedSGLangError(RuntimeError):
    """A server runs an SGLang version outside SUPPORTED_SGLANG."""


def check_sglang_version(version: object, where: str) -> None:
    """Raise naming the server and the supported range unless ``version`` lies in it."""
    try:
        parsed = Version(str(version))
    except InvalidVersion:
        parsed = None
    if parsed is None or not Version(MIN_SGLANG) <= parsed < Version(MAX_SGLANG):
        raise UnsupportedSGLangError(
            f"SGLang server {where} reports version {version!r}; gspo-megatron supports SGLang "
            f"{SUPPORTED_SGLANG} (the weight-update session and response fields it relies on). Install a "
            f"supported release (pip install 'sglang[all]{SUPPORTED_SGLANG}') or attach to servers that run one."
        )
