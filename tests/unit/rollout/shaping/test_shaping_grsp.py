import pytest
import torch

from gspo_megatron.rollout.shaping import GRSPConfig, ShapingGroup
from gspo_megatron.rollout.shaping.grsp import grsp, grsp_penalty, masked_group_zscore
from gspo_megatron.rollout.shaping.segmentation import step_counts

TRIGGERS = ["Wait", "Alternatively"]  # shaping.trigger_words


# Counts per length cluster (short, long) for three responses: 2 short | 1 long | 1 short + 1 long.
COUNTS = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
# short: mean 1, std sqrt(2/3) -> z = [1.22474487, -1.22474487, 0]
# long:  mean 2/3, std sqrt(2/9) -> z = [-1.41421356, 0.70710678, 0.70710678]
Z = torch.tensor([[1.22474487, -1.41421356], [-1.22474487, 0.70710678], [0.0, 0.70710678]])

# Log-probs whose confidence segments (window 1, threshold -1, edge 3) give COUNTS:
LOG_PROBS = [
    torch.tensor([-0.1, -0.1, -2.0, -0.1]),  # boundary at 2 -> [2, 2]: two short
    torch.tensor([-0.1, -0.1, -0.1]),  # no boundary -> [3]: one long
    torch.tensor([-0.1, -2.0, -0.1, -0.1, -0.1]),  # boundary at 1 -> [1, 4]
]


def make_group(correct, rewards=None, log_probs=LOG_PROBS, texts=None):
    size = len(correct)
    return ShapingGroup(
        rewards=torch.tensor(rewards if rewards is not None else [1.0] * size),
        correct=torch.tensor(correct),
        format_ok=torch.ones(size, dtype=torch.bool),
        response_texts=texts or [""] * size,
        steps=step_counts(texts or [""] * size, TRIGGERS),
        response_lengths=torch.tensor([lp.numel() for lp in log_probs]),
        max_response_length=8,
        token_log_probs=log_probs,
    )


def confidence_cfg(**overrides):
    base = dict(segmentation="confidence", confidence_window=1, confidence_threshold=-1.0, bucket_edges=[3.0])
    return GRSPConfig(**{**base, **overrides})


def test_zscore_by_hand_and_zero_std():
    torch.testing.assert_close(masked_group_zscore(COUNTS, torch.ones(3, dtype=torch.bool)), Z)
    same = torch.tensor([[1.0, 2.0], [1.0, 3.0]])
    z = masked_group_zscore(same, torch.ones(2, dtype=torch.bool))
    torch.testing.assert_close(z, torch.tensor([[0.0, -1.0], [0.0, 1.0]]))  # zero std column -> 0


def test_penalty_by_hand():
    penalty = grsp_penalty(COUNTS, torch.ones(3, dtype=torch.bool), torch.tensor([0.75, 0.25]))
    # P = 0.75 z_short + 0.25 z_long
    torch.testing.assert_close(penalty, torch.tensor([0.56500526, -0.74178196, 0.17677670]))


def test_end_to_end_with_confidence_segments():
    out = grsp(make_group([True, True, True]), confidence_cfg(cluster_weights=[0.75, 0.25], penalty_coef=0.2))
    assert out.metrics["segments_per_cluster"].tolist() == COUNTS.tolist()
    # shaped = 1 - 0.2 P
    torch.testing.assert_close(out.rewards, torch.tensor([0.88699895, 1.14835639, 0.96464466]))
    assert out.rewards.mean().item() == pytest.approx(1.0)  # z-scores sum to 0: mean preserved


def test_descending_vs_ascending_flip_the_ordering():
    group = make_group([True, True, True])
    descending = grsp(group, confidence_cfg(weight_order="descending"))  # w = [2/3, 1/3]
    ascending = grsp(group, confidence_cfg(weight_order="ascending"))  # w = [1/3, 2/3]
    # Response 0 (many short segments) is penalised under descending weights, favoured under ascending.
    # P0 desc = 2/3*1.2247 - 1/3*1.4142 = 0.34509; asc = 1/3*1.2247 - 2/3*1.4142 = -0.53456
    torch.testing.assert_close(descending.metrics["penalty"][0], torch.tensor(0.34509), atol=1e-5, rtol=0)
    torch.testing.assert_close(ascending.metrics["penalty"][0], torch.tensor(-0.53456), atol=1e-5, rtol=0)
    assert descending.rewards[0] < descending.rewards[1]
    assert ascending.rewards[0] > ascending.rewards[1]


def test_apply_to_correct_ignores_incorrect_responses():
    log_probs = LOG_PROBS + [torch.tensor([-0.1, -2.0, -0.1, -2.0, -0.1, -2.0])]  # [1, 2, 2, 1]: 4 short
    group = make_group([True, True, True, False], rewards=[1.0, 1.0, 1.0, 0.0], log_probs=log_probs)
    cfg = confidence_cfg(cluster_weights=[0.75, 0.25], penalty_coef=0.2)
    out = grsp(group, cfg)
    # Correct responses are scored among themselves exactly as before; the incorrect one is untouched.
    torch.testing.assert_close(out.rewards, torch.tensor([0.88699895, 1.14835639, 0.96464466, 0.0]))
    everyone = grsp(group, confidence_cfg(cluster_weights=[0.75, 0.25], penalty_coef=0.2, apply_to="all"))
    # With all four scored: short counts [2,0,1,4] mean 1.75 std sqrt(2.1875) -> z3 = 2.25/1.47902 = 1.52128;
    # long counts [0,1,1,0] mean 0.5 std 0.5 -> z3 = -1; P3 = 0.75*1.52128 - 0.25 = 0.89096
    torch.testing.assert_close(everyone.rewards[3], torch.tensor(-0.2 * 0.89096), atol=1e-5, rtol=0)


def test_single_correct_response_is_not_changed():
    out = grsp(make_group([True, False, False], rewards=[1.0, 0.0, 0.0]), confidence_cfg())
    torch.testing.assert_close(out.rewards, torch.tensor([1.0, 0.0, 0.0]))


def test_keyword_segmentation_path():
    # 16 tokens each: "xxxxxxx " + "Wait yyy" -> segments of 8 and 8 tokens (short with edge 10);
    # a response without keywords is one 16-token segment (long).
    texts = ["x" * 7 + " Wait " + "y" * 3, "z" * 16]
    group = ShapingGroup(
        rewards=torch.ones(2),
        correct=torch.ones(2, dtype=torch.bool),
        format_ok=torch.ones(2, dtype=torch.bool),
        response_texts=texts,
        steps=step_counts(texts, TRIGGERS),
        response_lengths=torch.tensor([16, 16]),
        max_response_length=16,
    )
    out = grsp(group, GRSPConfig(bucket_edges=[10.0], keywords=["Wait"], penalty_coef=1.0))
    assert out.metrics["segments_per_cluster"].tolist() == [[2.0, 0.0], [0.0, 1.0]]
    # z = [[1, -1], [-1, 1]], w = [2/3, 1/3] -> P = [1/3, -1/3]
    torch.testing.assert_close(out.rewards, torch.tensor([2 / 3, 4 / 3]))


def test_confidence_segmentation_needs_log_probs():
    group = make_group([True, True, True])
    no_log_probs = ShapingGroup(**{**group.__dict__, "token_log_probs": None})
    with pytest.raises(ValueError, match="token_log_probs"):
        grsp(no_log_probs, confidence_cfg())


def test_weight_config_validation():
    assert GRSPConfig(bucket_edges=[64.0, 256.0]).resolved_weights() == pytest.approx([0.5, 1 / 3, 1 / 6])
    assert GRSPConfig(weight_order="ascending").resolved_weights() == pytest.approx([1 / 6, 1 / 3, 0.5])
    with pytest.raises(ValueError, match="not descending"):
        GRSPConfig(bucket_edges=[3.0], cluster_weights=[0.25, 0.75])
    with pytest.raises(ValueError, match="3 clusters"):
        GRSPConfig(cluster_weights=[0.5, 0.5])
    with pytest.raises(ValueError, match="strictly increasing"):
        GRSPConfig(bucket_edges=[10.0, 5.0])
    with pytest.raises(ValueError, match="segmentation"):
        GRSPConfig(segmentation="sentences")
    with pytest.raises(ValueError, match="apply_to"):
        GRSPConfig(apply_to="incorrect")


def test_all_wrong_group_is_left_unchanged_by_default_and_scored_with_apply_to_all():
    """apply_to=correct: no correct response, no penalty (an incorrect response earns no bonus)."""
    group = make_group([False, False, False], rewards=[0.0, 0.0, 0.0])
    out = grsp(group, confidence_cfg())
    torch.testing.assert_close(out.rewards, torch.zeros(3))
    torch.testing.assert_close(out.metrics["penalty"], torch.zeros(3))
    torch.testing.assert_close(out.metrics["segments_per_cluster"], COUNTS)  # still measured
    scored_all = grsp(group, confidence_cfg(apply_to="all"))
    weights = torch.tensor(GRSPConfig(bucket_edges=[3.0]).resolved_weights())
    torch.testing.assert_close(scored_all.rewards, -0.1 * (Z @ weights))


def test_truncated_responses_are_segmented_up_to_where_they_stop():
    """A response cut by the length limit (no stop token, no final answer) is segmented like any
    other: its last segment simply ends at the cut. Keyword segments: token shares of the text."""
    texts = ["aaaa Wait bb Wait cc", "aaaa Wait bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"]  # second: truncated
    group = ShapingGroup(
        rewards=torch.tensor([1.0, 0.0]),
        correct=torch.tensor([True, False]),
        format_ok=torch.tensor([True, False]),
        response_texts=texts,
        steps=step_counts(texts, TRIGGERS),
        response_lengths=torch.tensor([len(texts[0]), len(texts[1])]),
        max_response_length=len(texts[1]),
    )
    cfg = GRSPConfig(keywords=["Wait"], bucket_edges=[6.0, 20.0], apply_to="all")
    out = grsp(group, cfg)
    # one char = one token: [5, 8, 7] -> clusters (1, 2, 0); [5, 41] -> (1, 0, 1)
    torch.testing.assert_close(out.metrics["segments_per_cluster"], torch.tensor([[1.0, 2.0, 0.0], [1.0, 0.0, 1.0]]))
    # z over two responses: cluster 0 std 0 -> 0; clusters 1, 2: +-1; weights (1/2, 1/3, 1/6)
    torch.testing.assert_close(out.metrics["penalty"], torch.tensor([1 / 3 - 1 / 6, -1 / 3 + 1 / 6]))
