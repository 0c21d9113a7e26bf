"""SGLang's /generate wire format: build the request body, decode and check the response.

Pure functions, no I/O, so every rule is unit-tested on hand-built payloads.

Design decisions:
- Token ids in (``input_ids``), token ids out (``output_ids``); the text is never re-tokenised.
- ``meta_info.output_token_logprobs`` is ``[[logprob, token_id, text|null], ...]`` (SGLang 0.5.x,
  ``TokenizerManager.convert_logprob_style``). Its token ids must equal ``output_ids`` one for one: a
  disagreement means the log-probs belong to other tokens, which would silently corrupt the ratio
  pi_theta / pi_old, so it is an error, not a warning. SGLang's log-probs are log-softmax of the
  temperature-scaled logits (top-p/top-k truncation not renormalised in), unless the server runs with
  SGLANG_RETURN_ORIGINAL_LOGPROB=1 (then: before temperature); the trainer must score the same way.
- ``meta_info.routed_experts`` is base64 of little-endian int32, shape
  [prompt + completion - 1, num_hidden_layers, num_experts_per_tok] (REFERENCE.md section 3). The size
  is checked against that exact shape; a wrong size names both sizes instead of reshaping garbage.
- Malformed responses raise ``ProtocolError`` naming the field; the client does not retry them (a
  server that answers nonsense will answer nonsense again).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gspo_megatron.contracts.samples import FinishReason, SamplingParams


class ProtocolError(RuntimeError):
    """The server's answer does not follow SGLang's /generate protocol."""


@dataclass
class GenerateResult:
    output_ids: list[int]
    output_log_probs: torch.Tensor  # float32 [len(output_ids)]
    finish_reason: FinishReason
    routed_experts: torch.Tensor | None  # int32 [prompt + output - 1, layers, top_k]
    weight_version: int | None  # meta_info.weight_version when the server reports an integer
    # meta_info.weight_versions: (version, first token, end token) spans when a retracted sample was
    # generated under several weight versions; empty when it was one version.
    weight_versions: tuple[tuple[int | None, int, int], ...] = ()

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest version any token of this sample was sampled under (what staleness must count)."""
        versions = [version for version, _, _ in self.weight_versions if version is not None]
        return min(versions) if versions else self.weight_version

    def token_versions(self, unnamed: int) -> list[int]:
        """Each output token's weight version, from the spans: span (v, start, end) holds tokens start..end-1,
        sampled under v (SGLang 0.5.23 ``utils/weight_versions.py``: a version change records each live
        request's output length, and the tokens after it come from forwards under the new weights). No spans:
        every token ``weight_version``'s; a version that is not an integer (SGLang's ``"default"``, before any
        update named one) is ``unnamed``. The spans must cover the output exactly, else ``ProtocolError``."""
        count = len(self.output_ids)
        if not self.weight_versions:
            version = self.weight_version
            return [unnamed if version is None else version] * count
        versions: list[int] = []
        for version, start, end in self.weight_versions:
            if start != len(versions) or end < start:
                raise ProtocolError(
                    f"meta_info.weight_versions {list(self.weight_versions)} do not tile the {count} output tokens "
                    f"(a span starts at {start} after {len(versions)} tokens)"
                )
            versions += [unnamed if version is None else version] * (end - start)
        if len(versions) != count:
            raise ProtocolError(
                f"meta_info.weight_versions {list(self.weight_versions)} cover {len(versions)} tokens, the output "
                f"has {count}"
            )
        return versions


def build_generate_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    sampling_seed: int | None = None,
    skip_special_tokens: bool = False,
    no_stop_trim: bool = True,
    rid: str | None = None,
) -> dict[str, Any]:
    """The JSON body of one ``POST /generate`` for one sample (SGLang's ``GenerateReqInput``); ``rid``: the
    request's id, which ``POST /abort_request {"rid": ...}`` names to stop it."""
    sampling_params: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "no_stop_trim": no_stop_trim,
        "skip_special_tokens": skip_special_tokens,
    }
    if sampling_seed is not None:
        sampling_params["sampling_seed"] = sampling_seed
    body: dict[str, Any] = {
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params,
        "return_logprob": True,
    }
    if params.return_routed_experts:
        body["return_routed_experts"] = True
    if rid is not None:
        body["rid"] = rid
    return body


def parse_generate_response(
    body: Any,
    prompt_len: int,
    *,
    routed_experts_layout: tuple[int, int] | None = None,
) -> GenerateResult:
    """Decode one /generate answer; ``routed_experts_layout`` = (layers, top_k) when they were asked."""
    if not isinstance(body, dict):
        raise ProtocolError(f"/generate answered a {type(body).__name__}, expected a JSON object")
    output_ids = _int_list(body.get("output_ids"), "output_ids")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise ProtocolError("/generate answer has no meta_info object")
    log_probs = decode_output_logprobs(meta.get("output_token_logprobs"), output_ids)
    finish_reason = parse_finish_reason(meta.get("finish_reason"))
    routed = None
    encoded = meta.get("routed_experts")
    # a request aborted before it ran (in the waiting queue) comes back without routes: SGLang writes them only
    # when its scheduler captured some
    if routed_experts_layout is not None and not (encoded is None and finish_reason is FinishReason.ABORT):
        if encoded is None:
            raise ProtocolError(
                "meta_info.routed_experts is missing although return_routed_experts was sent; launch the "
                "server with --enable-return-routed-experts (SGLangConfig.enable_return_routed_experts)"
            )
        layers, top_k = routed_experts_layout
        routed = decode_routed_experts(encoded, prompt_len + len(output_ids) - 1, layers, top_k)
    return GenerateResult(
        output_ids,
        log_probs,
        finish_reason,
        routed,
        _weight_version(meta),
        _weight_version_spans(meta.get("weight_versions")),
    )


def decode_output_logprobs(entries: Any, output_ids: list[int]) -> torch.Tensor:
    """[[logprob, token_id, text|null], ...] -> float32 [len(output_ids)], ids checked against output_ids."""
    if not isinstance(entries, list):
        raise ProtocolError(
            "meta_info.output_token_logprobs is missing or not a list; the request must send return_logprob: true"
        )
    if len(entries) != len(output_ids):
        raise ProtocolError(
            f"meta_info.output_token_logprobs has {len(entries)} entries but output_ids has {len(output_ids)} tokens"
        )
    values = []
    for position, (entry, token_id) in enumerate(zip(entries, output_ids, strict=True)):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise ProtocolError(f"output_token_logprobs[{position}] = {entry!r}, expected [logprob, token_id, text]")
        log_prob, entry_id = entry[0], entry[1]
        if entry_id != token_id:
            raise ProtocolError(
                f"output_token_logprobs[{position}] is for token {entry_id} but output_ids[{position}] is "
                f"{token_id}: the log-probs do not belong to the sampled tokens"
            )
        if (
            not isinstance(log_prob, (int, float))
            or isinstance(log_prob, bool)
            or math.isnan(log_prob)
            or log_prob > 1e-4
        ):
            raise ProtocolError(f"output_token_logprobs[{position}] has log-prob {log_prob!r}, expected a number <= 0")
        values.append(float(log_prob))
    return torch.tensor(values, dtype=torch.float32)


def parse_finish_reason(value: Any) -> FinishReason:
    """SGLang's {"type": "stop"|"length"|"abort", ...} -> FinishReason."""
    if not isinstance(value, dict) or "type" not in value:
        raise ProtocolError(f"meta_info.finish_reason = {value!r}, expected an object with a 'type'")
    try:
        return FinishReason(value["type"])
    except ValueError:
        valid = [reason.value for reason in FinishReason]
        raise ProtocolError(f"finish_reason type {value['type']!r} is not one of {valid}") from None


def decode_routed_experts(encoded: Any, num_tokens: int, num_layers: int, top_k: int) -> torch.Tensor:
    """base64 little-endian int32 -> int32 [num_tokens, num_layers, top_k], size checked exactly."""
    if not isinstance(encoded, str):
        raise ProtocolError(f"meta_info.routed_experts is a {type(encoded).__name__}, expected a base64 string")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except ValueError as error:
        raise ProtocolError(f"meta_info.routed_experts is not valid base64: {error}") from None
    expected = num_tokens * num_layers * top_k
    if len(raw) != 4 * expected:
        got = f"{len(raw) // 4} int32 values" if len(raw) % 4 == 0 else f"{len(raw)} bytes (not a multiple of 4)"
        raise ProtocolError(
            f"meta_info.routed_experts holds {got}, expected {expected} = [{num_tokens} tokens (prompt + "
            f"completion - 1), {num_layers} layers, top_k {top_k}]; check num_hidden_layers / "
            f"num_experts_per_tok against the served model"
        )
    array = np.frombuffer(raw, dtype="<i4").reshape(num_tokens, num_layers, top_k)
    return torch.from_numpy(array.astype(np.int32))


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ProtocolError(f"/generate answer field {name!r} = {_short(value)}, expected a list of token ids")
    return value


def _weight_version_spans(value: Any) -> tuple[tuple[int | None, int, int], ...]:
    """SGLang's [{"version", "start", "end"}, ...] (utils/weight_versions.py) -> ((version, start, end), ...)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(span, dict) for span in value):
        raise ProtocolError(f"meta_info.weight_versions = {_short(value)}, expected a list of spans")
    spans = []
    for span in value:
        start, end = span.get("start"), span.get("end")
        if not isinstance(start, int) or not isinstance(end, int):
            raise ProtocolError(f"meta_info.weight_versions span {span!r} lacks integer start/end")
        spans.append((_weight_version({"weight_version": span.get("version")}), start, end))
    return tuple(spans)


def _weight_version(meta: dict) -> int | None:
    value = meta.get("weight_version")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None  # SGLang's default version string is "default"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
