"""Launch flags, control bodies and response fields against SGLang's own parser, app and encoders."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from gspo_megatron.rollout.sglang.launcher import build_launch_command
from gspo_megatron.rollout.sglang.protocol import decode_routed_experts, parse_generate_response
from gspo_megatron.rollout.sglang.tensor_handles import update_from_tensor_body
from gspo_megatron.rollout.sglang.version import MAX_SGLANG, MIN_SGLANG
from gspo_megatron.rollout.sglang.weight_sync import bucket_metadata

LAUNCH_CASES = {
    "plain": dict(tp=1, enable_return_routed_experts=False, enable_deterministic_inference=False, extra_args=()),
    "r3-deterministic": dict(
        tp=4,
        enable_return_routed_experts=True,
        enable_deterministic_inference=True,
        extra_args=("--mem-fraction-static", "0.7", "--disable-radix-cache"),
    ),
}


def test_installed_sglang_is_in_the_supported_range(sglang_reference):
    from packaging.version import Version

    assert Version(MIN_SGLANG) <= Version(sglang_reference.version) < Version(MAX_SGLANG)


@pytest.mark.parametrize("case", sorted(LAUNCH_CASES))
def test_every_launch_argv_parses_with_sglang_server_args(sglang_reference, case):
    settings = LAUNCH_CASES[case]
    argv = build_launch_command([], model_path="/models/m", host="10.0.0.5", port=31000, **settings)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = sglang_reference.prepare_server_args(argv[3:])
    assert (args.model_path, args.tp_size, args.host, args.port) == ("/models/m", settings["tp"], "10.0.0.5", 31000)
    assert args.enable_return_routed_experts == settings["enable_return_routed_experts"]
    assert args.enable_deterministic_inference == settings["enable_deterministic_inference"]
    # Every flag is SGLang's full name, not an argparse abbreviation (``--tp`` was one).
    from sglang.srt.server_args import ServerArgs

    strict = argparse.ArgumentParser(allow_abbrev=False)
    ServerArgs.add_cli_args(strict)
    strict.parse_args(argv[3:])


def _control_bodies() -> list[tuple[str, dict]]:
    tensors = [("model.layers.0.mlp.experts.w1", torch.zeros(2, 3, dtype=torch.bfloat16)), ("lm_head", torch.zeros(4))]
    return [
        ("/update_weights_from_distributed", bucket_metadata(tensors, "gspo_weight_update", 7)),
        # a pipeline stage's sender: its own group, no version (set once every stage has sent)
        ("/update_weights_from_distributed", bucket_metadata(tensors, "gspo_weight_update_stage1", None)),
        (
            "/init_weights_update_group",
            {
                "master_address": "10.0.0.1",
                "master_port": 29600,
                "rank_offset": 1,
                "world_size": 3,
                "group_name": "gspo_weight_update",
                "backend": "nccl",
            },
        ),
        ("/destroy_weights_update_group", {"group_name": "gspo_weight_update"}),
        ("/update_weights_from_disk", {"model_path": "/abs/sync/v7", "weight_version": "7", "flush_cache": False}),
        ("/update_weights_from_tensor", update_from_tensor_body(tensors, 2, 7)),
        ("/begin_weight_update", {}),
        ("/end_weight_update", {}),
        ("/pause_generation", {"mode": "abort"}),
        ("/pause_generation", {"mode": "retract"}),
        ("/pause_generation", {"mode": "in_place"}),
        ("/continue_generation", {}),
    ]


@pytest.mark.parametrize(
    "path, body", _control_bodies(), ids=[f"{p}-{i}" for i, (p, _) in enumerate(_control_bodies())]
)
def test_every_control_body_passes_sglang_validation(sglang_reference, path, body):
    verdict = sglang_reference.post(path, body)
    assert verdict.accepted, f"SGLang's app refuses the project's {path} body {body}: {verdict.reason}"


def test_the_abort_request_body_passes_sglang_validation(sglang_reference):
    """Over-sampling stops a running row by its rid (``SGLangEngine.generate_rows``). SGLang's handler catches
    its own failure without a tokenizer manager and answers 400 with it, so the check is the body's parse
    into ``AbortReq`` and an answer past FastAPI's validation (422) that is that failure."""
    body = {"rid": "gspo-0123456789ab-3"}
    request = sglang_reference.io_struct.AbortReq(**body)
    assert request.rid == body["rid"] and request.abort_all is False
    response = sglang_reference.client.post("/abort_request", json=body)
    assert response.status_code != 422 and "tokenizer_manager" in response.text, response.text


def test_the_weight_version_commit_body_passes_sglang_validation(sglang_reference):
    """Per-stage senders set the version once every stage has sent (``SGLangEngine._sync_distributed``);
    the handler catches its own failure without a tokenizer manager (as for abort_request)."""
    body = {"new_version": "7", "abort_all_requests": False}
    request = sglang_reference.io_struct.UpdateWeightVersionReqInput(**body)
    assert request.new_version == "7" and request.abort_all_requests is False
    response = sglang_reference.client.post("/update_weight_version", json=body)
    assert response.status_code != 422 and "tokenizer_manager" in response.text, response.text


def test_sglangs_unpickler_rebuilds_the_tensor_handles_exactly():
    """Each TP rank's payload passes SGLang's allow-listed unpickler (``SafeUnpickler``: no global
    outside its list) and rebuilds the bucket's names, dtypes and values from the shared memory."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    bucket = [
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(4, 3).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(5)),
        ("lm_head.weight", torch.randn(2, 5)[:, 1:]),  # a strided view travels as its own values
    ]
    body = update_from_tensor_body(bucket, 2, 9)
    assert len(body["serialized_named_tensors"]) == 2 and body["weight_version"] == "9"
    for payload in body["serialized_named_tensors"]:
        rebuilt = MultiprocessingSerializer.deserialize(payload)
        assert [name for name, _ in rebuilt] == [name for name, _ in bucket]
        for (_, got), (_, sent) in zip(rebuilt, bucket, strict=True):
            assert got.dtype == sent.dtype and torch.equal(got, sent)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/pause_generation", {"mode": "bogus"}),
        ("/update_weights_from_distributed", {"names": "a"}),
        ("/init_weights_update_group", {"master_address": "x"}),
    ],
)
def test_invalid_control_bodies_are_refused_by_sglang_and_the_double(sglang_reference, path, body):
    import httpx

    from gspo_megatron.testing.sglang_double import SGLangServerDouble

    assert not sglang_reference.post(path, body).accepted
    with SGLangServerDouble() as double:
        assert httpx.post(double.url + path, json=body, trust_env=False).status_code == 400


def test_response_fields_decode_from_what_sglang_fills(sglang_reference):
    """output_token_logprobs as TokenizerManager writes them, finish_reason as schedule_batch's classes
    serialise it, routed_experts as the detokenizer encodes them, weight_versions as utils writes them."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.utils.weight_versions import (
        WeightVersionEvent,
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
    )

    prompt, output = [11, 12, 13], [21, 22, 23, 24]
    layers, top_k = 3, 2
    experts = np.arange((len(prompt) + len(output) - 1) * layers * top_k, dtype=np.int32).reshape(-1, layers, top_k)
    encoded = DetokenizerManager._b64_encode_per_request([torch.from_numpy(experts)])[0]
    logprobs = TokenizerManager.detokenize_logprob_tokens(None, [-0.5, -0.25, -1.0, -2.0], output, False)
    meta = {
        "output_token_logprobs": [list(entry) for entry in logprobs],
        "routed_experts": encoded,
        "finish_reason": FINISH_LENGTH(length=4).to_json(),
    }
    spans = compute_weight_version_spans([WeightVersionEvent(old_version="5", num_output_tokens=2)], "6", len(output))
    add_weight_versions_to_meta_info(meta, spans, len(output))
    result = parse_generate_response(
        {"output_ids": output, "meta_info": meta}, len(prompt), routed_experts_layout=(layers, top_k)
    )
    assert torch.equal(result.routed_experts, torch.from_numpy(experts))
    assert result.output_log_probs.tolist() == [-0.5, -0.25, -1.0, -2.0]
    assert result.weight_version == 6 and result.oldest_weight_version == 5
    assert result.token_versions(unnamed=0) == [5, 5, 6, 6]  # the update landed after 2 tokens
    assert result.weight_versions == ((5, 0, 2), (6, 2, 4))
    for finish in (FINISH_MATCHED_TOKEN(matched=2), FINISH_ABORT("aborted")):
        meta["finish_reason"] = finish.to_json()
        parse_generate_response({"output_ids": output, "meta_info": meta}, len(prompt))
    with pytest.raises(Exception, match="holds 36 int32 values, expected 42"):
        decode_routed_experts(encoded, len(prompt) + len(output), layers, top_k)  # one row too many


def test_client_keep_alive_expires_before_sglangs(sglang_reference):
    """An idle pooled connection must be dropped by the client before the server closes it, or a
    request reuses it as it closes (ReadError; two of them marked a healthy server dead, seen live)."""
    from sglang.srt.environ import envs

    from gspo_megatron.rollout.sglang.config import SGLangConfig

    assert SGLangConfig().keepalive_expiry_s < envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()
