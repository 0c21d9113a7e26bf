"""megatron's alltoall and allgather token dispatchers (``model.token_dispatcher``) give the same
forward and backward on ep2 and tp2_ep2: the policy loss with global denominators, its log-probs and
every gradient (gathered to HF names), with micro-batches of one row each or cut by a token budget
(``trainer.micro_batch_tokens``: widths differ between micro-batches and responses differ in length).

The two dispatchers compute the same expert outputs and only move them differently (alltoall sends
each routed token to its expert's rank; allgather gathers all tokens of the TP x EP group), so the
results agree up to fp32 summation order. On CPU the alltoall runs through
``policy/cpu_bridges.py`` bridge 8 and gloo's all-to-all.
"""

from __future__ import annotations

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import (
    EQUIVALENCE_LAYOUTS,
    assert_same_results,
    model_layout_worker,
    model_variants_worker,
    policy_inputs,
    random_hf_state,
    tiny_test_config,
)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def policy_setup():
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=3)
    (plain,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1))
    return cfg, state, {"loss": "gspo", **policy_inputs(plain["log_probs"][0])}


@pytest.mark.parametrize("budget", [None, 11], ids=["row_micro_batches", "token_budget"])
@pytest.mark.parametrize("name", ["ep2", "tp2_ep2"])
def test_alltoall_equals_allgather(policy_setup, name, budget):
    cfg, state, policy = policy_setup
    if budget is not None:
        policy = {**policy, "micro_batch_tokens": budget}
    layout = EQUIVALENCE_LAYOUTS[name]
    variants = [{"token_dispatcher": "allgather"}, {"token_dispatcher": "alltoall"}]
    per_rank = run_distributed(
        model_variants_worker, layout["world_size"], cfg, state, layout, variants, policy, timeout=600
    )
    allgather, alltoall = ([rank[i] for rank in per_rank] for i in range(2))
    assert any(r["log_probs"] for r in alltoall)
    for rank, (gathered, routed) in enumerate(zip(allgather, alltoall, strict=True)):
        assert_same_results(gathered, routed, rank, tol=1e-6)
    assert max(g.abs().max().item() for g in alltoall[0]["grads"].values()) > 0
