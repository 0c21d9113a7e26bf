"""The policy-loss head through the whole model: every layout gives one rank's loss and gradients.

Old log-probs sit within 1e-4 of the current ones (well inside GSPO's 3e-4 clip), advantages are
random and responses have a different length per row; micro-batch splits differ between layouts
(2 rows per micro-batch on one rank, 1 under data parallelism), and denominators are global.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import (
    EQUIVALENCE_LAYOUTS,
    model_layout_worker,
    policy_inputs,
    random_hf_state,
    tiny_test_config,
)

pytestmark = pytest.mark.distributed


def _one_rank(loss: str, regularized: bool = False):
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=3)
    (plain,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1))
    policy = {"loss": loss, **policy_inputs(plain["log_probs"][0])}
    if regularized:  # entropy bonus + reference KL; the reference sits ~0.3 nats away per token
        generator = torch.Generator().manual_seed(9)
        noise = 0.3 * torch.randn(plain["log_probs"][0].shape, generator=generator)
        policy.update(entropy_coef=0.05, kl_coef=0.5, kl_estimator="k3", ref_log_probs=plain["log_probs"][0] + noise)
    (single,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1), policy)
    return cfg, state, policy, single


def _verl_grpo_one_rank():
    """verl_grpo's knobs (eps 0.2/0.2, dual clip 3, token_mean, low_var_kl at 0.001 ... raised to 0.5 so the
    KL gradient shows) with old log-probs 1.5 nats below on a third of the tokens, so dual clip and
    low-clip are active, and a reference up to 6 nats either way, so low_var_kl's bound of 10 is active
    (k3 > 10 for d < -2.61)."""
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=3)
    (plain,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1))
    log_probs = plain["log_probs"][0]
    policy = {"loss": "grpo", **policy_inputs(log_probs)}
    generator = torch.Generator().manual_seed(13)
    shift = torch.randint(-1, 2, log_probs.shape, generator=generator).float() * 1.5  # -1.5, 0 or +1.5 nats
    policy["old_log_probs"] = policy["old_log_probs"] - shift
    policy["ref_log_probs"] = log_probs + 12.0 * torch.rand(log_probs.shape, generator=generator) - 6.0
    policy["kl_coef"], policy["kl_estimator"] = 0.5, "low_var_kl"
    policy["algorithm"] = dict(clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0, aggregation="token_mean")
    valid = policy["response_mask"] > 0
    assert (valid & (policy["advantages"] < 0).unsqueeze(-1) & (shift > 0)).any()  # ratio e^1.5 > 3, A < 0
    assert (valid & (log_probs - policy["ref_log_probs"] < -2.61)).any()  # low_var_kl at its bound
    (single,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1), policy)
    return cfg, state, policy, single


def _opsm_one_rank():
    """slime's off-policy sequence masking (opsm_delta 1e-3) with old log-probs 0.01 nats above the policy's on
    every other row: the drifted rows with a negative advantage leave the policy term (the loss differs from
    the unmasked one); under CP each row's drift is summed over both halves of the sequence."""
    cfg = tiny_test_config()
    state = random_hf_state(cfg, seed=3)
    (plain,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1))
    log_probs = plain["log_probs"][0]
    policy = {"loss": "grpo", **policy_inputs(log_probs)}
    drifted = (torch.arange(log_probs.shape[0]) % 2 == 1).float().unsqueeze(-1)
    policy["old_log_probs"] = policy["old_log_probs"] + 0.01 * drifted
    assert ((drifted.squeeze(-1) > 0) & (policy["advantages"] < 0)).any()
    unmasked = dict(policy)
    policy["algorithm"] = dict(opsm_delta=1e-3)
    (single,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1), policy)
    (without,) = run_distributed(model_layout_worker, 1, cfg, state, dict(world_size=1), unmasked)
    assert not torch.allclose(single["loss"], without["loss"])
    return cfg, state, policy, single


@pytest.fixture(scope="module")
def opsm_reference():
    return _opsm_one_rank()


@pytest.mark.parametrize("name", ["tp2", "pp2", "ep2", "dp2", "cp2"])
def test_off_policy_sequence_masking_matches_one_rank(opsm_reference, name):
    _check_layout(opsm_reference, name)


@pytest.fixture(scope="module")
def verl_grpo_reference():
    return _verl_grpo_one_rank()


@pytest.fixture(scope="module", params=["gspo", "grpo"])
def reference(request):
    return _one_rank(request.param)


@pytest.fixture(scope="module")
def regularized_reference():
    return _one_rank("gspo", regularized=True)


@pytest.mark.parametrize("name", list(EQUIVALENCE_LAYOUTS))
def test_policy_loss_and_gradients_match_one_rank(reference, name):
    _check_layout(reference, name)


@pytest.mark.parametrize("name", ["tp2", "pp2", "ep2", "dp2"])
def test_entropy_and_kl_terms_match_one_rank(regularized_reference, name):
    """Entropy bonus (its gradient through the vocab-parallel entropy) and reference KL, per layout."""
    # the entropy gradient reaches every vocabulary entry; fp32 summation order differs per layout
    _check_layout(regularized_reference, name, grad_atol=1e-6)


@pytest.mark.parametrize("name", ["tp2", "pp2", "ep2", "dp2"])
def test_verl_grpo_knobs_match_one_rank(verl_grpo_reference, name):
    """Dual clip, token-mean aggregation and the bounded low_var_kl (an anchor preset's loss) per layout."""
    _check_layout(verl_grpo_reference, name, grad_atol=1e-6)


def _check_layout(reference, name, grad_atol=1e-6):
    """``grad_atol`` 1e-6 (as the regularized and verl cases): a layout sums a gradient's fp32 partial sums
    in another order; an embedding row near zero differed by 1.25e-7 under tp2_cp2 on an AMD EPYC, over
    the 1e-7 this had been (a layout bug is orders of magnitude larger)."""
    cfg, state, policy, single = reference
    world = EQUIVALENCE_LAYOUTS[name]["world_size"]
    results = run_distributed(model_layout_worker, world, cfg, state, EQUIVALENCE_LAYOUTS[name], policy, timeout=600)
    # loss contributions of the last-stage ranks of all data-parallel slices add up to the whole loss
    total = {}
    for result in results:
        for dp_rank in result["log_probs"]:
            total[dp_rank] = result["loss"]
    torch.testing.assert_close(sum(total.values()), single["loss"], rtol=1e-5, atol=1e-7)
    assert single["loss"].abs() > 0
    for result in results:
        for key, grad in single["grads"].items():
            torch.testing.assert_close(
                result["grads"][key], grad, rtol=1e-4, atol=grad_atol, msg=lambda m, key=key: f"{key}: {m}"
            )


@pytest.mark.parametrize("name", ["pp2", "ep2"])
def test_token_budget_micro_batches_match_one_rank(reference, name):
    """trainer.micro_batch_tokens: rows sorted by length, each micro-batch cut to its own longest row
    (widths differ inside one schedule call: pipeline stages exchange shapes); EP's all-gathers span
    the two data-parallel ranks. Same loss and gradients as one rank padded to the whole batch."""
    cfg, state, policy, single = reference
    world = EQUIVALENCE_LAYOUTS[name]["world_size"]
    budgeted = {**policy, "micro_batch_tokens": 11}
    results = run_distributed(model_layout_worker, world, cfg, state, EQUIVALENCE_LAYOUTS[name], budgeted, timeout=600)
    total = {}
    for result in results:
        for dp_rank in result["log_probs"]:
            total[dp_rank] = result["loss"]
    torch.testing.assert_close(sum(total.values()), single["loss"], rtol=1e-5, atol=1e-7)
    for result in results:
        for key, grad in single["grads"].items():
            torch.testing.assert_close(
                result["grads"][key], grad, rtol=1e-4, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}"
            )
