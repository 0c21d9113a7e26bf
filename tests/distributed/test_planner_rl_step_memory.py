"""The planner's per-rank peak memory of the whole RL step equals what the real trainer allocates.

The real trainer (``trainer/setup.py:build`` + ``RLTrainer.train_step``: the embedded engine in the
driver's process, rollout, old log-probs, the policy updates, the weight sync) runs 2 RL steps on
gloo ranks, from the composed config ``config/compose.py`` makes of the overrides below. Every rank
records the running total of torch's CPU allocator from before the model is built
(``testing/memory.run_memory``: the total includes every resident tensor), split at the trainer's
phases; the planner predicts the same job (``planning/job.py:job_from_config``) and the prediction
of every rank must be within 10% of its measured peak. One gloo launch per world size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.memory import RunMemory
from gspo_megatron.trainer.trainer import RLTrainer

pytestmark = pytest.mark.distributed

TOLERANCE = 0.10
STEPS = 2


def rl_step_worker(ctx, overrides: list[str], run_dir: str) -> dict:
    from megatron.core import parallel_state as ps
    from omegaconf import OmegaConf

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.testing.memory import run_memory
    from gspo_megatron.trainer.setup import build

    composed = compose(overrides)
    cfg = to_train_config(composed)
    with run_memory() as memory:
        memory.mark("build")
        components = build(cfg, Path(run_dir), OmegaConf.to_yaml(composed), world_size=ctx.world_size)
        try:
            trainer = PhaseMarkingTrainer(components, memory)
            memory.mark("weight_sync")
            trainer.sync_weights(version=0)  # what _train does before the first step
            for _ in range(STEPS):  # the steps without their run log and checkpoint
                memory.mark("between_steps")
                trainer.train_step()
                trainer.step += 1
            ranks = {
                "pp": ps.get_pipeline_model_parallel_rank(),
                "dp": ps.get_data_parallel_rank(with_context_parallel=True),
                "edp": ps.get_expert_data_parallel_rank(),
            }
        finally:
            components.close()
    return {"peaks": memory.peaks(), "windows": memory.windows(), **ranks}


class PhaseMarkingTrainer(RLTrainer):
    """The real trainer; entering a phase (``RLTrainer._phase``) also marks the memory record."""

    def __init__(self, components, memory: RunMemory):
        self.memory = memory
        super().__init__(components)

    def _phase(self, timings: dict, name: str):
        self.memory.mark(name)
        return super()._phase(timings, name)
