"""Every model family trains end to end (``python -m gspo_megatron.train model=<family>_tiny``): the
embedded engine serves transformers' class of the family, weights synced from the trainer each step.
With R3 (``routing.replay=rollout``) the trainer replays the engine's routed experts, so the
engine-vs-trainer routing differs in no token; and the engine's log-probs equal the trainer's (the
mismatch metrics are float noise). The hybrids train 20 steps with R3 at four decoded tokens (the engine's
rows leave its gated DeltaNet states as they finish), and a run stopped halfway resumes exactly; under R2 every
routing diagnostic runs on their MoE layers; where megatron-core has context parallelism for them (0.19), a cp2 run
trains as one rank does."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.testing.train_runs import SHORT, checkpoint_tensors, read_metrics, run_training, without_time

pytestmark = [pytest.mark.e2e]


FAMILY_MODELS = ["mixtral_tiny", "olmoe_tiny", "qwen2_moe_tiny", "glm4_moe_tiny", "deepseek_v3_tiny"]
HYBRID_MODELS = ["qwen3_next_tiny", "qwen3_5_moe_tiny"]  # gated DeltaNet + gated full attention


@pytest.mark.parametrize("model", FAMILY_MODELS + HYBRID_MODELS)
def test_a_family_trains_with_rollout_routing_replay(tmp_path, model):
    overrides = [f"model={model}", "task=max_digit", "rollout.max_new_tokens=1", *SHORT]
    result = run_training([*overrides, "routing.replay=rollout"], tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    for step in metrics:
        assert step["routing/rollout_vs_train_changed_frac"] == 0.0, step
        assert step["mismatch/abs_log_prob_diff_mean"] < 1e-5, step


def test_a_moving_expert_bias_resumes_exactly(tmp_path):
    """GLM-4.5's expert bias moves each step from the experts' load (``model.expert_bias_update_rate``);
    it is a buffer, not a parameter, and the checkpoint must carry it: stopped after step 2 and resumed,
    the run's metrics equal the uninterrupted run's, step by step."""
    from gspo_megatron.testing.distributed import run_distributed
    from gspo_megatron.testing.train_runs import train_worker, without_time

    base = ["model=glm4_moe_tiny", "task=max_digit", "rollout.max_new_tokens=1", *SHORT, "trainer.steps=4"]
    base += ["model.expert_bias_update_rate=0.05", "algorithm.loss.entropy_coef=0.01"]
    (full,) = run_distributed(train_worker, 1, base, str(tmp_path / "full"))
    run_distributed(train_worker, 1, base + ["trainer.stop_after_steps=2"], str(tmp_path / "resumed"))
    (resumed,) = run_distributed(train_worker, 1, base + ["checkpoint.resume=true"], str(tmp_path / "resumed"))
    assert len(full) == len(resumed) == 4
    assert without_time(full) == without_time(resumed)


@pytest.mark.distributed
def test_olmoe_all_heads_norms_train_on_tp2_and_resume_on_one_rank(tmp_path):
    """OLMoE's q/k norms span all heads: under tp2 each rank normalises its heads by the mean square summed
    over both and multiplies by its heads' part of the whole weight, whose gradient parts megatron's TP
    all-reduce adds (``AllHeadsRMSNorm``). A tp2 run's step-2 checkpoint resumes on one rank; the resumed
    steps equal the uninterrupted tp2 run's to fp32 reduction order."""
    from gspo_megatron.testing.distributed import run_distributed
    from gspo_megatron.testing.train_runs import train_worker, without_time

    base = ["model=olmoe_tiny", "task=max_digit", "rollout.max_new_tokens=1", *SHORT, "trainer.steps=4"]
    base += ["optimizer.warmup_steps=0", "algorithm.loss.entropy_coef=0.01"]
    (full,) = run_distributed(train_worker, 2, base + ["parallel=tp2"], str(tmp_path / "full"), timeout=900)[:1]
    resumed_dir = str(tmp_path / "resumed")
    run_distributed(train_worker, 2, base + ["parallel=tp2", "trainer.stop_after_steps=2"], resumed_dir, timeout=900)
    (resumed,) = run_distributed(train_worker, 1, base + ["checkpoint.resume=true"], resumed_dir, timeout=900)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert without_time(resumed[:2]) == without_time(full[:2])
    for a, b in zip(full[2:], resumed[2:], strict=True):
        for key in ("loss/policy", "grad_norm", "policy/entropy_old", "reward/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


# ``python -m gspo_megatron.train model=<hybrid> trainer.steps=20`` with R3, cut to the short batches: four decoded
# tokens, so rows finish at different steps and leave the engine's batch and its linear-attention states
HYBRID_20_STEPS = ["task=max_digit", "rollout.max_new_tokens=4", *SHORT, "trainer.steps=20", "routing.replay=rollout"]


def test_qwen3_5_moe_trains_20_steps_with_r3_and_resumes_exactly(tmp_path):
    """Every step: zero engine-vs-trainer routing difference, the engine's log-probs the trainer's. Stopped after
    step 10 and resumed (the command line both times), the run's metrics equal the uninterrupted run's step by
    step and its step-20 checkpoint (weights and Adam's state) the uninterrupted one's bit for bit. Qwen3-Next,
    the same layers in another family, runs the 2 steps above (20 more with a resume would double this test)."""
    overrides = ["model=qwen3_5_moe_tiny", *HYBRID_20_STEPS]
    full = run_training(overrides, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    metrics = read_metrics(tmp_path / "full")
    assert [m["step"] for m in metrics] == list(range(1, 21))
    for step in metrics:
        assert step["routing/rollout_vs_train_changed_frac"] == 0.0, step
        assert step["mismatch/abs_log_prob_diff_mean"] < 1e-5, step
    assert max(m["response/length_mean"] for m in metrics) > 1  # more than one token decoded

    stopped = run_training([*overrides, "trainer.stop_after_steps=10"], tmp_path / "resumed")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_training([*overrides, "checkpoint.resume=true"], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert without_time(read_metrics(tmp_path / "resumed")) == without_time(metrics)
    last = "checkpoints/step_000020"
    expected = checkpoint_tensors(tmp_path / "full" / last, tmp_path / "full")
    got = checkpoint_tensors(tmp_path / "resumed" / last, tmp_path / "resumed")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


# one step of two updates whose first moves the weights (each response its own reward), every diagnostic on
ROUTING_DIAGNOSTICS_RUN = [
    "model=qwen3_next_tiny",
    "task=max_digit",
    "rollout.max_new_tokens=4",
    *SHORT,
    "trainer.steps=1",
    "trainer.updates_per_rollout=2",
    "optimizer.warmup_steps=0",
    "task.reward=import:gspo_megatron.testing.reward_doubles:varied_by_response",
    "routing.kinds=[update,rollout_vs_train,minibatch,ratio_decomposition]",
]


def _routing_records(run_dir) -> dict[str, dict]:
    import json

    lines = (run_dir / "routing.jsonl").read_text().splitlines()
    return {record["kind"]: record for record in map(json.loads, lines)}


def test_a_hybrid_replays_the_old_routing_and_runs_every_routing_diagnostic(tmp_path):
    """Qwen3-Next tiny (gated DeltaNet and full attention layers, each with an MoE): under R2 the updates replay
    the old pass's experts exactly -- the ratio decomposition finds every token's experts unchanged and no
    routing part, while the first update moved the weights -- and each diagnostic reports every MoE layer;
    routed freely, the same step's experts change and the decomposition measures a routing part."""
    replayed = run_training([*ROUTING_DIAGNOSTICS_RUN, "algorithm=grpo_routing_replay"], tmp_path / "r2")
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    (step,) = read_metrics(tmp_path / "r2")
    assert step["ratio_decomp/token_unchanged_frac"] == 1.0
    assert step["ratio_decomp/token_unchanged_abs_routing"] == 0.0  # bit-exact replay
    assert step["ratio_decomp/token_unchanged_abs_weight"] > 0
    records = _routing_records(tmp_path / "r2")
    assert set(records) == {"update", "rollout_vs_train", "minibatch"}
    for record in records.values():
        assert len(record["changed_frac"]) == 3 and record["tokens"] > 0, record  # 3 layers, each an MoE
    assert records["update"]["changed_frac_overall"] > 0  # an update moves the routers

    free = run_training([*ROUTING_DIAGNOSTICS_RUN, "algorithm=grpo"], tmp_path / "free")
    assert free.returncode == 0, free.stderr[-3000:]
    (step,) = read_metrics(tmp_path / "free")
    assert step["ratio_decomp/token_changed_frac"] > 0
    assert step["ratio_decomp/token_changed_abs_routing"] > 0
    shares = [step[f"ratio_decomp/token_var_share_{part}"] for part in ("routing", "weight", "cross")]
    assert sum(shares) == pytest.approx(1.0)


@pytest.mark.distributed
def test_a_hybrid_trains_with_r3_under_context_parallelism_as_on_one_rank(tmp_path):
    """Where megatron-core's gated DeltaNet has context parallelism (0.19): Qwen3.5-MoE tiny with R3 on cp2 (each
    rank a load-balanced half of every row; the padding to 2 * cp routed to a valid top-k) trains its steps as
    one rank does, with zero engine-vs-trainer routing difference."""
    from gspo_megatron.policy.parallel.layout import gated_delta_net_has_context_parallel
    from gspo_megatron.testing.distributed import run_distributed
    from gspo_megatron.testing.train_runs import train_worker

    if not gated_delta_net_has_context_parallel():
        pytest.skip("megatron-core < 0.19: gated DeltaNet has no context parallelism (refused by name)")
    base = ["model=qwen3_5_moe_tiny", "task=max_digit", "rollout.max_new_tokens=4", *SHORT, "routing.replay=rollout"]
    base += ["optimizer.warmup_steps=0", "task.reward=import:gspo_megatron.testing.reward_doubles:varied_by_response"]
    (one,) = run_distributed(train_worker, 1, base, str(tmp_path / "one"), timeout=600)
    two = run_distributed(train_worker, 2, [*base, "parallel=cp2"], str(tmp_path / "cp2"), timeout=900)[0]
    assert [m["step"] for m in two] == [1, 2] and one[0]["grad_norm"] > 0
    for a, b in zip(one, two, strict=True):
        assert b["routing/rollout_vs_train_changed_frac"] == 0.0, b
        for key in ("loss/policy", "grad_norm", "policy/entropy_old", "reward/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
