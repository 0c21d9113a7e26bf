"""save_hf_checkpoint on 2 gloo ranks (TP=2, PP=2) and the conversion tool across layouts.

A checkpoint written from a sharded model must hold exactly the HF weights the model was built
from (bit-exact), split into shards no larger than asked, and convert HF -> megatron (TP=2) ->
HF (EP=2) without changing a bit.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from gspo_megatron.models.config import MoEModelConfig
from gspo_megatron.models.conversion import SafetensorsSource
from gspo_megatron.models.hf_checkpoint import write_hf_checkpoint
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import random_hf_state, tiny_test_config
from gspo_megatron.weights.safetensors_writer import INDEX_FILE

pytestmark = pytest.mark.distributed

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"
SHARD_BYTES = 30_000


def save_worker(ctx, cfg, state, layout_kwargs, out_dir):
    from gspo_megatron.models.builder import build_model
    from gspo_megatron.models.conversion import load_hf_weights
    from gspo_megatron.models.hf_checkpoint import save_hf_checkpoint
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.parallel.mesh import initialize_parallel

    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    mesh = initialize_parallel(layout)
    model = build_model(cfg, layout)
    load_hf_weights(model, cfg, state, mesh)
    out = save_hf_checkpoint(model, cfg, mesh, out_dir, shard_bytes=SHARD_BYTES, bucket_bytes=10_000)
    # every rank returns only after the directory is complete
    complete = (Path(out) / INDEX_FILE).is_file()
    mesh.destroy()
    return complete


def tool_worker(ctx, argv):
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _assert_same_weights(directory, state):
    source = SafetensorsSource(directory)
    assert set(source.keys()) == set(state)
    for name, value in state.items():
        assert torch.equal(source.get(name), value), f"{name} changed"


@pytest.mark.parametrize("layout", [dict(tp=2, world_size=2), dict(pp=2, world_size=2)], ids=["tp2", "pp2"])
def test_save_from_two_ranks_is_bit_exact_and_sharded(tmp_path, layout):
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=4)
    out = tmp_path / "export"
    assert run_distributed(save_worker, 2, cfg, state, layout, str(out), timeout=300) == [True, True]
    _assert_same_weights(out, state)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    for file in files:
        names = [k for k, v in index["weight_map"].items() if v == file]
        size = sum(state[n].numel() * state[n].element_size() for n in names)
        assert size <= SHARD_BYTES or len(names) == 1, f"{file} holds {size} bytes"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert MoEModelConfig.from_hf_config_file(out).to_dict() == cfg.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .partial left behind


def test_convert_tool_round_trip_across_layouts(tmp_path):
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=6)
    write_hf_checkpoint([list(state.items())], cfg, tmp_path / "hf")
    run_distributed(
        tool_worker,
        2,
        [
            "hf-to-mcore",
            "--hf-dir",
            str(tmp_path / "hf"),
            "--out",
            str(tmp_path / "mcore"),
            "--tp",
            "2",
            "--layer-spec",
            "portable",
        ],
        timeout=300,
    )
    assert (tmp_path / "mcore" / "metadata.json").is_file() and (tmp_path / "mcore" / "config.json").is_file()
    run_distributed(
        tool_worker,
        2,
        [
            "mcore-to-hf",
            "--mcore-dir",
            str(tmp_path / "mcore"),
            "--out",
            str(tmp_path / "hf2"),
            "--ep",
            "2",
            "--layer-spec",
            "portable",
        ],
        timeout=300,
    )
    _assert_same_weights(tmp_path / "hf2", state)
