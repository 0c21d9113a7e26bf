"""Weight sync: byte-size buckets, the 0.5.x call bracket, disk fallback, and a real gloo broadcast."""

import json
import sys

import httpx
import pytest
import torch

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.core.ports import free_port
from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine, WeightSyncError
from gspo_megatron.rollout.sglang.weight_sync import (
    bucket_metadata,
    bucket_named_tensors,
    close_weight_update_group,
    open_weight_update_group,
)
from gspo_megatron.testing.listeners import listening_addresses, non_loopback_ipv4, reachable
from gspo_megatron.testing.sglang_double import SGLangServerDouble
from gspo_megatron.testing.sglang_double_faults import DoubleFaults

BRACKET_HEAD = ["/pause_generation", "/begin_weight_update"]
BRACKET_TAIL = ["/end_weight_update", "/flush_cache", "/continue_generation"]


def test_buckets_by_bytes_in_order():
    a, b, c, d = torch.zeros(10), torch.zeros(5), torch.zeros(20), torch.zeros(1)  # 40, 20, 80, 4 bytes
    buckets = list(bucket_named_tensors([("a", a), ("b", b), ("c", c), ("d", d)], bucket_bytes=64))
    assert [[name for name, _ in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"]]  # c is oversize: alone
    half = torch.zeros(16, dtype=torch.bfloat16)  # 32 bytes
    assert len(list(bucket_named_tensors([("x", half), ("y", half)], bucket_bytes=64))) == 1
    with pytest.raises(ValueError):
        list(bucket_named_tensors([("a", a)], bucket_bytes=0))


def test_bucket_metadata_is_sglang_update_weights_from_distributed():
    bucket = [("w", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(3))]
    assert bucket_metadata(bucket, "g", 7) == {
        "names": ["w", "b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [3]],
        "group_name": "g",
        "flush_cache": False,
        "weight_version": "7",
    }


def _model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_experts_per_tok": 2}))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"old weights, must not be copied")
    return model


def _disk_sync_config(double, model, tmp_path, **overrides) -> SGLangConfig:
    """Attached to ``double``, weights through the disk path into ``tmp_path / "sync"``."""
    return SGLangConfig(
        mode="attach",
        urls=[double.url],
        weight_sync="disk",
        model_path=str(model),
        disk_sync_dir=str(tmp_path / "sync"),
        health_poll_interval_s=0.01,
        **overrides,
    )


def test_disk_sync_call_order_files_and_version(tmp_path):
    double = SGLangServerDouble().start()
    try:
        config = _disk_sync_config(double, _model_dir(tmp_path), tmp_path, weight_bucket_bytes=64)
        tensors = [
            ("layer.0.w", torch.arange(12.0).reshape(3, 4)),
            ("layer.0.b", torch.ones(4)),
            ("head", torch.ones(2)),
        ]
        with SGLangEngine(config) as engine:
            engine.update_weights(iter(tensors), version=5)
            sample = engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))[0][0]
        paths = [p for p in double.paths() if p not in ("/health", "/generate", "/server_info")]
        assert paths == BRACKET_HEAD + ["/update_weights_from_disk"] + BRACKET_TAIL
        disk_call = [body for path, body in double.calls if path == "/update_weights_from_disk"][0]
        out = tmp_path / "sync" / "v5"
        assert disk_call == {"model_path": str(out), "weight_version": "5", "flush_cache": False}
        # 48 + 16 = 64 bytes fill shard 1 exactly, 8 go to shard 2; config/tokenizer copied, old weights not
        assert sorted(p.name for p in out.iterdir()) == [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
        ]
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert index == {
            "layer.0.w": "model-00001-of-00002.safetensors",
            "layer.0.b": "model-00001-of-00002.safetensors",
            "head": "model-00002-of-00002.safetensors",
        }
        assert double.received_weights["layer.0.w"]["sum"] == 66.0
        assert engine.weight_version == 5 and sample.weight_version == 5  # read back from meta_info
    finally:
        double.stop()


def test_failed_update_ends_the_session_and_the_server_stays_usable(tmp_path):
    """Behaviour 3: SGLang refuses every begin_weight_update while a session is open."""
    double = SGLangServerDouble(faults=DoubleFaults(fail_disk_updates=1)).start()
    try:
        config = SGLangConfig(
            mode="attach",
            urls=[double.url],
            weight_sync="disk",
            model_path=str(_model_dir(tmp_path)),
            disk_sync_dir=str(tmp_path / "sync"),
            health_poll_interval_s=0.01,
        )
        with SGLangEngine(config) as engine:
            with pytest.raises(WeightSyncError, match="version 3 failed.*loading the checkpoint failed"):
                engine.update_weights([("w", torch.ones(2))], version=3)
            assert engine.weight_version == 0 and not double.session_open
            assert double.paths()[-2:] == ["/end_weight_update", "/continue_generation"] and not double.paused
            engine.update_weights([("w", torch.ones(2))], version=4)  # the next update is accepted
            assert engine.weight_version == 4
    finally:
        double.stop()


def test_disk_update_needs_no_session_as_in_sglang(tmp_path):
    """Behaviour 5: SGLang's disk path has no session check; the double no longer refuses it."""
    double = SGLangServerDouble().start()
    try:
        config = SGLangConfig(
            mode="attach",
            urls=[double.url],
            weight_sync="disk",
            model_path=str(_model_dir(tmp_path)),
            disk_sync_dir=str(tmp_path / "sync"),
            bracket_weight_update=False,
            health_poll_interval_s=0.01,
        )
        with SGLangEngine(config) as engine:
            engine.update_weights([("w", torch.ones(2))], version=3)
            assert engine.weight_version == 3 and double.paths()[-1] == "/continue_generation"
    finally:
        double.stop()


@pytest.mark.slow
def test_distributed_sync_broadcasts_into_two_servers(tmp_path):
    """Two launched doubles join a real gloo group with the trainer (ranks 1 and 2 of 3)."""
    model = _model_dir(tmp_path)
    config = SGLangConfig(
        mode="launch",
        model_path=str(model),
        num_servers=2,
        launch_command=[sys.executable, "-m", "gspo_megatron.testing.sglang_double"],
        extra_args=["--join-weight-groups"],
        log_dir=str(tmp_path / "logs"),
        health_poll_interval_s=0.05,
        weight_sync_backend="gloo",
        weight_sync_group_name="test_two_servers",
        weight_bucket_bytes=64,
        weight_sync_timeout_s=60.0,
        shutdown_grace_s=5.0,
    )
    tensors = [
        ("a", torch.arange(10.0)),
        ("b", torch.full((2, 2), 2.0, dtype=torch.bfloat16)),
        ("c", torch.arange(20.0)),
    ]
    with SGLangEngine(config) as engine:
        engine.update_weights(tensors, version=1)
        engine.update_weights([("a", torch.ones(10))], version=2)
        samples = engine.generate([[1, 2]], SamplingParams(max_new_tokens=3, n=2))
        states = [httpx.get(url + "/_double/state", trust_env=False).json() for url in engine.server_urls]
    assert all(sample.weight_version == 2 for sample in samples[0])
    offsets = []
    for state in states:
        paths = [path for path, _ in state["calls"] if path not in ("/health", "/generate", "/server_info")]
        assert paths == (
            BRACKET_HEAD
            + ["/init_weights_update_group"]
            + ["/update_weights_from_distributed"] * 2
            + BRACKET_TAIL
            + BRACKET_HEAD
            + ["/update_weights_from_distributed"]
            + BRACKET_TAIL
        )
        init = [body for path, body in state["calls"] if path == "/init_weights_update_group"][0]
        assert init["world_size"] == 3 and init["backend"] == "gloo" and init["group_name"] == "test_two_servers"
        offsets.append(init["rank_offset"])
        updates = [body for path, body in state["calls"] if path == "/update_weights_from_distributed"]
        assert [u["names"] for u in updates] == [["a", "b"], ["c"], ["a"]]  # 40 + 8 bytes, then 80 alone
        received = state["received"]
        group = {"group": "test_two_servers"}
        assert received["a"] == {"shape": [10], "dtype": "float32", "sum": 10.0, **group}  # the version-2 values
        assert received["b"] == {"shape": [2, 2], "dtype": "bfloat16", "sum": 8.0, **group}
        assert received["c"]["sum"] == 190.0
        assert state["weight_version"] == "2"
    assert sorted(offsets) == [1, 2]


def test_fp8_block_weights_go_out_as_the_fp8_checkpoints_tensors(tmp_path):
    """rollout.sglang.weight_quantization=fp8_block (disk path, a server serving an FP8 checkpoint): each
    projection is written as e4m3 with its weight_scale_inv beside it, the norm as sent; what the server reads
    back dequantizes to the weight within FP8's rounding. (gloo cannot broadcast float8 -- "Invalid scalar type"
    -- so the distributed path's FP8 buckets are NCCL's: the GPU tier.)"""
    from safetensors.torch import load_file

    from gspo_megatron.core.fp8_blocks import FP8_DTYPE, QUANTIZATION_CONFIG, dequantize_block_fp8

    model = _model_dir(tmp_path)
    config_json = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config_json, "quantization_config": QUANTIZATION_CONFIG}))
    double = SGLangServerDouble().start()
    try:
        config = _disk_sync_config(double, model, tmp_path, weight_quantization="fp8_block")
        config.validate()
        q_proj = torch.randn(130, 70, generator=torch.Generator().manual_seed(0))
        tensors = [("model.layers.0.self_attn.q_proj.weight", q_proj), ("model.norm.weight", torch.ones(70))]
        with SGLangEngine(config) as engine:
            engine.update_weights(tensors, version=3)
        written = {}
        for file in sorted((tmp_path / "sync" / "v3").glob("*.safetensors")):
            written.update(load_file(file))
        assert sorted(written) == [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.q_proj.weight_scale_inv",
            "model.norm.weight",
        ]
        assert written["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
        assert written["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 1)
        back = dequantize_block_fp8(
            written["model.layers.0.self_attn.q_proj.weight"],
            written["model.layers.0.self_attn.q_proj.weight_scale_inv"],
        )
        assert ((back - q_proj).abs() <= 2.0**-4 * q_proj.abs() + 1e-3).all()
        assert torch.equal(written["model.norm.weight"], torch.ones(70))
    finally:
        double.stop()


@pytest.mark.parametrize("under_a_launcher", [False, True], ids=["alone", "agent-store-env"])
def test_the_trainers_rendezvous_store_listens_on_the_master_address_only(monkeypatch, under_a_launcher):
    """issue 63: torch's ``tcp://`` rendezvous served the group's store on every interface (another
    user's process joined as rank 1 and received the weights); under a launcher that sets
    ``TORCHELASTIC_USE_AGENT_STORE`` it served none at all (rank 0 became a client of nothing)."""
    if under_a_launcher:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what the project's launcher and torchrun set
    port = free_port()
    group = open_weight_update_group("127.0.0.1", port, 1, backend="gloo", group_name="bind_test", timeout_s=10)
    try:
        bound = listening_addresses(port)
        other = non_loopback_ipv4()
        reached = other is not None and reachable(other, port)
    finally:
        close_weight_update_group(group)
    assert bound == {"127.0.0.1"}
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    assert not reached, f"the weight-sync store answered on {other}:{port}"
