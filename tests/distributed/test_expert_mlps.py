"""The grouped expert MLP (``models/grouped_experts.py``, ``model.expert_mlp=grouped``) equals megatron's
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
        assert grouped["log_probs"].keys() == sequential["log_probs"].keys()
        for dp_rank, logp in sequential["log_probs"].items():
            torch.testing.assert_close(grouped["log_probs"][dp_rank], logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grouped["loss"], sequential["loss"], rtol=1e-5, atol=1e-8)
        for key, grad in sequential["grads"].items():
            torch.testing.assert_close(
                grouped["grads"][key],
                grad,
                rtol=1e-5,
                atol=1e-7,
                msg=lambda m, key=key, rank=rank: f"rank {rank} {key}: {m}",
            )
        assert max(g.abs().max().item() for g in grouped["grads"].values() if g.numel()) > 0
