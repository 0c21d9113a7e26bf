"""Tensor handles for /update_weights_from_tensor: another process on this host, one that shares nothing
with the sender (not its child: no authkey), rebuilds the bucket from the payload alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as torch_mp

from gspo_megatron.rollout.sglang.tensor_handles import serialize_named_tensors, update_from_tensor_body

READER = """
import base64, json, pickle, sys
named = pickle.loads(base64.b64decode(sys.stdin.read()))
print(json.dumps([[name, str(t.dtype), t.float().flatten().tolist()] for name, t in named]))
"""


def _read_in_another_process(payload: str) -> list:
    done = subprocess.run([sys.executable, "-c", READER], input=payload, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_another_process_rebuilds_the_bucket_from_shared_memory():
    bucket = [("w", torch.randn(3, 4)), ("b", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[:, 1:])]
    got = _read_in_another_process(serialize_named_tensors(bucket))
    assert [name for name, _, _ in got] == ["w", "b"]
    for (_, dtype, values), (_, sent) in zip(got, bucket, strict=True):
        assert dtype == str(sent.dtype) and values == sent.float().flatten().tolist()
    assert torch_mp.get_sharing_strategy() == "file_descriptor"  # restored after the pickling


def test_the_default_strategy_would_not_do():
    """Why the file_system strategy: under torch's default the payload names a file descriptor that only
    the sender's children can fetch, and an unrelated reader fails (as an SGLang server would)."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("w", torch.randn(2, 2))])
    done = subprocess.run(
        [sys.executable, "-c", READER],
        input=base64.b64encode(buffer.getvalue()).decode(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0


def test_one_payload_per_server_rank():
    body = update_from_tensor_body([("w", torch.zeros(2))], tp_size=3, weight_version=4)
    assert len(body["serialized_named_tensors"]) == 3
    assert (body["flush_cache"], body["weight_version"], body["load_format"]) == (False, "4", None)
    with pytest.raises(ValueError, match="at least one TP rank"):
        update_from_tensor_body([("w", torch.zeros(2))], tp_size=0, weight_version=4)
