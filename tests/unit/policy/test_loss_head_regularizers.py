"""PolicyLossHead with the entropy bonus and reference KL against a plain log_softmax computation."""

import pytest
import torch

from gspo_megatron.algorithms.config import AlgorithmConfig, KLConfig
from gspo_megatron.algorithms.losses import LossConfig, LossContext, get_policy_loss
from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.loss_heads import PolicyLossHead


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(3, 5, 11, generator=g)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32)
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    batch = MicroBatch(
        tokens=targets,  # the head reads only the targets
        targets=targets,
        response_mask=mask,
        advantages=torch.randn(3, generator=g),
        old_log_probs=logp + 0.05 * torch.randn(3, 5, generator=g),
        ref_log_probs=logp + 0.3 * torch.randn(3, 5, generator=g),
    )
    return logits, batch


@pytest.mark.parametrize("loss, estimator", [("gspo", "k3"), ("grpo", "k1"), ("grpo", "k2")])
def test_loss_and_grad_equal_policy_loss_minus_entropy_plus_kl(loss, estimator):
    logits, batch = _inputs()
    mask = batch.response_mask
    settings = LossConfig(name=loss, clip_low=0.2, clip_high=0.28, entropy_coef=0.03)
    algorithm = AlgorithmConfig(loss=settings, kl=KLConfig(coef=0.2, estimator=estimator))
    head = PolicyLossHead(
        algorithm, None, None, 1.0, global_num_sequences=torch.tensor(3.0), global_num_tokens=mask.sum()
    )
    leaf = logits.clone().requires_grad_()
    got, metrics = head(leaf, batch)
    got.backward()

    ref_leaf = logits.clone().double().requires_grad_()
    log_softmax = torch.log_softmax(ref_leaf, -1)
    logp = log_softmax.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    d = logp - batch.ref_log_probs.double()
    kl = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) - 1 + d}[estimator]
    ctx = LossContext(settings)
    policy = get_policy_loss(loss)(logp, batch.old_log_probs.double(), batch.advantages.double(), mask, ctx).loss
    seq_mean = lambda x: ((x * mask).sum(1) / mask.sum(1)).mean()  # seq_mean_token_mean
    expected = policy - 0.03 * seq_mean(entropy) + 0.2 * seq_mean(kl)
    expected.backward()
    torch.testing.assert_close(got.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=1e-4, atol=1e-6)
    assert {"loss/entropy_term/sum", "loss/kl_term/sum", "loss/kl_ref/sum"} <= set(metrics)


def test_zero_coefficients_add_nothing_and_need_no_reference():
    logits, batch = _inputs()
    batch.ref_log_probs = None
    mask = batch.response_mask
    head = PolicyLossHead(
        AlgorithmConfig(), None, None, 1.0, global_num_sequences=torch.tensor(3.0), global_num_tokens=mask.sum()
    )
    loss, metrics = head(logits.clone().requires_grad_(), batch)
    assert not any("kl" in k and "ref" in k or "term" in k for k in metrics)
    assert torch.isfinite(loss)
