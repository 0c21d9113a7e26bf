"""Resume refuses a config that differs in keys that change what is trained, naming each key."""

from __future__ import annotations

import pytest

from gspo_megatron.config.resume_check import ResumeConfigError, check_resume_config, config_differences

SAVED = """
run_dir: /a
model: {hidden_size: 64, num_experts: 4, token_dispatcher: alltoall, expert_mlp: grouped}
algorithm: {name: gspo, clip_low: 0.0003}
optimizer: {lr: 0.001}
trainer: {steps: 10, stop_after_steps: 5, micro_batch_size: 4}
parallel: {tp: 1}
checkpoint: {resume: 'false'}
"""


def test_differences_are_listed_by_dotted_key():
    new = SAVED.replace("lr: 0.001", "lr: 0.1")
    assert config_differences(SAVED, new) == {"optimizer.lr": (0.001, 0.1)}


def test_free_keys_pass():
    new = SAVED.replace("/a", "/b").replace("tp: 1", "tp: 2").replace("stop_after_steps: 5", "stop_after_steps: 9")
    new = new.replace("alltoall", "allgather").replace("expert_mlp: grouped", "expert_mlp: sequential")
    accepted = check_resume_config(SAVED, new.replace("resume: 'false'", "resume: 'true'"), [], "ckpt")
    assert len(accepted) == 6


def test_algorithm_and_lr_changes_are_refused_with_every_key():
    new = SAVED.replace("name: gspo", "name: grpo").replace("lr: 0.001", "lr: 0.1")
    with pytest.raises(ResumeConfigError) as error:
        check_resume_config(SAVED, new, [], "ckpt")
    message = str(error.value)
    assert "algorithm.name: 'gspo' -> 'grpo'" in message and "optimizer.lr: 0.001 -> 0.1" in message
    assert "2 key(s)" in message and "resume_allow_changes" in message


def test_allow_list_accepts_named_keys_and_sections():
    new = SAVED.replace("steps: 10", "steps: 20").replace("lr: 0.001", "lr: 0.1")
    with pytest.raises(ResumeConfigError, match="optimizer.lr"):
        check_resume_config(SAVED, new, ["trainer.steps"], "ckpt")
    assert len(check_resume_config(SAVED, new, ["trainer.steps", "optimizer."], "ckpt")) == 2


def test_model_shape_can_never_change():
    new = SAVED.replace("num_experts: 4", "num_experts: 8")
    with pytest.raises(ResumeConfigError, match="(?s)model.num_experts.*shape cannot change"):
        check_resume_config(SAVED, new, [], "ckpt")
    with pytest.raises(ResumeConfigError, match="shape cannot change"):
        check_resume_config(SAVED, new, ["model.num_experts"], "ckpt")


def test_keys_of_another_code_version_are_accepted():
    new = SAVED.replace("micro_batch_size: 4}", "micro_batch_size: 4, on_nonfinite: skip}")
    assert check_resume_config(SAVED, new, [], "ckpt") == ["trainer.on_nonfinite: <absent> -> 'skip'"]
