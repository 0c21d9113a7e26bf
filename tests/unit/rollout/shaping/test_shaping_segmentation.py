import pytest
import torch

from gspo_megatron.rollout.shaping.segmentation import (
    cluster_counts,
    confidence_boundaries,
    confidence_segment_lengths,
    count_trigger_words,
    keyword_segment_counts,
    keyword_segment_lengths,
    keyword_segment_spans,
    step_counts,
)

TRIGGERS = ["Wait", "Alternatively"]


def test_standalone_triggers_only():
    # "Waiting", "Await", "Wait_" and "Waits" are not standalone; punctuation and markdown are boundaries.
    text = "Waiting room. Await it. Waits. Wait_x. Wait, no. (Wait) **Wait** Wait-and-see Wait."
    assert count_trigger_words(text, TRIGGERS) == 5


def test_case_rules():
    text = "but wait, WAIT. Wait: alternatively Alternatively"
    assert count_trigger_words(text, TRIGGERS) == 2  # case-sensitive by default
    assert count_trigger_words(text, TRIGGERS, case_sensitive=False) == 5


def test_multi_word_trigger_counts_once_and_allows_any_whitespace():
    triggers = ["wait", "But wait"]
    assert count_trigger_words("But wait, x. But\n  wait. Then wait.", triggers) == 3
    # "But wait" is matched first at its position, so its inner "wait" is not counted again.
    assert count_trigger_words("But wait", triggers) == 1


def test_step_counts_are_one_plus_triggers_including_empty_response():
    texts = ["", "Answer 4", "Wait. Alternatively, Wait!", "Waiting... waiting"]
    assert step_counts(texts, TRIGGERS).tolist() == [1, 1, 4, 1]


def test_empty_trigger_list_is_rejected():
    with pytest.raises(ValueError, match="trigger words"):
        count_trigger_words("Wait", [])
    with pytest.raises(ValueError, match="trigger words"):
        count_trigger_words("Wait", ["Wait", "  "])


def test_keyword_spans_cut_at_trigger_starts_and_drop_blank_pieces():
    text = "Wait, no. So x. Wait again"
    assert keyword_segment_spans(text, TRIGGERS) == [(0, 16), (16, 26)]
    assert keyword_segment_spans("  Wait a", TRIGGERS) == [(2, 8)]  # blank prefix dropped
    assert keyword_segment_spans("", TRIGGERS) == []
    assert keyword_segment_spans("no triggers", TRIGGERS) == [(0, 11)]


def test_keyword_segment_lengths_are_token_estimates():
    # 8 + 8 characters, 32 tokens -> 16 and 16 tokens.
    text = "x" * 7 + " " + "Wait " + "y" * 3
    assert keyword_segment_lengths(text, 32, TRIGGERS).tolist() == [16.0, 16.0]
    # 26 characters, 13 tokens: 16 chars -> 8 tokens, 10 chars -> 5 tokens.
    assert keyword_segment_lengths("Wait, no. So x. Wait again", 13, TRIGGERS).tolist() == [8.0, 5.0]
    assert keyword_segment_lengths("", 0, TRIGGERS).numel() == 0


def test_confidence_boundaries_are_thresholded_local_minima():
    log_probs = torch.tensor([-0.1, -2.0, -0.1, -0.2, -3.0, -3.0, -0.1, -0.5])
    # 1: -2.0 below both neighbours; 4: first of the -3.0 plateau; 5: not strictly below 4.
    assert confidence_boundaries(log_probs, window=1, threshold=-1.0).tolist() == [1, 4]
    assert confidence_segment_lengths(log_probs, window=1, threshold=-1.0).tolist() == [1.0, 3.0, 4.0]
    # A stricter threshold keeps only the -3.0 minimum.
    assert confidence_segment_lengths(log_probs, window=1, threshold=-2.5).tolist() == [4.0, 4.0]
    # A wide window: -2.0 at 1 is no longer a minimum of [0, 4]; only 4 remains.
    assert confidence_boundaries(log_probs, window=3, threshold=-1.0).tolist() == [4]


def test_confidence_first_token_and_empty_response():
    assert confidence_segment_lengths(torch.tensor([-5.0, -0.1, -0.1]), 1, -1.0).tolist() == [3.0]
    assert confidence_segment_lengths(torch.zeros(0), 1, -1.0).numel() == 0
    with pytest.raises(ValueError, match="window"):
        confidence_boundaries(torch.zeros(3), window=0, threshold=-1.0)


def test_cluster_counts_use_half_open_buckets():
    lengths = [torch.tensor([1.0, 2.0, 3.0, 5.0]), torch.zeros(0), torch.tensor([10.0])]
    counts = cluster_counts(lengths, [2.0, 5.0])
    # [0,2): 1 | [2,5): 2, 3 | [5,inf): 5
    assert counts.tolist() == [[1.0, 2.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    assert cluster_counts([], [2.0, 5.0]).shape == (0, 3)
    assert cluster_counts([torch.zeros(0), torch.zeros(0)], [2.0]).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_keyword_segment_counts_equal_the_per_text_counts_bit_for_bit():
    """The group's counts in one pass equal ``cluster_counts`` of each text's ``keyword_segment_lengths``,
    on texts whose lengths fall on the cluster edges and on random ones (the same float32 arithmetic)."""
    edges = [2.0, 5.0, 8.0]
    texts = ["x" * 7 + " " + "Wait " + "y" * 3, "Wait, no. So x. Wait again", "", "  Wait a", "no triggers", "Wait"]
    tokens = [32, 13, 0, 4, 5, 1]
    generator = torch.Generator().manual_seed(0)
    words = ["Wait", "so", "x", "But", "maybe", "Alternatively", "1", "+"]
    for _ in range(200):
        picks = torch.randint(0, len(words), (int(torch.randint(0, 12, (), generator=generator)),), generator=generator)
        texts.append(" ".join(words[i] for i in picks.tolist()))
        tokens.append(int(torch.randint(0, 40, (), generator=generator)))

    counts = keyword_segment_counts(texts, tokens, TRIGGERS, edges)
    assert counts.dtype == torch.float32 and counts.shape == (len(texts), 4)
    per_text = [keyword_segment_lengths(t, n, TRIGGERS) for t, n in zip(texts, tokens, strict=True)]
    assert torch.equal(counts, cluster_counts(per_text, edges))
    # 16 + 16 tokens; 8 + 5; none; 6 chars of 8 at 4 tokens: 3; 11 chars at 5 tokens: 5; "Wait" at 1 token: 1
    assert counts[:6].tolist() == [
        [0.0, 0.0, 0.0, 2.0],
        [0.0, 0.0, 1.0, 1.0],
        [0.0, 0.0, 0.0, 0.0],
        [0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 1.0, 0.0],
        [1.0, 0.0, 0.0, 0.0],
    ]
    assert keyword_segment_counts([], [], TRIGGERS, edges).shape == (0, 4)
