"""Over-sampling and partial rollouts (``rollout/agents/partial.py``) on the embedded engine: a step takes
the first complete groups; ``continue`` carries the others with their tokens, engine log-probs and the
version of each token into the next step, which continues them under the new weights; ``drop`` discards
them; a carried group older than ``max_staleness`` is dropped; the carried groups survive a checkpoint."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch

from gspo_megatron.contracts.samples import TOKEN_VERSIONS, FinishReason, Sample, SamplingParams
from gspo_megatron.rollout.agents.partial import PartialRollouts, stitch, token_versions
from gspo_megatron.rollout.config import EmbeddedConfig, PartialRollout
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.testing.model_fixtures import tiny_test_config

N, BUDGET = 2, 10


def _engine() -> EmbeddedEngine:
    torch.manual_seed(0)
    return EmbeddedEngine(tiny_test_config(vocab_size=40).to_hf_config(), EmbeddedConfig(max_batch_size=64))


class _Prompts:
    """Numbered prompts, one token id list each, as a task draws them."""

    def __init__(self):
        self.drawn = 0

    def __call__(self, count: int) -> list[PromptRecord]:
        start, self.drawn = self.drawn, self.drawn + count
        return [PromptRecord(f"p{i}", "a", {}, (1 + i % 30, 2, 3)) for i in range(start, start + count)]


def _short_first(engine: EmbeddedEngine):
    """generate_rows where the first fresh group's rows have budget 2: it completes first, the others stop."""

    def generate_rows(rows, params, needed):
        first = min(row.group for row in rows)
        short = [replace(row, max_new_tokens=2) if row.group == first else row for row in rows]
        return engine.generate_rows(short, params, needed)

    return generate_rows


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=BUDGET, n=N, seed=3)


def test_continue_carries_tokens_log_probs_and_versions_into_the_next_step():
    engine, prompts = _engine(), _Prompts()
    partial = PartialRollouts(over_sample=3.0, partial=PartialRollout("continue"), max_staleness=2)
    first = partial.draw(1, prompts, _short_first(engine), PARAMS, version=0)
    assert len(first.groups) == 1 and all(len(s.output_ids) == 2 for s in first.groups[0].samples)
    carried = {group.record.prompt: [s for s in group.samples] for group in partial.carried}
    assert len(carried) == 2 and first.metrics["rollout/partial/aborted_samples"] == 4.0
    assert all(s.finish_reason == FinishReason.ABORT and len(s.output_ids) == 2 for g in carried.values() for s in g)

    second = partial.draw(2, prompts, engine.generate_rows, PARAMS, version=1)
    continued = [g for g in second.groups if g.record.prompt in carried]
    assert len(continued) == 2  # carried groups first: the older, the sooner they train
    for group in continued:
        for before, after in zip(carried[group.record.prompt], group.samples, strict=True):
            assert after.output_ids[:2] == before.output_ids  # the earlier tokens kept ...
            torch.testing.assert_close(after.output_log_probs[:2], before.output_log_probs)  # ... with their log-probs
            assert token_versions(after) == [0, 0] + [1] * (len(after.output_ids) - 2)
            assert after.weight_version == 0 and after.finish_reason != FinishReason.ABORT
            assert len(after.output_ids) <= BUDGET and after.prompt_ids == list(group.record.prompt_ids)
    stale = second.metrics["rollout/partial/stale_tokens_age_1"]
    assert stale == 2 * 2 * N and second.metrics["rollout/partial/groups_carried_in"] == 2.0


def test_drop_discards_the_groups_not_needed():
    engine, prompts = _engine(), _Prompts()
    partial = PartialRollouts(over_sample=3.0, partial=PartialRollout("drop"), max_staleness=1)
    drawn = partial.draw(1, prompts, _short_first(engine), PARAMS, version=0)
    assert len(drawn.groups) == 1 and partial.carried == []
    assert drawn.metrics["rollout/partial/groups_dropped"] == 2.0 and prompts.drawn == 3


def test_a_carried_group_older_than_max_staleness_is_dropped():
    engine, prompts = _engine(), _Prompts()
    partial = PartialRollouts(over_sample=3.0, partial=PartialRollout("continue"), max_staleness=1)
    partial.draw(1, prompts, _short_first(engine), PARAMS, version=0)
    later = partial.draw(1, prompts, engine.generate_rows, PARAMS, version=2)  # two versions later
    assert later.metrics["rollout/partial/dropped_stale"] == 2.0
    assert later.metrics["rollout/partial/groups_carried_in"] == 0.0
    assert all(v == 2 for group in later.groups for s in group.samples for v in token_versions(s))


def test_carried_groups_survive_a_checkpoint():
    engine, prompts = _engine(), _Prompts()
    partial = PartialRollouts(over_sample=3.0, partial=PartialRollout("continue"), max_staleness=2)
    partial.draw(1, prompts, _short_first(engine), PARAMS, version=0)
    buffer = io.BytesIO()
    torch.save(partial.state_dict(), buffer)
    buffer.seek(0)
    restored = PartialRollouts(over_sample=3.0, partial=PartialRollout("continue"), max_staleness=2)
    restored.load_state_dict(torch.load(buffer, weights_only=True))  # what the checkpoint reader allows
    for a, b in zip(partial.carried, restored.carried, strict=True):
        assert a.record == b.record
        for x, y in zip(a.samples, b.samples, strict=True):
            assert (x.prompt_ids, x.output_ids, x.finish_reason) == (y.prompt_ids, y.output_ids, y.finish_reason)
            assert token_versions(x) == token_versions(y) and torch.equal(x.output_log_probs, y.output_log_probs)
    # the same next step from both
    again = [_Prompts(), _Prompts()]
    for source in again:
        source.drawn = prompts.drawn
    one = partial.draw(2, again[0], engine.generate_rows, PARAMS, version=1)
    two = restored.draw(2, again[1], engine.generate_rows, PARAMS, version=1)
    assert [[s.output_ids for s in g.samples] for g in one.groups] == [
        [s.output_ids for s in g.samples] for g in two.groups
    ]


def test_over_sample_below_one_is_refused():
    with pytest.raises(ValueError, match=r"rollout.over_sample=0.5 must be >= 1"):
        PartialRollouts(over_sample=0.5, partial=PartialRollout("drop"), max_staleness=1)


def test_a_continued_samples_log_probs_are_its_tokens_under_the_weights():
    """Weights unchanged between the two steps: every log-prob of a stitched sample -- the first part's and
    the continuation's -- equals the model's own log-prob of that token after the prompt and the tokens
    before it (a full forward), so the parts line up token by token."""
    engine, prompts = _engine(), _Prompts()
    partial = PartialRollouts(over_sample=3.0, partial=PartialRollout("continue"), max_staleness=2)
    partial.draw(1, prompts, _short_first(engine), PARAMS, version=0)
    carried = {group.record.prompt for group in partial.carried}
    second = partial.draw(2, prompts, engine.generate_rows, PARAMS, version=1)
    checked = 0
    for group in (g for g in second.groups if g.record.prompt in carried):
        for sample in group.samples:
            ids = torch.tensor([sample.prompt_ids + sample.output_ids])
            with torch.no_grad():
                logits = engine.model(input_ids=ids).logits[0].float()
            p = len(sample.prompt_ids)
            expected = torch.log_softmax(logits[p - 1 : -1], -1).gather(1, torch.tensor(sample.output_ids)[:, None])[
                :, 0
            ]
            torch.testing.assert_close(sample.output_log_probs, expected, atol=1e-5, rtol=1e-5)
            checked += len(sample.output_ids) > 2
    assert checked >= 2  # continuations that added tokens


@pytest.mark.parametrize(
    "changed, key", [({"n": 1}, "rollout.group_size=1"), ({"max_new_tokens": 1}, "rollout.max_new_tokens=1")]
)
def test_carried_groups_that_no_longer_fit_a_resumes_settings_are_dropped_not_trained(changed, key):
    # issue 63: after a resume with rollout.group_size 2 -> 1 (or max_new_tokens 10 -> 1) the carried groups
    # trained at their old shape -- two rows where the group size says one, two-token answers past a
    # one-token budget -- silently
    engine, prompts = _engine(), _Prompts()
    partial = PartialRollouts(over_sample=3.0, partial=PartialRollout("continue"), max_staleness=2)
    partial.draw(1, prompts, _short_first(engine), PARAMS, version=0)
    assert len(partial.carried) == 2 and all(len(s.output_ids) == 2 for g in partial.carried for s in g.samples)
    resumed = replace(PARAMS, **changed)
    with pytest.warns(RuntimeWarning, match=rf"2 carried group\(s\) have .*{key}.*dropped"):
        later = partial.draw(1, prompts, engine.generate_rows, resumed, version=1)
    assert later.metrics["rollout/partial/groups_carried_in"] == 0.0
    assert later.metrics["rollout/partial/groups_dropped"] >= 2.0
    for group in later.groups:
        assert len(group.samples) == resumed.n
        assert all(len(s.output_ids) <= resumed.max_new_tokens for s in group.samples)


def test_stitching_keeps_the_versions_of_a_continuation_that_spans_an_in_flight_update():
    """An engine call that took an in-flight update (``EmbeddedEngine.request_update``) lists each token's version;
    the stitched sample keeps them after the earlier tokens' own."""
    earlier = Sample([1, 2], [5, 6], torch.tensor([-0.5, -0.6]), FinishReason.ABORT, weight_version=0)
    new = Sample(
        [1, 2, 5, 6],
        [7, 8, 9],
        torch.tensor([-0.7, -0.8, -0.9]),
        FinishReason.LENGTH,
        weight_version=1,
        extra={TOKEN_VERSIONS: [1, 2, 2]},
    )
    stitched = stitch(earlier, [1, 2], new, version=1)
    assert token_versions(stitched) == [0, 0, 1, 2, 2]
    assert stitched.weight_version == 0
