"""``optimizer.distributed`` resolves in one place: auto = on exactly when dp x cp > 1 (megatron's
optimizer data-parallel group: the dense gradients are reduced and the state sharded over dp x cp)."""

from __future__ import annotations

import pytest

from gspo_megatron.policy.config import use_distributed_optimizer
from gspo_megatron.policy.parallel.layout import ParallelLayout


@pytest.mark.parametrize(
    "layout, auto",
    [
        (ParallelLayout(world_size=1), False),
        (ParallelLayout(world_size=2), True),  # dp 2
        (ParallelLayout(tp=2, world_size=2), False),  # dp 1
        (ParallelLayout(ep=2, world_size=2), True),  # dp 2 (experts: expert-dp 1)
        (ParallelLayout(cp=2, world_size=2), True),  # dp 1, cp 2: two ranks hold the same weights
        (ParallelLayout(cp=2, ep=2, world_size=2), True),
        (ParallelLayout(tp=2, cp=2, world_size=4), True),
        (ParallelLayout(tp=2, pp=2, world_size=4), False),  # dp 1, cp 1
        (ParallelLayout(tp=2, world_size=4), True),
    ],
)
def test_auto_is_on_when_dp_times_cp_exceeds_one(layout, auto):
    assert use_distributed_optimizer("auto", layout) is auto
    assert use_distributed_optimizer("true", layout) is True
    assert use_distributed_optimizer("false", layout) is False


def test_precision_aware_without_offload_needs_transformer_engine():
    from gspo_megatron.policy.config import OptimizerSection
    from gspo_megatron.policy.optimizer import check_precision_aware

    alone = OptimizerSection(precision_aware=True)
    with pytest.raises(ValueError, match=r"optimizer.precision_aware=true without optimizer.cpu_offload needs"):
        check_precision_aware(alone, te=False)
    check_precision_aware(alone, te=True)  # TE's FusedAdam holds the master weights
    check_precision_aware(OptimizerSection(precision_aware=True, cpu_offload=True), te=False)  # the host optimizer
