"""A bf16 rollout engine against the fp32 trainer (the production situation: SGLang's bf16 kernels vs
Megatron), on the small fine-grained MoE, one RL step, one rank and EP=2.

- Without rollout routing replay the mismatch is real: mean |log p_train - log p_engine| > 0 and the
  trainer routes some tokens to other experts than the engine did (rollout_vs_train > 0).
- With R3 the trainer's forward routes every token exactly as the engine did (changed fraction 0,
  observed in megatron's top-k), and the log-prob mismatch shrinks; what is left is the non-routing
  part (bf16 vs fp32 arithmetic), still > 0. Both runs score the same first rollout (same seeds).
"""

from __future__ import annotations

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import FAST, train_worker

pytestmark = pytest.mark.e2e

BF16_ENGINE = FAST + [
    "model=small_moe",
    "rollout.embedded.dtype=bfloat16",
    "trainer.steps=1",
    "trainer.updates_per_rollout=1",
    "trainer.micro_batch_size=8",
    "rollout.max_new_tokens=8",
    "task.reward=last_number",
    "routing.kinds=[rollout_vs_train]",
]
MISMATCH = "mismatch/abs_log_prob_diff_mean"
CHANGED = "routing/rollout_vs_train_changed_frac"


@pytest.mark.parametrize("layout, world", [("single", 1), ("ep2", 2)])
def test_bf16_engine_mismatch_and_what_r3_removes(tmp_path, layout, world):
    runs = {}
    for algorithm in ("grpo", "grpo_rollout_routing_replay"):
        overrides = BF16_ENGINE + [f"parallel={layout}", f"algorithm={algorithm}"]
        runs[algorithm] = run_distributed(train_worker, world, overrides, str(tmp_path / algorithm), timeout=900)[0][0]
    free, r3 = runs["grpo"], runs["grpo_rollout_routing_replay"]
    print(
        f"{layout}: mismatch free {free[MISMATCH]:.3g} R3 {r3[MISMATCH]:.3g}; routing changed free "
        f"{free[CHANGED]:.3g} (any layer {free['routing/rollout_vs_train_changed_any_frac']:.3g}) R3 {r3[CHANGED]}"
    )
    assert free[MISMATCH] > 0 and free[CHANGED] > 0
    assert free["routing/rollout_vs_train_changed_any_frac"] >= free[CHANGED]
    assert r3[CHANGED] == 0.0 and r3["routing/rollout_vs_train_changed_any_frac"] == 0.0
    assert 0 < r3[MISMATCH] < free[MISMATCH]  # the non-routing residual remains
