"""Resume refuses a config that differs in keys that change what is trained, naming each key."""

from __future__ import annotations

import time

import pytest

from gspo_megatron.config.resume_check import ResumeConfigError, check_resume_config, config_differences

SAVED = """
run_dir: /a
model: {hidden_size: 64, num_experts: 4, token_dispatcher: alltoall, expert_mlp: grouped}
algorithm: {name: gspo, loss: {clip_low: 0.0003}}
optimizer: {lr: 0.001, precision_aware: false}
trainer: {steps: 10, stop_after_steps: 5, micro_batch_size: 4, reference_offload: false}
parallel: {tp: 1}
checkpoint: {resume: 'false'}
"""
NEW = "optimizer: {lr: 0.001}\n"


def test_differences_are_listed_by_dotted_key():
    new = SAVED.replace("lr: 0.001", "lr: 0.1")
    assert config_differences(SAVED, new) == {"optimizer.lr": (0.001, 0.1)}


def test_free_keys_pass():
    new = SAVED.replace("/a", "/b").replace("tp: 1", "tp: 2").replace("stop_after_steps: 5", "stop_after_steps: 9")
    new = new.replace("alltoall", "allgather").replace("expert_mlp: grouped", "expert_mlp: sequential")
    new = new.replace("reference_offload: false", "reference_offload: true")  # the same log-probs
    accepted = check_resume_config(SAVED, new.replace("resume: 'false'", "resume: 'true'"), [], "ckpt")
    assert len(accepted) == 7


def test_the_precision_aware_optimizer_is_refused_by_name():
    """Its checkpoint holds no fp32 main shards in the distributed optimizer's state: a change is named."""
    with pytest.raises(ResumeConfigError, match=r"optimizer.precision_aware: False -> True"):
        check_resume_config(SAVED, SAVED.replace("precision_aware: false", "precision_aware: true"), [], "ckpt")


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
    new = SAVED.replace("reference_offload: false}", "reference_offload: false, on_nonfinite: skip}")
    assert check_resume_config(SAVED, new, [], "ckpt") == ["trainer.on_nonfinite: <absent> -> 'skip'"]


# --- issue 43, N3/N4: the saved config is read as plain data, expanding nothing ----------------------


def _bomb(levels: int) -> str:
    """The "billion laughs": each anchor a list of nine aliases of the one before (9^levels leaves)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\noptimizer: {{lr: 0.001}}\nbomb: *a{levels}\n"


def test_an_alias_bomb_is_refused_without_expanding_it():
    start = time.monotonic()
    with pytest.raises(ResumeConfigError, match="uses YAML anchors or aliases, which this trainer never writes"):
        check_resume_config(_bomb(9), NEW, [], "ckpt/step_000002")  # 9^9 leaves if expanded
    assert time.monotonic() - start < 1.0


def test_interpolations_stay_strings_and_no_environment_value_is_printed(monkeypatch):
    monkeypatch.setenv("GSPO_TEST_SECRET_TOKEN", "hunter2-secret")
    saved = "optimizer:\n  lr: ${oc.env:GSPO_TEST_SECRET_TOKEN}\n"
    with pytest.raises(ResumeConfigError) as refused:
        check_resume_config(saved, NEW, [], "ckpt/step_000002")
    message = str(refused.value)
    assert "hunter2" not in message
    assert "optimizer.lr: '${oc.env:GSPO_TEST_SECRET_TOKEN}' -> 0.001" in message


@pytest.mark.parametrize("saved", ["optimizer:\n  lr: ${nope}\n", "optimizer:\n  lr: ${optimizer.lr}\n"])
def test_broken_or_recursive_interpolations_are_compared_as_text(saved):
    with pytest.raises(ResumeConfigError, match="refusing to resume ckpt/step_000002"):
        check_resume_config(saved, NEW, [], "ckpt/step_000002")


@pytest.mark.parametrize(
    "saved, match",
    [
        ("[1, 2]", "the saved config is a list, not a mapping"),
        ("a: [" * 40 + "]" * 40, "nests deeper than 32 levels"),
        ("a: {b: [1, 2", "is not valid YAML"),
        ("x" * (2 << 20), "too large or not text"),
        ("!!python/object/apply:os.system ['true']", "is not valid YAML"),
    ],
    ids=["list", "deep", "broken", "huge", "python_tag"],
)
def test_a_saved_config_that_is_not_plain_data_is_named(saved, match):
    with pytest.raises(ResumeConfigError, match=match) as refused:
        check_resume_config(saved, NEW, [], "ckpt/step_000002")
    assert "ckpt/step_000002" in str(refused.value)


def test_a_long_value_is_shown_shortened():
    saved = "optimizer:\n  lr: '" + "z" * 5000 + "'\n"
    with pytest.raises(ResumeConfigError) as refused:
        check_resume_config(saved, NEW, [], "ckpt/step_000002")
    assert "... (5002 characters)" in str(refused.value) and "z" * 300 not in str(refused.value)


# What code before the nested algorithm config (issue 47 item 3) wrote: the flat keys
FLAT = SAVED.replace(
    "algorithm: {name: gspo, loss: {clip_low: 0.0003}}",
    "algorithm: {name: gspo, clip_low: 0.0003, routing_replay: none}",
)


def test_a_config_written_before_a_rename_compares_under_the_new_names():
    nested = SAVED.replace("parallel: {tp: 1}", "parallel: {tp: 1}\nrouting: {replay: none}")
    assert config_differences(FLAT, nested) == {}
    with pytest.raises(ResumeConfigError, match=r"algorithm.loss.clip_low: 0.0003 -> 0.2"):
        check_resume_config(FLAT, nested.replace("clip_low: 0.0003", "clip_low: 0.2"), [], "ckpt")


def test_routing_replay_is_not_a_free_key_though_the_diagnostics_are():
    with_replay = SAVED.replace("parallel: {tp: 1}", "parallel: {tp: 1}\nrouting: {replay: none, kinds: [update]}")
    kinds = with_replay.replace("kinds: [update]", "kinds: [minibatch]")
    assert check_resume_config(with_replay, kinds, [], "ckpt") == ["routing.kinds: ['update'] -> ['minibatch']"]
    with pytest.raises(ResumeConfigError, match=r"routing.replay: 'none' -> 'old_policy'"):
        check_resume_config(with_replay, with_replay.replace("replay: none", "replay: old_policy"), [], "ckpt")
