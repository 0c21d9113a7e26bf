"""End-to-end: the real trainer on the tiny MoE for a few steps, per algorithm and layout."""

from __future__ import annotations

import math

import pytest

from gspo_megatron.core.run_dir import read_jsonl
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST, read_metrics, train_worker, without_time

pytestmark = pytest.mark.e2e

ALGORITHMS = ["gspo", "gspo_token", "grpo", "grpo_routing_replay", "grpo_rollout_routing_replay"]


def _check_run(metrics: list[dict], steps: int) -> None:
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert math.isfinite(m["loss/policy"]) and math.isfinite(m["grad_norm"])
        # the trainer's recomputed old log-probs match the engine's sampling log-probs
        assert m["mismatch/abs_log_prob_diff_mean"] < 1e-4


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_algorithm_on_one_rank(tmp_path, algorithm):
    # an entropy bonus gives step 1 a gradient even when every group's rewards are equal
    # one update per rollout: every update must start on-policy (the default 2 makes the second off-policy)
    overrides = FAST + [
        f"algorithm={algorithm}",
        "optimizer.warmup_steps=0",
        "algorithm.loss.entropy_coef=0.01",
        "trainer.updates_per_rollout=1",
    ]
    (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path), timeout=600)
    _check_run(metrics, 2)
    # step 1 updated the weights at full lr; step 2's old log-probs are recomputed on the new weights,
    # so its only update is on-policy: ratio exactly 1
    assert metrics[0]["lr"] > 0 and metrics[0]["grad_norm"] > 0
    assert metrics[1]["loss/ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics[1]["loss/ratio/min"] == pytest.approx(1.0, abs=1e-5)
    # routing.jsonl: engine vs trainer for every step; the same fp32 numbers route identically
    records = [r for r in read_jsonl(tmp_path / "routing.jsonl") if r["kind"] == "rollout_vs_train"]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["tokens"] > 0 and r["changed_frac_overall"] == 0.0 for r in records)


def test_engine_log_probs_as_old_policy(tmp_path):
    """old_log_probs=rollout: pi_old is the engine's. A bf16 engine makes them differ from the trainer's
    fp32 log-probs, so the first (otherwise on-policy) update's ratio is not 1; routing diagnostics
    still come from the old policy (the first update's forward)."""
    overrides = FAST + [
        "trainer.old_log_probs=rollout",
        "rollout.embedded.dtype=bfloat16",
        "trainer.updates_per_rollout=2",
        "trainer.micro_batch_size=2",
    ]
    (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path), timeout=600)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["loss/policy"]) and math.isfinite(m["grad_norm"])
        assert "mismatch/abs_log_prob_diff_mean" not in m  # it would compare pi_old with itself
        assert 0 <= m["routing/update_changed_frac"] <= 1
        assert 0 <= m["routing/rollout_vs_train_changed_frac"] <= 1
    assert abs(metrics[0]["loss/ratio/max"] - 1.0) > 1e-5 or abs(metrics[0]["loss/ratio/min"] - 1.0) > 1e-5


def test_token_budget_micro_batches(tmp_path):
    """trainer.micro_batch_tokens through the trainer: old log-probs gathered back by row match the
    engine's (rows were reordered and cut per micro-batch), and the padded fraction is reported."""
    overrides = FAST + ["trainer.micro_batch_tokens=24", "rollout.max_new_tokens=6", "rollout.temperature=2.0"]
    (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path), timeout=600)
    _check_run(metrics, 2)
    for m in metrics:
        assert 0 <= m["batch/padded_token_frac"] < 1


@pytest.mark.distributed
@pytest.mark.parametrize("layout, world", [("tp2", 2), ("ep2", 2), ("pp2", 2)])
def test_two_gloo_ranks(tmp_path, layout, world):
    results = run_distributed(train_worker, world, FAST + [f"parallel={layout}"], str(tmp_path), timeout=900)
    _check_run(results[0], 2)


@pytest.mark.distributed
def test_data_parallel_step_equals_one_rank(tmp_path):
    """EP = 2 on two ranks is DP = 2 for the batch: each rank receives half of the rows, and the
    step's whole-batch metrics (mismatch, old entropy, padded fraction, mismatch-correction weights,
    losses) equal one rank's, which holds every row. bf16 engine: the mismatch is not zero."""
    overrides = FAST + [
        "trainer.steps=1",
        "rollout.max_new_tokens=4",
        "rollout.temperature=2.0",
        "rollout.embedded.dtype=bfloat16",
        "algorithm=grpo",
        "algorithm.mismatch.correction=token_truncate",
        "trainer.micro_batch_tokens=24",
    ]
    (one,) = run_distributed(train_worker, 1, overrides, str(tmp_path / "one"), timeout=600)
    two = run_distributed(train_worker, 2, overrides + ["parallel=ep2"], str(tmp_path / "two"), timeout=900)[0]
    keys = [
        "mismatch/abs_log_prob_diff_mean",
        "policy/entropy_old",
        "batch/padded_token_frac",
        "mismatch_is/weight_mean",
        "mismatch_is/weight_max",
        "loss/policy",
        "loss/clip_frac_token",
    ]
    assert one[0]["mismatch/abs_log_prob_diff_mean"] > 1e-4
    for key in keys:
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-6), key


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ep2", "pp2", "cp2"])
def test_rollout_replay_under_model_parallelism(tmp_path, layout):
    """R3 end to end with the embedded engine's routed experts, under EP=2, PP=2 and CP=2 (the trainer's
    rows padded to 2*cp and split across ranks, old log-probs gathered back)."""
    overrides = FAST + [f"parallel={layout}", "algorithm=grpo_rollout_routing_replay"]
    results = run_distributed(train_worker, 2, overrides, str(tmp_path), timeout=900)
    _check_run(results[0], 2)


def test_tp2_sequence_parallel_with_an_odd_fed_length(tmp_path):
    """Responses of 1-4 tokens give batches of any width; sequence parallelism reduce-scatters the fed
    length over the TP ranks, so it is padded to a multiple of TP (it crashed when odd)."""
    overrides = FAST + ["parallel=tp2", "rollout.max_new_tokens=4", "task.reward=last_number"]
    results = run_distributed(train_worker, 2, overrides, str(tmp_path), timeout=900)
    _check_run(results[0], 2)


@pytest.mark.parametrize(
    "dtype, optimizer",
    [
        ("float32", []),
        ("bfloat16", []),
        ("bfloat16", ["optimizer.cpu_offload=true", "optimizer.distributed=true"]),
        (
            "bfloat16",
            ["optimizer.cpu_offload=true", "optimizer.precision_aware=true", "optimizer.offload_fraction=0.5"]
            + ["optimizer.distributed=true"],
        ),
    ],
    ids=["float32", "bfloat16", "bfloat16-cpu-offload", "bfloat16-precision-aware-half-offload"],
)
def test_resume_continues_exactly(tmp_path, dtype, optimizer):
    """bf16: bf16 weights, fp32 main weights and Adam state (megatron's mixed-precision optimizer); with
    optimizer.cpu_offload the Adam state lives in megatron's HybridDeviceOptimizer's host copies; with
    optimizer.precision_aware the fp32 master weights are that optimizer's own (no main shards in the
    distributed optimizer), half of them on the host.
    The entropy bonus gives every step a gradient, so the resumed steps depend on the restored state."""
    base = FAST + ["trainer.steps=4", f"model.dtype={dtype}", "algorithm.loss.entropy_coef=0.01", *optimizer]
    (full,) = run_distributed(train_worker, 1, base + ["checkpoint.save_every=2"], str(tmp_path / "full"))
    run_distributed(train_worker, 1, base + ["trainer.stop_after_steps=2"], str(tmp_path / "resumed"))
    (resumed,) = run_distributed(train_worker, 1, base + ["checkpoint.resume=true"], str(tmp_path / "resumed"))
    assert len(full) == len(resumed) == 4
    assert all(m["grad_norm"] > 0 for m in full)
    for a, b in zip(full, resumed, strict=True):
        same = {k: a[k] for k in a if not k.startswith("time/")}
        assert same == {k: b[k] for k in b if not k.startswith("time/")}, f"step {a['step']} differs after resume"
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text() == "step_000004"


@pytest.mark.distributed
def test_uneven_pipeline_stages_train_and_resume_across_splits(tmp_path):
    """A 3-layer model on pp2 with 2 + 1 layers (parallel.last_stage_layers=1) trains; its step-2
    checkpoint resumes on the other split, 1 + 2 (parallel.first_stage_layers=1), where megatron's
    checkpoint reshards the layers across the stage boundary; rollout routing replay on both. The first
    steps equal the uninterrupted run exactly, the resumed ones to fp32 reduction order (the grad norm
    sums the stages' squares)."""
    base = FAST + ["model.num_layers=3", "parallel=pp2", "trainer.steps=4", "algorithm.loss.entropy_coef=0.01"]
    base += ["optimizer.warmup_steps=0", "algorithm=grpo_rollout_routing_replay"]  # R3 on each stage's layers
    two_one, one_two = ["parallel.last_stage_layers=1"], ["parallel.first_stage_layers=1"]
    (full,) = run_distributed(train_worker, 2, base + two_one, str(tmp_path / "full"), timeout=900)[:1]
    resumed_dir = str(tmp_path / "resumed")
    run_distributed(train_worker, 2, base + two_one + ["trainer.stop_after_steps=2"], resumed_dir, timeout=900)
    (resumed,) = run_distributed(
        train_worker, 2, base + one_two + ["checkpoint.resume=true"], resumed_dir, timeout=900
    )[:1]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4] and all(m["grad_norm"] > 0 for m in full)
    assert without_time(resumed[:2]) == without_time(full[:2])
    assert all(m["routing/rollout_vs_train_changed_any_frac"] == 0.0 for m in full)  # formed over both stages
    for a, b in zip(full[2:], resumed[2:], strict=True):
        for key in ("loss/policy", "grad_norm", "policy/entropy_old", "reward/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert "first_stage_layers: 1" in (tmp_path / "resumed" / "config.yaml").read_text()
    # routing diagnostics of all 3 layers, whichever stage holds them: the engine and the replaying
    # trainer route every token alike
    records = [r for r in read_jsonl(tmp_path / "full" / "routing.jsonl") if r["kind"] == "rollout_vs_train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["tokens"] > 0 and r["changed_frac_overall"] == 0.0 and len(r["changed_frac"]) == 3 for r in records)


@pytest.mark.distributed
def test_virtual_pipeline_stages_train_and_resume_without_them(tmp_path):
    """A 4-layer model on pp2 with 2 virtual stages per rank (parallel.vpp=2: rank 0 holds layers 0 and 2,
    rank 1 layers 1 and 3; megatron's interleaved 1F1B) trains with rollout routing replay like pp2 without
    virtual stages, to fp32 reduction order; its step-2 checkpoint resumes on vpp 1 (megatron's checkpoint
    moves the layers between ranks), the first steps exactly equal, the resumed ones to reduction order."""
    base = FAST + ["model.num_layers=4", "parallel=pp2", "trainer.steps=4", "algorithm.loss.entropy_coef=0.01"]
    base += ["optimizer.warmup_steps=0", "algorithm=grpo_rollout_routing_replay"]  # R3 on each chunk's layers
    (virtual,) = run_distributed(train_worker, 2, base + ["parallel.vpp=2"], str(tmp_path / "vpp2"), timeout=900)[:1]
    (plain,) = run_distributed(train_worker, 2, base, str(tmp_path / "vpp1"), timeout=900)[:1]
    resumed_dir = str(tmp_path / "resumed")
    run_distributed(train_worker, 2, base + ["parallel.vpp=2", "trainer.stop_after_steps=2"], resumed_dir, timeout=900)
    (resumed,) = run_distributed(train_worker, 2, base + ["checkpoint.resume=true"], resumed_dir, timeout=900)[:1]
    assert [m["step"] for m in virtual] == [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert all(m["grad_norm"] > 0 and m["routing/rollout_vs_train_changed_any_frac"] == 0.0 for m in virtual)
    assert without_time(resumed[:2]) == without_time(virtual[:2])
    keys = ("loss/policy", "grad_norm", "policy/entropy_old", "reward/mean", "loss/ratio", "entropy")
    for reference, other in ((plain, virtual), (virtual[2:], resumed[2:])):
        for a, b in zip(reference, other, strict=True):
            for key in keys:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    records = [r for r in read_jsonl(tmp_path / "vpp2" / "routing.jsonl") if r["kind"] == "rollout_vs_train"]
    assert all(r["tokens"] > 0 and r["changed_frac_overall"] == 0.0 and len(r["changed_frac"]) == 4 for r in records)


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    """The main job (conf/config.yaml's defaults) on its own 200-step schedule, stopped at step 80: the
    reward has risen from about 0.01 to about 0.38 there (0.82 at 200)."""
    overrides = ["trainer.stop_after_steps=80", "trainer.eval_every=0", "logging.progress=false"]
    overrides += ["logging.tensorboard=false"]
    (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path), timeout=900)
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert (tmp_path / "reward_curve.png").is_file() and (tmp_path / "routing_report.html").is_file()
    assert read_metrics(tmp_path) == metrics


@pytest.mark.distributed
def test_launch_script_runs_two_ranks_with_overrides(tmp_path):
    """The documented single-node launcher, two ranks, Hydra overrides appended."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NPROC="2", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    cmd = ["bash", str(repo / "launch" / "train_local.sh"), "parallel=tp2", f"run_dir={tmp_path}", *FAST]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    _check_run(read_metrics(tmp_path), 2)
    assert "tp: 2" in (tmp_path / "config.yaml").read_text()


def test_truncated_rollout_and_step_grpo_shaping(tmp_path):
    """DTR inside the trainer: every digit is a trigger and any probe is confident, so samples exit at
    their first digit; the inserted closing tokens are counted and left out of the loss mask."""
    overrides = FAST + [
        "task.reward=last_number",
        "rollout.max_new_tokens=8",
        "shaping=step_grpo",
        "rollout.truncated=true",
        "rollout.truncation.probe_suffix=' answer '",
        "rollout.truncation.probe_skip_tokens=0",
        "rollout.truncation.close_thinking=' </think> '",
        "rollout.truncation.max_probes=2",
        "rollout.truncation.confidence_threshold=1e-9",
        "rollout.truncation.trigger_token_ids=[4,5,6,7,8,9,10,11,12,13]",  # the digits' ids
        # one trigger list for probing and step counting (a token-id trigger must be a trigger word)
        "shaping.trigger_words=['0','1','2','3','4','5','6','7','8','9']",
    ]
    (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path), timeout=600)
    _check_run(metrics, 2)
    for m in metrics:
        exits = [k for k in m if k.startswith("truncation/exit_")]
        assert sum(m[k] for k in exits) == pytest.approx(1.0)
        assert m["truncation/exit_confident_frac"] > 0.2  # a digit in 8 tokens is likely; each exits
        assert m["truncation/probes_mean"] > 0.2
        # 3 closing tokens (" ", "</think>", " ") per forced exit, all masked out of the loss
        forced_exits = sum(m.get(f"truncation/exit_{r}_frac", 0.0) for r in ("confident", "think_budget"))
        assert m["truncation/forced_tokens"] == pytest.approx(3 * 16 * forced_exits) and forced_exits > 0
        assert m["truncation/loss_masked_tokens"] == m["truncation/forced_tokens"]
    for m in metrics:  # the shaper's own metric and the shared diagnostics, both every step
        correct_steps = m["shaping/step_grpo/correct_steps_mean"]  # NaN: no correct response this step
        assert math.isnan(correct_steps) or correct_steps >= 0
        assert m["shaping/steps_per_response"] >= 0
