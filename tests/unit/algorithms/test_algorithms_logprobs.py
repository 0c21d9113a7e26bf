"""vocab_parallel_log_probs on one rank against torch.log_softmax (values, grads, entropy)."""

import pytest
import torch

from gspo_megatron.algorithms import vocab_parallel_log_probs


def _reference(logits, targets, temperature):
    """float64 log_softmax gather; invalid targets (outside [0, V)) give 0."""
    log_softmax = torch.log_softmax(logits.double() / temperature, dim=-1)
    valid = (targets >= 0) & (targets < logits.shape[-1])
    picked = log_softmax.gather(-1, targets.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return torch.where(valid, picked, 0.0), entropy


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
def test_values_entropy_and_grads_match_log_softmax(temperature, chunk_size):
    logits = (3 * torch.randn(3, 5, 17)).requires_grad_()
    targets = torch.randint(0, 17, (3, 5))
    weights = torch.randn(3, 5)

    log_probs, entropy = vocab_parallel_log_probs(
        logits, targets, temperature=temperature, chunk_size=chunk_size, with_entropy=True
    )
    (log_probs * weights).sum().backward()

    ref_logits = logits.detach().double().requires_grad_()
    ref, ref_entropy = _reference(ref_logits, targets, temperature)
    (ref * weights).sum().backward()
    assert log_probs.dtype == torch.float32 and log_probs.shape == (3, 5)
    torch.testing.assert_close(log_probs.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-6, rtol=1e-5)


def test_hand_computed_two_token_vocab():
    # logits [0, ln 3] -> p = [1/4, 3/4]; at T = 2: z = [0, ln 3 / 2], p = [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]], requires_grad=True)
    log_probs, _ = vocab_parallel_log_probs(logits, torch.tensor([1]))
    torch.testing.assert_close(log_probs, torch.log(torch.tensor([0.75])))
    log_probs.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.25, 0.25]]))  # onehot - p
    logits.grad = None
    log_probs, _ = vocab_parallel_log_probs(logits, torch.tensor([0]), temperature=2.0)
    log_probs.sum().backward()
    p0 = 1 / (1 + 3**0.5)
    torch.testing.assert_close(log_probs, torch.log(torch.tensor([p0])))
    torch.testing.assert_close(logits.grad, torch.tensor([[(1 - p0) / 2, -(1 - p0) / 2]]))  # (onehot - p) / T


def test_bf16_logits_get_fp32_math_and_bf16_grads():
    logits32 = 4 * torch.randn(6, 33)
    logits = logits32.bfloat16().requires_grad_()
    targets = torch.randint(0, 33, (6,))
    log_probs, _ = vocab_parallel_log_probs(logits, targets, chunk_size=4)
    log_probs.sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref, _ = _reference(ref_logits, targets, 1.0)
    ref.sum().backward()
    assert log_probs.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(log_probs.double(), ref, atol=1e-5, rtol=1e-5)  # exact on the bf16 values
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=8e-3, rtol=1e-2)


def test_invalid_targets_give_zero_log_prob_and_zero_grad():
    logits = torch.randn(4, 7, requires_grad=True)
    targets = torch.tensor([3, -100, 7, 0])
    log_probs, _ = vocab_parallel_log_probs(logits, targets)
    log_probs.sum().backward()
    assert log_probs[1] == 0 and log_probs[2] == 0 and log_probs[0] < 0
    assert torch.all(logits.grad[1] == 0) and torch.all(logits.grad[2] == 0)
    assert torch.all(logits.grad[0] != 0)


def test_inputs_untouched_entropy_detached_and_none_when_not_asked():
    logits = torch.randn(5, 9, requires_grad=True)
    before = logits.detach().clone()
    log_probs, entropy = vocab_parallel_log_probs(logits, torch.randint(0, 9, (5,)), with_entropy=True)
    log_probs.sum().backward()
    assert torch.equal(logits.detach(), before)
    assert entropy.requires_grad is False
    assert vocab_parallel_log_probs(logits, torch.zeros(5, dtype=torch.long))[1] is None


def test_shape_and_argument_errors_name_the_problem():
    with pytest.raises(ValueError, match="targets.shape \\+ \\(V_local,\\)"):
        vocab_parallel_log_probs(torch.randn(2, 3, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_log_probs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_log_probs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), chunk_size=0)


def test_peaked_large_logits_keep_entropy_and_log_probs_precise():
    # Logits around 30 +- 30: fp32 rounding at the scale of lse (~1e-5) would swamp entropies of ~1e-2
    # with the textbook lse - E_p[z] form; working relative to the max keeps errors ~1e-7.
    logits = 10 * torch.randn(500, 64) + 30
    targets = logits.argmax(-1)  # confident tokens: log p ~ -1e-3, where rounding shows most
    log_probs, entropy = vocab_parallel_log_probs(logits, targets, with_entropy=True)
    ref, ref_entropy = _reference(logits, targets, 1.0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-6, rtol=0)
    torch.testing.assert_close(log_probs.double(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_gradient_matches_autograd_of_log_softmax(temperature, chunk_size, dtype):
    logits = (3 * torch.randn(3, 5, 17)).to(dtype).requires_grad_()
    targets = torch.randint(0, 17, (3, 5))
    targets[0, 0] = -100  # the entropy of a padded position still has a gradient; its log-prob has none
    w_logp, w_ent = torch.randn(3, 5), torch.randn(3, 5)
    log_probs, entropy = vocab_parallel_log_probs(
        logits, targets, temperature=temperature, chunk_size=chunk_size, with_entropy=True, entropy_grad=True
    )
    assert entropy.requires_grad
    ((log_probs * w_logp).sum() + (entropy * w_ent).sum()).backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref, ref_entropy = _reference(ref_logits, targets, temperature)
    ((ref * w_logp).sum() + (ref_entropy * w_ent).sum()).backward()
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, **tol)


def test_entropy_gradient_hand_computed_two_token_vocab():
    # p = [1/4, 3/4], H = -(1/4 ln 1/4 + 3/4 ln 3/4); dH/dz_j = -p_j (ln p_j + H)
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]], requires_grad=True)
    _, entropy = vocab_parallel_log_probs(logits, torch.tensor([1]), with_entropy=True, entropy_grad=True)
    entropy.sum().backward()
    h = -(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75)))
    torch.testing.assert_close(entropy, h.reshape(1))
    expected = torch.tensor(
        [[-0.25 * (torch.log(torch.tensor(0.25)) + h), -0.75 * (torch.log(torch.tensor(0.75)) + h)]]
    )
    torch.testing.assert_close(logits.grad, expected)
    with pytest.raises(ValueError, match="entropy_grad=True needs with_entropy=True"):
        vocab_parallel_log_probs(logits, torch.tensor([1]), entropy_grad=True)
