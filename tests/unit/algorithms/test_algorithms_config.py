"""AlgorithmConfig: YAMLs match the dataclass and validate; validation errors name field and fix."""

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.algorithms import AlgorithmConfig, make_loss_context
from gspo_megatron.algorithms.config import RECOMMENDED_CLIP

CONF = Path(__file__).resolve().parents[3] / "gspo_megatron" / "conf" / "algorithm"


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_yaml_composes_onto_the_schema_and_validates(name):
    path = CONF / f"{name}.yaml"
    assert path.read_text().startswith("# ") and "python -m gspo_megatron.train algorithm=" in path.read_text()
    raw = OmegaConf.load(path)
    assert set(raw.keys()) == {f.name for f in dataclasses.fields(AlgorithmConfig)}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), raw))
    cfg.validate()
    assert cfg.loss == name
    assert (cfg.clip_low, cfg.clip_high) == RECOMMENDED_CLIP[name]


def test_defaults_are_gspo_paper_values():
    cfg = AlgorithmConfig()
    cfg.validate()
    assert (cfg.loss, cfg.clip_low, cfg.clip_high, cfg.aggregation) == ("gspo", 3e-4, 4e-4, "seq_mean_token_mean")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"loss": "ppo"}, r"algorithm.loss='ppo' is not a policy loss; valid: grpo, gspo, gspo_token"),
        ({"advantage_estimator": "gae"}, r"valid: group_relative"),
        ({"aggregation": "mean"}, r"valid: seq_mean_token_mean"),
        ({"aggregation": "token_mean"}, r"length bias; set algorithm.aggregation=seq_mean_token_mean"),
        ({"log_ratio_clamp": 0.0}, r"algorithm.log_ratio_clamp must be > 0"),
        ({"loss": "grpo", "clip_low": 1.2}, r"clip_low must be in \[0, 1\)"),
        ({"clip_high": -0.1}, r"clip_high must be >= 0"),
        ({"logprob_chunk_size": 0}, r"logprob_chunk_size"),
        ({"old_log_probs": "engine"}, r"algorithm.old_log_probs='engine' is unknown; valid: trainer, rollout"),
        (
            {"old_log_probs": "rollout", "routing_replay": "old_policy"},
            r"skips the trainer's old-policy forward.*use routing_replay=rollout",
        ),
        (
            {"old_log_probs": "rollout", "mismatch_correction": "sequence_mask"},
            r"exactly 1 when algorithm.old_log_probs=rollout",
        ),
    ],
)
def test_validation_errors(change, message):
    with pytest.raises(ValueError, match=message):
        (dataclasses.replace(AlgorithmConfig(), **change)).validate()


def test_grpo_allows_token_mean_and_loss_context_carries_config():
    cfg = AlgorithmConfig(loss="grpo", clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    cfg.validate()
    ctx = make_loss_context(cfg, global_num_sequences=8, global_num_tokens=100)
    assert (ctx.clip_low, ctx.clip_high, ctx.aggregation, ctx.global_num_tokens) == (0.2, 0.28, "token_mean", 100)


@pytest.mark.parametrize("replay", ["none", "rollout"])
def test_engine_old_log_probs_allowed_without_old_policy_replay(replay):
    (
        AlgorithmConfig(loss="grpo", clip_low=0.2, clip_high=0.28, routing_replay=replay, old_log_probs="rollout")
    ).validate()
