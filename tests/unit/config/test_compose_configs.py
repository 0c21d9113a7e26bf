"""Every YAML in conf/ composes against the schema, converts to typed objects and validates."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from gspo_megatron.config.compose import CONF_DIR, compose
from gspo_megatron.config.store import register_configs
from gspo_megatron.config.validate import ConfigError, validate_config
from gspo_megatron.policy.parallel.layout import LayoutError

register_configs()
GROUPS = ["algorithm", "model", "parallel", "rollout", "task", "shaping"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((Path(CONF_DIR) / g).glob("*.yaml"))]
EXPERIMENTS = [p.stem for p in sorted((Path(CONF_DIR) / "experiment").glob("*.yaml"))]
# options that only make sense together with others (the rest of the defaults stays)
NEEDS = {
    ("rollout", "sglang"): ["rollout.sglang.model_path=/ckpt"],
    ("task", "jsonl"): ["task.dataset.path=/data/train.jsonl", "task.reward=exact_match"],
    ("task", "jsonl_math"): [  # a real run's task: its 4096 new tokens need a real model's context
        "task.dataset.path=/data/math.jsonl",
        "tokenizer.kind=hf",
        "tokenizer.path=/tok",
        "model=qwen3_30b_a3b",
    ],
    ("task", "reasoning_max_digit"): ["rollout.max_new_tokens=24"],
}


CLUSTER_LAYOUT_MODELS = {"tp4_ep8": "qwen3_30b_a3b", "tp4_pp4_cp2_ep16_etp1_last22": "qwen3_235b_a22b"}


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}"] + NEEDS.get((group, option), [])
    if group == "parallel" and option in CLUSTER_LAYOUT_MODELS:  # the model each cluster layout is for
        overrides.append(f"model={CLUSTER_LAYOUT_MODELS[option]}")
    cfg = compose(overrides)
    typed = OmegaConf.to_object(cfg)
    world = typed.parallel.tp * typed.parallel.pp * typed.parallel.cp * typed.parallel.ep
    validate_config(typed, world)


# cluster recipes: what their user adds (the tokenizer, the prompts, the engines' URLs) and their world size
RECIPE_NEEDS = {
    "qwen3_30b_a3b_8xh100": (["rollout.sglang.model_path=/ckpt", "model.hf_checkpoint=null"], 8),
    "qwen3_30b_a3b_agent_lookup_8xh100": (["rollout.sglang.model_path=/ckpt", "model.hf_checkpoint=null"], 8),
    "qwen3_5_35b_a3b_8xh100": (["rollout.sglang.model_path=/ckpt", "model.hf_checkpoint=null"], 8),
    "qwen3_235b_a22b_64xh100": (
        ["rollout.sglang.model_path=/ckpt", "model.hf_checkpoint=null", "rollout.sglang.urls=[http://e0:30000]"],
        64,
    ),
}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    needs, world = RECIPE_NEEDS.get(experiment, ([], None))
    typed = OmegaConf.to_object(compose([f"+experiment={experiment}", *needs]))
    p = typed.parallel
    validate_config(typed, world or p.tp * p.pp * p.cp * p.ep)


def test_unknown_key_fails_at_compose_time():
    with pytest.raises(ValueError, match="trainer.learning_rate is not a config key"):
        compose(["trainer.learning_rate=0.1"])


def test_wrong_type_fails_at_compose_time():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose(["trainer.steps=many"])


def test_invalid_layout_names_the_numbers():
    typed = OmegaConf.to_object(compose(["parallel.tp=3"]))
    with pytest.raises(LayoutError, match=r"tp\*pp\*cp = 3\*1\*1 = 3 does not divide the world size 4"):
        validate_config(typed, 4)


def test_mini_batches_must_split_over_data_parallel_ranks():
    typed = OmegaConf.to_object(
        compose(["trainer.prompts_per_step=3", "rollout.group_size=3", "trainer.updates_per_rollout=1"])
    )
    with pytest.raises(ConfigError, match="not divisible by the data-parallel size 2"):
        validate_config(typed, 2)


def test_gspo_rejects_token_sum_aggregation():
    with pytest.raises(ValueError, match="aggregation='token_mean'.*length bias"):
        OmegaConf.to_object(compose(["algorithm.loss.aggregation=token_mean"]))  # sections validate as they are built


def test_rollout_replay_with_sglang_needs_routed_experts():
    typed = OmegaConf.to_object(
        compose(
            [
                "algorithm=grpo_rollout_routing_replay",
                "rollout=sglang",
                "rollout.sglang.model_path=/ckpt",
                "rollout.sglang.enable_return_routed_experts=false",
            ]
        )
    )
    with pytest.raises(ConfigError, match="enable_return_routed_experts=true"):
        validate_config(typed, 1)


def test_unknown_group_option_lists_choices():
    with pytest.raises(ConfigCompositionException, match="gspo"):
        compose(["algorithm=gpso"])


def test_model_yamls_equal_the_code_presets():
    from dataclasses import fields

    from gspo_megatron.policy.models.config import MoEModelConfig, preset

    for name in ("tiny", "qwen3_30b_a3b"):
        model = OmegaConf.to_object(compose([f"model={name}"])).model
        for f in fields(MoEModelConfig):
            assert getattr(model, f.name) == getattr(preset(name), f.name), f"model/{name}.yaml: {f.name} drifted"


@pytest.mark.parametrize("world", [8, 16])
def test_the_readme_30b_layout_validates_on_whole_nodes(world):
    # docs/cluster.md: parallel=tp4_ep8 for Qwen3-30B-A3B on 8-GPU nodes; with etp = tp = 4 it needed
    # etp*ep*pp = 32 to divide the world size and was refused on 8 and 16 GPUs.
    typed = OmegaConf.to_object(compose(["model=qwen3_30b_a3b", "parallel=tp4_ep8"]))
    validate_config(typed, world)


@pytest.mark.parametrize(
    "name, mode", [("grpo_routing_replay", "old_policy"), ("grpo_rollout_routing_replay", "rollout")]
)
def test_replay_algorithms_are_grpo_plus_their_mode(name, mode):
    """The replay YAMLs inherit grpo.yaml (Hydra defaults) and set routing.replay beside the algorithm:
    a GRPO knob changed there reaches them."""
    grpo = compose(["algorithm=grpo"])
    replay = compose([f"algorithm={name}"])
    assert OmegaConf.to_container(replay.algorithm) == {**OmegaConf.to_container(grpo.algorithm), "name": name}
    assert (grpo.routing.replay, replay.routing.replay) == ("none", mode)
    text = (Path(CONF_DIR) / "algorithm" / f"{name}.yaml").read_text()
    assert "/algorithm/grpo@algorithm" in text and "clip_low" not in text  # written once, in grpo.yaml


def test_the_weight_bucket_is_sglangs_key_only():
    """The trainer streams weights tensor by tensor; only SGLang buckets them (one HTTP call each), so
    the embedded engine has no bucket key and SGLang's is validated."""
    sglang = OmegaConf.to_object(
        compose(["rollout=sglang", "rollout.sglang.model_path=/ckpt", "rollout.sglang.weight_bucket_bytes=2000"])
    )
    assert sglang.rollout.sglang.weight_bucket_bytes == 2000
    with pytest.raises(ValueError, match="weight_bucket_bytes must be >= 1"):
        OmegaConf.to_object(compose(["rollout=sglang", "rollout.sglang.weight_bucket_bytes=0"]))
    with pytest.raises(Exception, match="weight_bucket_bytes"):
        compose(["rollout.embedded.weight_bucket_bytes=1000"])
