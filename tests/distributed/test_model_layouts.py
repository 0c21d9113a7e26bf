"""The tiny MoE under TP=2, PP=2, EP=2 and TP=2xEP=2 (sequence parallel) equals one rank.

Every layout is built from the same HF-named weights; log-probs of a fixed batch and the gradients
of a fixed loss (gathered back to HF names) must match the single-rank run within fp32 tolerance,
and the HF -> Megatron -> HF round trip must be bit-exact. PP runs through megatron's 1F1B schedule.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import (
    EQUIVALENCE_LAYOUTS,
    model_layout_worker,
    random_hf_state,
    tiny_test_config,
)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=3)
    (single,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1), timeout=300)
    return cfg, state, single


@pytest.mark.parametrize("name", list(EQUIVALENCE_LAYOUTS))
def test_layout_matches_single_rank(reference, name):
    cfg, state, single = reference
    results = run_distributed(
        model_layout_worker, EQUIVALENCE_LAYOUTS[name]["world_size"], cfg, state, EQUIVALENCE_LAYOUTS[name], timeout=600
    )
    # Round trip: every rank exports exactly the weights it was given.
    for result in results:
        assert result["exported"].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(result["exported"][key], value), f"round trip changed {key}"
    # Log-probs: the last-stage ranks of each data-parallel slice together hold the whole batch.
    pieces = {}
    for result in results:
        for dp_rank, logp in result["log_probs"].items():
            pieces[dp_rank] = logp
    log_probs = torch.cat([pieces[r] for r in sorted(pieces)], dim=0)
    torch.testing.assert_close(log_probs, single["log_probs"][0], rtol=1e-5, atol=1e-5)
    # Gradients, gathered to HF names, on every rank.
    for result in results:
        assert torch.isfinite(result["loss"]).all()
        for key, grad in single["grads"].items():
            torch.testing.assert_close(
                result["grads"][key], grad, rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
            )
    # The loss actually moves the weights: gradients are not all zero.
    assert max(g.abs().max().item() for g in single["grads"].values()) > 0
