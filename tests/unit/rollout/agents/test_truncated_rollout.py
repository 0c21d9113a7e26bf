"""Dynamic Truncated Rollout over a scripted test engine (controlled confidence) and the real
embedded engine (log-probs of kept tokens vs a full forward)."""

import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from gspo_megatron.contracts.samples import FinishReason, Sample, SamplingParams, Truncation
from gspo_megatron.rollout.agents.truncated import TruncatedRolloutEngine, probe_confidence
from gspo_megatron.rollout.config import EmbeddedConfig, TruncatedRolloutConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.engine import RolloutEngine

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 <>/|=?!.,:{}\\\n*"
EOS = len(CHARS)  # one id past the characters


def encode(text):
    return [CHARS.index(c) for c in text]


def decode(ids):
    return "".join(CHARS[i] if i < len(CHARS) else "" for i in ids)


class ScriptedEngine(RolloutEngine):
    """TEST DOUBLE for a real engine: follows the generate() protocol (stop strings / ids kept in the
    output, max_new_tokens, finish reasons) over a scripted "model":
    - thinking continues the prompt's plan text from where the response so far left off, token j of
      the plan having log-prob -0.01 * (j + 1);
    - a context ending with the probe suffix (DEER's, ending at "\\boxed") is a probe: "{42}</think>"
      whose first token "{" has log-prob -7 (left out by probe_skip_tokens=1) and every other log c,
      c = confidences[key][probe number] (1-based); plans in ``open_probes`` never close thinking
      in the probe ("{42}}}}..." up to the probe budget);
    - once the response contains "</think>", it answers "ANS" then EOS.
    """

    def __init__(self, plans, confidences, probe_suffix, open_probes=()):
        self.plans, self.confidences, self.probe_suffix = plans, confidences, encode(probe_suffix)
        self.open_probes = set(open_probes)
        self.calls = []

    def update_weights(self, named_tensors, version):
        self.weight_version = version

    def _continuation(self, prompt, context):
        plan_key = prompt[0]
        response = decode(context[len(prompt) :])
        if context[-len(self.probe_suffix) :] == self.probe_suffix:
            c = self.confidences[plan_key][response.count("Wait") + 1]  # the pending trigger is cut
            text = "{42" + "}" * 30 if plan_key in self.open_probes else "{42}</think>"
            return encode(text), [-7.0] + [math.log(c)] * (len(text) - 1)
        if "</think>" in response:
            return encode("ANS") + [EOS], [-0.5, -0.5, -0.5, -0.5]
        plan = self.plans[plan_key]
        assert plan.startswith(response), f"context left the plan: {response!r}"
        start = len(response)
        return encode(plan[start:]), [-0.01 * (j + 1) for j in range(start, len(plan))]

    def generate(self, prompts, params):
        self.calls.append((prompts, params))
        result = []
        for prompt in prompts:
            group = []
            for _ in range(params.n):
                original = prompt[:2]  # test prompts are [plan key, "?"]
                ids, lps = self._continuation(original, prompt)
                out, out_lps, finish = [], [], FinishReason.LENGTH
                for token, lp in zip(ids, lps, strict=True):
                    out.append(token)
                    out_lps.append(lp)
                    if token in params.stop_token_ids or any(s in decode(out) for s in params.stop):
                        finish = FinishReason.STOP
                        break
                    if len(out) == params.max_new_tokens:
                        break
                group.append(
                    Sample(
                        prompt_ids=prompt,
                        output_ids=out,
                        weight_version=self.weight_version,
                        output_log_probs=torch.tensor(out_lps),
                        finish_reason=finish,
                    )
                )
            result.append(group)
        return result


TRIGGERS = ["Wait"]  # shaping.trigger_words
CONFIG = TruncatedRolloutConfig(
    probe_suffix="\n\\boxed",
    close_thinking="\n</think>\n",
    probe_max_tokens=20,
    confidence_threshold=0.95,
    max_probes=10,
    think_ratio=1.0,
    eos_token_ids=[EOS],
)
PLAN = "ab Wait cd Wait ef Wait gh</think>"


def run(plans, confidences, config=CONFIG, max_new_tokens=200, n=1, open_probes=()):
    engine = ScriptedEngine(plans, confidences, config.probe_suffix, open_probes)
    truncated = TruncatedRolloutEngine(engine, config, TRIGGERS, encode, decode)
    prompts = [[key, CHARS.index("?")] for key in plans]
    return truncated.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, n=n)), engine


def plan_log_probs(text):
    return torch.tensor([-0.01 * (j + 1) for j in range(len(text))])


def with_config(**changes):
    return TruncatedRolloutConfig(**{**CONFIG.__dict__, **changes})


def test_probe_confidence_is_geometric_mean_after_the_skipped_tokens():
    assert probe_confidence(torch.tensor([-9.0, math.log(0.9), math.log(0.4)])) == pytest.approx(0.6)
    assert probe_confidence(torch.tensor([math.log(0.3)])) == pytest.approx(0.3)
    assert probe_confidence(torch.tensor([math.log(0.5), math.log(0.5)]), skip=0) == pytest.approx(0.5)


def test_probe_suffix_and_first_token_rule_must_agree():
    """A suffix ending in "{" makes the first probe token an answer token: skipping it is refused."""
    with pytest.raises(ValueError, match="probe_skip_tokens"):
        TruncatedRolloutConfig(probe_suffix="\\boxed{", probe_skip_tokens=1)
    assert TruncatedRolloutConfig(probe_suffix="\\boxed{", probe_skip_tokens=0).probe_skip_tokens == 0
    assert TruncatedRolloutConfig().probe_suffix.endswith("\\boxed")  # DEER's: the "{" is what is skipped


def test_confident_exit_on_second_probe_drops_probe_and_trigger():
    [[sample]], engine = run({0: PLAN}, {0: {1: 0.5, 2: 0.99, 3: 0.99}})
    assert sample.truncation.exit_reason == "confident" and sample.truncation.num_probes == 2
    assert sample.truncation.probe_confidences == pytest.approx([0.5, 0.99])
    text = decode(sample.output_ids)
    # first trigger restored (probe 1 not confident), second trigger dropped, thinking closed, answer
    assert text == "ab Wait cd \n</think>\nANS" and sample.output_ids[-1] == EOS
    assert "42}" not in text and "boxed" not in text  # probe tokens and suffix never kept
    forced = sample.truncation.forced_mask
    assert forced.tolist() == [False] * 11 + [True] * 10 + [False] * 4
    torch.testing.assert_close(sample.output_log_probs[:11], plan_log_probs("ab Wait cd "))
    assert (sample.output_log_probs[forced] == 0).all()
    assert sample.finish_reason == FinishReason.STOP
    probe_calls = [params for _, params in engine.calls if params.temperature == 0]
    assert len(probe_calls) == 2 and all(p.max_new_tokens == 20 for p in probe_calls)
    assert all(p.stop == ("</think>",) for p in probe_calls)  # the probe stops when it closes thinking


def test_never_confident_stops_probing_at_max_probes():
    config = with_config(max_probes=2)
    [[sample]], _ = run({0: PLAN}, {0: {1: 0.9, 2: 0.2, 3: 0.99}}, config)
    assert sample.truncation.exit_reason == "max_probes" and sample.truncation.num_probes == 2
    assert decode(sample.output_ids) == PLAN + "ANS"  # third Wait not probed: triggers off after 2
    torch.testing.assert_close(sample.output_log_probs[: len(PLAN)], plan_log_probs(PLAN))
    assert not sample.truncation.forced_mask.any()


def test_natural_end_without_triggers_and_batching_of_mixed_samples():
    plans = {0: "abc</think>", 1: PLAN, 2: "xy Wait z</think>"}
    confidences = {0: {}, 1: {1: 0.1, 2: 0.1, 3: 0.97}, 2: {1: 0.3}}
    result, _ = run(plans, confidences, n=2)
    for group, (reason, probes, text) in zip(
        result,
        [
            ("natural_end", 0, "abc</think>ANS"),
            ("confident", 3, "ab Wait cd Wait ef \n</think>\nANS"),
            ("natural_end", 1, "xy Wait z</think>ANS"),
        ],
        strict=True,
    ):
        assert len(group) == 2
        for sample in group:
            assert (sample.truncation.exit_reason, sample.truncation.num_probes, decode(sample.output_ids)) == (
                reason,
                probes,
                text,
            )


def test_length_exit_counts_the_whole_output_budget():
    [[sample]], _ = run({0: PLAN}, {0: {1: 0.1, 2: 0.1}}, max_new_tokens=12)
    assert sample.truncation.exit_reason == "length" and sample.finish_reason == FinishReason.LENGTH
    assert decode(sample.output_ids) == PLAN[:12] and sample.truncation.num_probes == 1


def test_strict_qwen3_rule_a_probe_that_does_not_close_thinking_has_confidence_zero():
    plans, confidences = {0: PLAN, 1: PLAN}, {0: {1: 0.99}, 1: {1: 0.99, 2: 0.99, 3: 0.99}}
    loose, _ = run(plans, confidences, open_probes={1})
    assert [g[0].truncation.exit_reason for g in loose] == ["confident", "confident"]
    strict, _ = run(plans, confidences, with_config(probe_require_end_think=True), open_probes={1})
    assert strict[0][0].truncation.exit_reason == "confident"  # its probe closed thinking
    open_sample = strict[1][0]
    assert open_sample.truncation.probe_confidences[0] == 0.0
    assert open_sample.truncation.exit_reason != "confident"


def test_forced_answer_at_the_thinking_budget():
    """think_ratio 0.5 of 30 tokens: thinking stops at 15 tokens, is closed (forced) and answered."""
    [[sample]], _ = run({0: PLAN}, {0: {1: 0.1, 2: 0.1, 3: 0.1}}, with_config(think_ratio=0.5), max_new_tokens=30)
    assert sample.truncation.exit_reason == "think_budget" and sample.finish_reason == FinishReason.STOP
    assert decode(sample.output_ids) == PLAN[:15] + "\n</think>\nANS" and sample.output_ids[-1] == EOS
    assert sample.truncation.forced_mask.tolist() == [False] * 15 + [True] * 10 + [False] * 4
    # without the forced answer (think_ratio 1) the same budget ends mid-thinking with no answer
    [[plain]], _ = run({0: PLAN}, {0: {1: 0.1, 2: 0.1, 3: 0.1}}, max_new_tokens=30)
    assert plain.truncation.exit_reason == "length" and "ANS" not in decode(plain.output_ids)


def test_repetition_exit_after_chunks_with_the_same_words():
    plan = "ab Wait ab Wait ab Wait ab Wait cd</think>"
    [[sample]], _ = run({0: plan}, {0: {k: 0.1 for k in range(1, 6)}}, with_config(repetition_exit=2))
    assert sample.truncation.exit_reason == "repetition" and sample.truncation.num_probes == 2
    assert decode(sample.output_ids) == "ab Wait ab Wait ab \n</think>\nANS"
    [[off]], _ = run({0: plan}, {0: {k: 0.1 for k in range(1, 6)}})
    assert off.truncation.exit_reason == "natural_end" and off.truncation.num_probes == 4


def test_trigger_text_inside_a_word_is_not_a_trigger_in_rollout_or_step_counting():
    """One matching rule: "Await" stops the engine (stop strings are substrings) but is no trigger."""
    from gspo_megatron.rollout.shaping.segmentation import count_trigger_words

    plan = "ab Await cd Wait ef</think>"
    [[sample]], _ = run({0: plan}, {0: {1: 0.1}})
    assert decode(sample.output_ids) == plan + "ANS" and sample.truncation.exit_reason == "natural_end"
    assert sample.truncation.num_probes == 1 == count_trigger_words(plan, TRIGGERS)


def test_over_the_embedded_engine_kept_log_probs_match_a_full_forward():
    """Real model: whatever the exits, kept sampled tokens carry log_softmax(logits / T) of the final
    sequence and routed experts equal the full forward's router top-k."""
    hf_config = dict(
        vocab_size=len(CHARS) + 1,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(4)
    source = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config)).eval()
    with torch.no_grad():  # large random weights: peaked next-token distributions
        for name, parameter in source.named_parameters():
            parameter.uniform_(0.5, 1.5) if name.endswith("norm.weight") else parameter.normal_(0.0, 0.35)
    engine = EmbeddedEngine(Qwen3MoeConfig(**hf_config), EmbeddedConfig(), decode)
    engine.update_weights(source.state_dict().items(), version=3)
    config = TruncatedRolloutConfig(
        trigger_token_ids=list(range(0, 60, 3)),
        end_think="",
        end_think_token_ids=[CHARS.index("|")],
        probe_suffix="=",
        close_thinking="|",
        probe_max_tokens=4,
        confidence_threshold=0.3,
        max_probes=3,
        eos_token_ids=[EOS],
    )
    truncated = TruncatedRolloutEngine(engine, config, [], encode, decode)  # token-id triggers only
    prompts = [encode("abc"), encode("hello")]
    params = SamplingParams(temperature=0.8, max_new_tokens=24, n=3, seed=11, return_routed_experts=True)
    reasons, probe_counts = set(), []
    for prompt, group in zip(prompts, truncated.generate(prompts, params), strict=True):
        for sample in group:
            reasons.add(sample.truncation.exit_reason)
            probe_counts.append(sample.truncation.num_probes)
            assert sample.truncation.num_probes <= 3 and sample.weight_version == 3
            ids = torch.tensor([prompt + sample.output_ids])
            with torch.no_grad():
                out = source(input_ids=ids, output_router_logits=True)
            full = torch.log_softmax(out.logits[0].float() / 0.8, -1)[len(prompt) - 1 : -1]
            expected = full.gather(-1, torch.tensor(sample.output_ids)[:, None]).squeeze(-1)
            sampled = ~sample.truncation.forced_mask
            torch.testing.assert_close(sample.output_log_probs[sampled], expected[sampled], atol=1e-5, rtol=1e-5)
            for layer, logits in enumerate(out.router_logits):
                top = torch.softmax(logits.float(), -1).topk(2, dim=-1).indices[:-1]
                assert torch.equal(sample.routed_experts[:, layer].long(), top)
    # fixed seeds: both the confident exit (forced closing token) and a restored trigger occur
    assert "confident" in reasons and max(probe_counts) >= 2


def test_a_forced_mask_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match=r"truncation.forced_mask has shape \(2,\), expected \(3,\)"):
        Sample(
            prompt_ids=[1],
            output_ids=[2, 3, 4],
            output_log_probs=torch.zeros(3),
            finish_reason=FinishReason.STOP,
            truncation=Truncation("confident", 1, [0.9], torch.tensor([False, True])),
        )
