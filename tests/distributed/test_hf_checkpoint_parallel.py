"""save_hf_checkpoint on 2 gloo ranks (TP=2, PP=2) and the conversion tool across layouts.

A checkpoint written from a sharded model must hold exactly the HF weights the model was built
from (bit-exact), split into shards no larger than asked, and convert HF -> megatron (TP=2) ->
HF (EP=2) without changing a bit, run as the README runs it (the project's launcher, ``--script``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.core.safetensors_writer import INDEX_FILE
from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.models.hf_checkpoint import write_hf_checkpoint
from gspo_megatron.policy.models.weight_sources import SafetensorsSource
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import random_hf_state, tiny_test_config

pytestmark = pytest.mark.distributed

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"
SHARD_BYTES = 30_000


def save_worker(ctx, cfg, state, layout_kwargs, out_dir):
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.hf_checkpoint import save_hf_checkpoint
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout)
    model = build_model(cfg, layout)
    load_hf_weights(model, cfg, state, mesh)
    out = save_hf_checkpoint(model, cfg, mesh, out_dir, shard_bytes=SHARD_BYTES, bucket_bytes=10_000)
    # every rank returns only after the directory is complete
    complete = (Path(out) / INDEX_FILE).is_file()
    mesh.destroy()
    return complete


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


def _launch_tool(argv: list[str]) -> None:
    """The README's command: the project's launcher runs the tool on 2 ranks (loopback-only store)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "gspo_megatron.launcher", "--nproc-per-node", "2", "--script", str(TOOL), *argv]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launcher: warning" not in done.stderr  # 127.0.0.1 by default: nothing to warn about


def test_convert_tool_round_trip_across_layouts(tmp_path):
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=6)
    write_hf_checkpoint([list(state.items())], cfg, tmp_path / "hf")
    hf, mcore, hf2 = (str(tmp_path / name) for name in ("hf", "mcore", "hf2"))
    _launch_tool(["hf-to-mcore", "--hf-dir", hf, "--out", mcore, "--tp", "2", "--layer-spec", "portable"])
    assert (tmp_path / "mcore" / "metadata.json").is_file() and (tmp_path / "mcore" / "config.json").is_file()
    _launch_tool(["mcore-to-hf", "--mcore-dir", mcore, "--out", hf2, "--ep", "2", "--layer-spec", "portable"])
    _assert_same_weights(tmp_path / "hf2", state)
