"""HF checkpoint writing without torch.distributed: sharding, index, atomic replace, tokenizer copy.

The exported directory must load in ``transformers`` with exactly the tensors that were written.
"""

from __future__ import annotations

import json

import pytest
import torch

from gspo_megatron.core.safetensors_writer import INDEX_FILE
from gspo_megatron.policy.models.hf_checkpoint import HFCheckpointError, hf_shape_fields, write_hf_checkpoint
from gspo_megatron.policy.models.weight_sources import SafetensorsSource
from gspo_megatron.testing.model_fixtures import (
    FAMILY_TEST_OVERRIDES,
    random_hf_state,
    tiny_family_config,
    tiny_test_config,
)


def _buckets(state, per_bucket=5):
    items = list(state.items())
    return [items[i : i + per_bucket] for i in range(0, len(items), per_bucket)]


def _float_tensors(*numels):
    return {f"t{i}": torch.arange(n, dtype=torch.float32) for i, n in enumerate(numels)}


def test_shards_close_before_exceeding_the_limit(tmp_path):
    cfg = tiny_test_config()
    # 10 floats = 40 bytes each; limit 100 bytes -> shards of 2, 2, 1 tensors; 300 floats alone.
    state = _float_tensors(10, 10, 10, 10, 300, 10)
    out = write_hf_checkpoint(_buckets(state, 2), cfg, tmp_path / "export", shard_bytes=100)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    by_file = {f: sorted(k for k, v in index["weight_map"].items() if v == f) for f in files}
    assert list(by_file.values()) == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5"]]
    assert index["metadata"]["total_size"] == 4 * (5 * 10 + 300)
    source = SafetensorsSource(out)
    for name, value in state.items():
        assert torch.equal(source.get(name), value)
    assert not (tmp_path / "export.partial").exists()


def test_views_sharing_storage_are_written(tmp_path):
    fused = torch.arange(8.0).reshape(4, 2)
    gate, up = fused.chunk(2, dim=0)  # what the export yields for a fused gate/up weight
    out = write_hf_checkpoint([[("gate", gate), ("up", up)]], tiny_test_config(), tmp_path / "e")
    source = SafetensorsSource(out)
    assert torch.equal(source.get("gate"), gate) and torch.equal(source.get("up"), up)


@pytest.mark.parametrize("family", sorted(FAMILY_TEST_OVERRIDES))
def test_transformers_loads_the_export_with_the_written_weights(tmp_path, family):
    from transformers import AutoModelForCausalLM

    cfg = tiny_family_config(family)
    state = random_hf_state(cfg, seed=5)
    out = write_hf_checkpoint(_buckets(state), cfg, tmp_path / "export", shard_bytes=20_000)
    assert len(set(json.loads((out / INDEX_FILE).read_text())["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == cfg.architecture.architecture
    loaded = model.state_dict()
    for name, value in state.items():
        # transformers 5 fuses experts in memory; compare through the checkpoint names it saves back
        if name in loaded:
            assert torch.equal(loaded[name], value), name
    model.save_pretrained(tmp_path / "resaved")
    resaved = SafetensorsSource(tmp_path / "resaved")
    assert set(resaved.keys()) == set(state)
    for name, value in state.items():
        assert torch.equal(resaved.get(name), value), name
    # config.json round-trips to the same model shape
    assert hf_shape_fields(out) == cfg.to_dict()


def test_existing_export_is_replaced_and_survives_a_failed_write(tmp_path):
    cfg = tiny_test_config()
    out = tmp_path / "export"
    write_hf_checkpoint([list(_float_tensors(4).items())], cfg, out)
    write_hf_checkpoint([[("new", torch.ones(3))]], cfg, out)
    assert list(SafetensorsSource(out).keys()) == ["new"]

    def failing():
        yield [("half", torch.zeros(2))]
        raise RuntimeError("rank died mid-export")

    with pytest.raises(RuntimeError, match="mid-export"):
        write_hf_checkpoint(failing(), cfg, out)
    assert list(SafetensorsSource(out).keys()) == ["new"]  # the previous export is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_config_records_the_written_dtype_and_tokenizer_files_are_copied(tmp_path):
    cfg = tiny_test_config()
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "unrelated.bin").write_text("x")
    out = write_hf_checkpoint([[("w", torch.ones(2, dtype=torch.bfloat16))]], cfg, tmp_path / "e", tokenizer_dir=tok)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["num_experts"] == cfg.num_experts and config["model_type"] == "qwen3_moe"
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert not (out / "unrelated.bin").exists()


def test_clear_errors(tmp_path):
    cfg = tiny_test_config()
    with pytest.raises(HFCheckpointError, match="holds none of"):
        write_hf_checkpoint([[("w", torch.ones(1))]], cfg, tmp_path / "e", tokenizer_dir=tmp_path)
    with pytest.raises(ValueError, match="exported twice"):
        write_hf_checkpoint([[("w", torch.ones(1))], [("w", torch.ones(1))]], cfg, tmp_path / "e")
    with pytest.raises(ValueError, match="shard_bytes"):
        write_hf_checkpoint([[("w", torch.ones(1))]], cfg, tmp_path / "e", shard_bytes=0)
    assert not (tmp_path / "e").exists() and not (tmp_path / "e.partial").exists()
    with pytest.raises(HFCheckpointError, match="not a directory"):
        hf_shape_fields(tmp_path / "missing")
