"""The /generate wire format on hand-built payloads (no server)."""

import base64
import struct

import pytest
import torch

from gspo_megatron.contracts.samples import FinishReason, SamplingParams
from gspo_megatron.rollout.sglang.protocol import (
    ProtocolError,
    build_generate_request,
    decode_routed_experts,
    parse_generate_response,
)


def _b64_int32(values):
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def _response(output_ids, logprobs, finish="stop", **meta):
    # strict=False: some bodies pair mismatched lengths on purpose (the parser must refuse them)
    entries = [[lp, tok, None] for lp, tok in zip(logprobs, output_ids, strict=False)]
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {"output_token_logprobs": entries, "finish_reason": {"type": finish}, **meta},
    }


def test_request_body_carries_every_sampling_field():
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        max_new_tokens=5,
        stop=("</s>",),
        stop_token_ids=(2, 7),
        return_routed_experts=True,
    )
    body = build_generate_request([1, 2, 3], params, sampling_seed=11, skip_special_tokens=False, no_stop_trim=True)
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "max_new_tokens": 5,
            "stop": ["</s>"],
            "stop_token_ids": [2, 7],
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "sampling_seed": 11,
        },
        "return_logprob": True,
        "return_routed_experts": True,
    }
    plain = build_generate_request([4], SamplingParams())
    assert "return_routed_experts" not in plain and "sampling_seed" not in plain["sampling_params"]


def test_parse_logprobs_finish_reason_and_version():
    result = parse_generate_response(_response([5, 9, 2], [-0.25, -1.5, 0.0], "stop", weight_version="3"), 4)
    assert result.output_ids == [5, 9, 2]
    assert result.output_log_probs.dtype == torch.float32
    assert result.output_log_probs.tolist() == [-0.25, -1.5, 0.0]
    assert result.finish_reason is FinishReason.STOP
    assert result.weight_version == 3
    assert parse_generate_response(_response([5], [-1.0], "length"), 1).finish_reason is FinishReason.LENGTH
    aborted = parse_generate_response(_response([5], [-1.0], "abort", weight_version="default"), 1)
    assert aborted.finish_reason is FinishReason.ABORT and aborted.weight_version is None


def test_each_tokens_version_comes_from_the_spans_and_spans_that_do_not_tile_the_output_are_refused():
    tokens, log_probs = [5, 9, 2, 7], [-0.5] * 4
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 4}]
    result = parse_generate_response(_response(tokens, log_probs, weight_version="4", weight_versions=spans), 2)
    assert result.token_versions(unnamed=0) == [3, 4, 4, 4] and result.oldest_weight_version == 3
    one = parse_generate_response(_response(tokens, log_probs, weight_version="default"), 2)
    assert one.token_versions(unnamed=7) == [7, 7, 7, 7]  # no version named yet: the engine's own
    gap = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 2, "end": 4}]
    with pytest.raises(ProtocolError, match="do not tile the 4 output tokens"):
        parse_generate_response(_response(tokens, log_probs, weight_versions=gap), 2).token_versions(0)
    short = [{"version": "3", "start": 0, "end": 3}]
    with pytest.raises(ProtocolError, match="cover 3 tokens, the output has 4"):
        parse_generate_response(_response(tokens, log_probs, weight_versions=short), 2).token_versions(0)


def test_routed_experts_decoded_little_endian_in_token_layer_topk_order():
    # prompt 2 + output 2 - 1 = 3 token rows, 2 layers, top-2: values 0..11 laid out row-major.
    encoded = _b64_int32(list(range(12)))
    body = _response([7, 8], [-1.0, -2.0], routed_experts=encoded)
    result = parse_generate_response(body, 2, routed_experts_layout=(2, 2))
    assert result.routed_experts.dtype == torch.int32
    assert result.routed_experts.shape == (3, 2, 2)
    assert result.routed_experts[1, 0].tolist() == [4, 5]  # token 1, layer 0
    assert result.routed_experts[2, 1].tolist() == [10, 11]
    # little-endian: 256 is bytes 00 01 00 00
    assert decode_routed_experts(base64.b64encode(b"\x00\x01\x00\x00").decode(), 1, 1, 1).item() == 256


def test_routed_experts_wrong_size_names_both_sizes():
    encoded = _b64_int32(list(range(8)))  # 8 values, expected 3*2*2 = 12
    with pytest.raises(ProtocolError, match=r"holds 8 int32 values, expected 12 = \[3 tokens"):
        parse_generate_response(
            _response([7, 8], [-1.0, -2.0], routed_experts=encoded), 2, routed_experts_layout=(2, 2)
        )
    with pytest.raises(ProtocolError, match="not a multiple of 4"):
        decode_routed_experts(base64.b64encode(b"\x00" * 6).decode(), 1, 1, 1)
    with pytest.raises(ProtocolError, match="not valid base64"):
        decode_routed_experts("@@@", 1, 1, 1)


def test_missing_routed_experts_explains_the_launch_flag():
    with pytest.raises(ProtocolError, match="--enable-return-routed-experts"):
        parse_generate_response(_response([7], [-1.0]), 2, routed_experts_layout=(2, 2))


def test_a_request_aborted_before_it_ran_has_no_routed_experts():
    """SGLang's tokenizer manager writes meta_info.routed_experts only when the scheduler captured some
    (``tokenizer_manager.py``, 0.5.23: ``if getattr(recv_obj, "routed_experts", None)``); a request aborted in
    the waiting queue -- over-sampling stopping a row that never started -- has none (seen live: "Abort in
    waiting queue", no tokens). Its sample has no routes; a finished answer without them is still refused."""
    body = _response([], [], finish="abort")
    result = parse_generate_response(body, 4, routed_experts_layout=(2, 2))
    assert result.finish_reason == FinishReason.ABORT and result.routed_experts is None


@pytest.mark.parametrize(
    "body, message",
    [
        ([1, 2], "expected a JSON object"),
        ({"output_ids": [1]}, "no meta_info"),
        ({"output_ids": "12", "meta_info": {}}, "'output_ids'"),
        ({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}}, "return_logprob"),
        (_response([1, 2], [-1.0]), "output_ids has 2"),  # one log-prob for two tokens
        (
            {
                "output_ids": [1, 2],
                "meta_info": {
                    "output_token_logprobs": [[-1.0, 1, None], [-1.0, 3, None]],
                    "finish_reason": {"type": "stop"},
                },
            },
            "do not belong",
        ),
        (_response([1], [0.5]), "expected a number <= 0"),
        (_response([1], [-0.1], "eos"), "not one of"),
        (
            {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]], "finish_reason": "stop"}},
            "finish_reason",
        ),
    ],
)
def test_malformed_responses_are_named(body, message):
    with pytest.raises(ProtocolError, match=message):
        parse_generate_response(body, 1)


@pytest.mark.slow
def test_request_body_is_a_valid_sglang_generate_req_input():
    io_struct = pytest.importorskip("sglang.srt.managers.io_struct")
    body = build_generate_request(
        [1, 2, 3], SamplingParams(max_new_tokens=4, stop_token_ids=(2,), return_routed_experts=True), sampling_seed=3
    )
    request = io_struct.GenerateReqInput(**body)
    assert request.input_ids == [1, 2, 3] and request.return_logprob and request.return_routed_experts
    sampling = pytest.importorskip("sglang.srt.sampling.sampling_params")
    sampling.SamplingParams(**body["sampling_params"]).verify(vocab_size=100)
