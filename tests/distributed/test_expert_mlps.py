"""The grouped expert MLP (``policy/models/grouped_experts.py``, ``model.expert_mlp=grouped``) equals megatron's
``SequentialMLP`` on one rank and on every layout of the equivalence suite: the same log-probs, loss
and gradients (gathered to HF names) to 1e-5 in fp32, and the same HF export of the same loaded
weights (one parameter layout, so checkpoints and HF conversion do not depend on the choice).
Both run in one launch on the same parallel state and the same batch."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import (
    EQUIVALENCE_LAYOUTS,
    assert_same_results,
    model_variants_worker,
    random_hf_state,
    tiny_test_config,
)

pytestmark = pytest.mark.distributed

LAYOUTS = {"single": dict(world_size=1), **EQUIVALENCE_LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grouped_experts_equal_sequential_mlp(name):
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=3)
    layout = LAYOUTS[name]
    variants = [{"expert_mlp": "sequential"}, {"expert_mlp": "grouped"}]
    per_rank = run_distributed(model_variants_worker, layout["world_size"], cfg, state, layout, variants, timeout=600)
    for rank, (sequential, grouped) in enumerate(per_rank):
        assert grouped["exported"].keys() == sequential["exported"].keys() == state.keys()
        for key, value in sequential["exported"].items():
            assert torch.equal(grouped["exported"][key], value), f"rank {rank}: export of {key} differs"
        assert_same_results(sequential, grouped, rank, tol=1e-5)
        assert max(g.abs().max().item() for g in grouped["grads"].values() if g.numel()) > 0
