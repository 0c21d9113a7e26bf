"""The torch gated delta rule (``policy/models/gated_delta_rule.py``): the chunked form equals the token-by-token
recurrence in float64 on random inputs, for chunk sizes that do and do not divide the length, with and without
an initial state, and equals transformers' and megatron-core's own torch implementations of the same rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gspo_megatron.policy.models.gated_delta_rule import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule


def random_inputs(batch=2, length=11, heads=3, key_dim=4, value_dim=5, dtype=torch.float64, seed=0):
    """q, k, v as [b, t, h, d]; decay g = -exp(A) softplus(a) <= 0 and beta = sigmoid(b), as the layer makes them."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    q, k = randn(batch, length, heads, key_dim), randn(batch, length, heads, key_dim)
    v = randn(batch, length, heads, value_dim)
    g = -randn(heads).exp() * F.softplus(randn(batch, length, heads))
    beta = randn(batch, length, heads).sigmoid()
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [1, 4, 11, 16])  # 4 and 16 do not divide 11; 1 and 11 do
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunked_rule_equals_the_recurrence_in_float64(chunk_size, with_initial_state):
    q, k, v, g, beta = random_inputs()
    state = torch.randn(2, 3, 4, 5, dtype=torch.float64) if with_initial_state else None
    expected, expected_state = recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, final = chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        chunk_size=chunk_size,
    )
    assert out.dtype == torch.float64 and out.shape == v.shape
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, expected_state, rtol=1e-12, atol=1e-12)


def as_one_head(x):
    return x.reshape(1, 2, 1, -1)


def test_the_recurrence_is_the_rule_written_out():
    """One head, two tokens, by hand: S_1 = b1 k1 v1^T; S_2 = e^g2 (I - b2 k2 k2^T) S_1 + b2 k2 v2^T;
    o_t = S_t^T q_t / sqrt(K)."""
    k1, k2 = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.6, 0.8], dtype=torch.float64)
    v1, v2 = torch.tensor([2.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    q = torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    b1, b2, g2 = 0.5, 0.25, -0.7
    s1 = b1 * torch.outer(k1, v1)
    s2 = torch.exp(torch.tensor(g2)) * (torch.eye(2, dtype=torch.float64) - b2 * torch.outer(k2, k2)) @ s1
    s2 = s2 + b2 * torch.outer(k2, v2)
    expected = torch.stack([s1.T @ q[0], s2.T @ q[1]]) / 2**0.5
    out, final = recurrent_gated_delta_rule(
        as_one_head(q),
        as_one_head(torch.stack([k1, k2])),
        as_one_head(torch.stack([v1, v2])),
        torch.tensor([[[0.0], [g2]]], dtype=torch.float64),
        torch.tensor([[[b1], [b2]]], dtype=torch.float64),
        output_final_state=True,
    )
    torch.testing.assert_close(out.reshape(2, 1), expected)
    torch.testing.assert_close(final.reshape(2, 1), s2)


def test_strong_decay_over_a_long_chunk_stays_finite():
    q, k, v, g, beta = random_inputs(length=70, dtype=torch.float32)
    out, _ = chunk_gated_delta_rule(q, k, v, g * 50, beta, use_qk_l2norm_in_kernel=True)
    expected, _ = recurrent_gated_delta_rule(q, k, v, g * 50, beta, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_float32_inputs_give_float32_outputs_and_an_fp32_state_with_gradients():
    q, k, v, g, beta = (x.float().requires_grad_() for x in random_inputs())
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=4)
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    out.square().sum().backward()
    q64, k64, v64, g64, b64 = (x.detach().double().requires_grad_() for x in (q, k, v, g, beta))
    recurrent_gated_delta_rule(q64, k64, v64, g64, b64)[0].square().sum().backward()
    for ours, reference in zip((q, k, v, g, beta), (q64, k64, v64, g64, b64), strict=True):
        torch.testing.assert_close(ours.grad, reference.grad.float(), rtol=1e-4, atol=1e-5)


def test_packed_sequences_and_mismatched_heads_are_refused_by_name():
    q, k, v, g, beta = random_inputs()
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 11]))
    with pytest.raises(ValueError, match=r"repeat the key heads"):
        chunk_gated_delta_rule(q[:, :, :1], k[:, :, :1], v, g, beta)


def test_l2norm_is_fla_s():
    x = torch.randn(3, 7, dtype=torch.float64)
    torch.testing.assert_close(l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))


def test_equals_transformers_torch_rules():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = (x.float() for x in random_inputs(length=70))  # two of transformers' 64-token chunks
    state = torch.randn(2, 3, 4, 5)
    ours, our_state = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    for theirs in (modeling.torch_chunk_gated_delta_rule, modeling.torch_recurrent_gated_delta_rule):
        out, final = theirs(
            q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(ours, out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(our_state, final, rtol=1e-4, atol=1e-5)


def test_equals_megatron_cores_deterministic_torch_rule():
    """megatron-core's GatedDeltaNet runs its own torch rule under ``deterministic_mode`` (FLA's otherwise)."""
    gated_delta_net = pytest.importorskip("megatron.core.ssm.gated_delta_net")
    q, k, v, g, beta = (x.float() for x in random_inputs(length=70))
    q, k = l2norm(q), l2norm(k)  # megatron normalises before either call (use_qk_l2norm_in_kernel=False)
    theirs, _ = gated_delta_net.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    ours, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
