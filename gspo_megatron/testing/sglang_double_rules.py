"""What the SGLang TEST DOUBLE accepts on ``/generate``: SGLang 0.5.23's rules, re-stated for a double
that cannot import SGLang.

Sources (SGLang 0.5.23): the ``/generate`` contract gate (``sglang/api/v1`` ``GenerateRequest``: field
names and JSON types), ``SamplingParams.__init__``/``normalize``/``verify``
(``srt/sampling/sampling_params.py``: ranges). ``tests/contract`` runs a table of bodies through both
SGLang itself and the double and fails on any disagreement, so this file cannot drift unnoticed.
"""

from __future__ import annotations

import math
from typing import Any

# The contract gate's sampling_params fields, in SGLang's order.
SAMPLING_FIELDS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "beam_width", "stream_interval")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
# SamplingParams defaults the range checks start from.
_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "max_new_tokens": 128,
}
_SAMPLING_EPS = 1e-6


def generate_body_error(body: Any) -> str | None:
    """None if SGLang 0.5.23 would schedule this ``/generate`` body, else why it would refuse it."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    ids = body.get("input_ids")
    if ids is None or not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        return "input_ids must be a non-empty list of token ids (integers)"
    for flag in ("return_logprob", "return_routed_experts", "stream"):
        if flag in body and not isinstance(body[flag], bool):
            return f"{flag} must be a boolean, got {body[flag]!r}"
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return "sampling_params must be an object"
    return _type_error(params) or _range_error({**_DEFAULTS, **{k: v for k, v in params.items() if v is not None}})


def _type_error(params: dict) -> str | None:
    for name, value in params.items():
        if name not in SAMPLING_FIELDS:
            return f"unknown field `{name}`"
        if value is None:
            continue
        if name in _FLOAT_FIELDS and not (_is_int(value) or isinstance(value, float)):
            return f"invalid type for {name}: {value!r}, expected f64"
        if name in _INT_FIELDS and not _is_int(value):
            return f"invalid type for {name}: {value!r}, expected i64"
        if name in _BOOL_FIELDS and not isinstance(value, bool):
            return f"invalid type for {name}: {value!r}, expected bool"
        if name == "stop_token_ids" and not (isinstance(value, list) and all(_is_int(v) for v in value)):
            return f"stop_token_ids must be a list of integers, got {value!r}"
        if name == "stop" and not (
            isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        ):
            return f"stop must be a string or a list of strings, got {value!r}"
    return None


def _range_error(p: dict) -> str | None:
    temperature, top_k = float(p["temperature"]), p["top_k"]
    if 0 <= temperature < _SAMPLING_EPS:
        top_k = 1  # greedy: SamplingParams turns temperature 0 into top_k 1
    checks = [
        (math.isfinite(temperature) and temperature >= 0, "temperature must be a non-negative finite number"),
        (0.0 < p["top_p"] <= 1.0, "top_p must be in (0, 1]"),
        (0.0 <= p["min_p"] <= 1.0, "min_p must be in [0, 1]"),
        (top_k == -1 or top_k >= 1, "top_k must be -1 (disable) or at least 1"),
        (-2.0 <= p["frequency_penalty"] <= 2.0, "frequency_penalty must be in [-2, 2]"),
        (-2.0 <= p["presence_penalty"] <= 2.0, "presence_penalty must be in [-2, 2]"),
        (0.0 < p["repetition_penalty"] <= 2.0, "repetition_penalty must be in (0, 2]"),
        (p["min_new_tokens"] >= 0, "min_new_tokens must be >= 0"),
        (p["max_new_tokens"] >= 0, "max_new_tokens must be at least 0"),
        (p["min_new_tokens"] <= p["max_new_tokens"], "min_new_tokens must be <= max_new_tokens"),
    ]
    if "sampling_seed" in p:
        checks.append((-(2**63) <= p["sampling_seed"] <= 2**63 - 1, "sampling_seed must be in [-2**63, 2**63-1]"))
    for ok, message in checks:
        if not ok:
            return message
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
