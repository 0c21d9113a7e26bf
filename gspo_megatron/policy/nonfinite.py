"""Non-finite loss and gradients: detected on every rank before the optimizer steps, never applied.

Design decisions:
- The check does not rely on ``optimizer.step()`` reporting failure: megatron's FP32 optimizer never
  does (only the loss-scaled fp16/bf16 path looks for infs). Before each optimizer step every rank
  checks its own loss values and its own gradient buffers; one all-reduce (MAX over the world) makes
  every rank take the same decision, so model-parallel shards never diverge.
- Gradient buffers are checked through their sum: a NaN or inf anywhere makes the sum non-finite,
  and the sum needs no buffer-sized temporary (one read of the gradients, like the norm megatron
  computes anyway). A finite buffer whose sum overflows fp32 (|sum| > 3e38) is flagged too: such
  gradients are garbage either way.
- ``trainer.on_nonfinite=skip`` drops the update (no optimizer or LR-scheduler step, as megatron does
  for a loss-scaler skip) and counts it in the step's metrics; ``trainer.max_consecutive_nonfinite``
  skips in a row stop the run with a diagnosis. ``stop`` stops at the first one. Stopping raises
  before the step's checkpoint, so ``latest`` keeps naming the last good checkpoint.
- Non-finite rewards never reach this point: the reward pool scores them as failed samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gspo_megatron.core.config_node import ConfigChoice

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    from gspo_megatron.policy.models.chunks import ModelChunks


class NonFinitePolicy(ConfigChoice):
    """``trainer.on_nonfinite``: what a non-finite loss or gradient does (``policy/nonfinite.py``)."""

    skip = "skip"  # drop the update and go on (a streak of them still stops the run)
    stop = "stop"  # end the run


class NonFiniteError(FloatingPointError):
    """Training produced non-finite values and the policy (or the streak) says stop."""


def _all_finite(values: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v.detach().float().sum())) for v in values)


def local_gradient_tensors(model: ModelChunks | DistributedDataParallel) -> list[torch.Tensor]:
    """This rank's gradient storage: megatron DDP's contiguous buffers (dense and expert) of every chunk."""
    from gspo_megatron.policy.models.chunks import as_model_chunks

    return as_model_chunks(model).grad_buffers()


def _any_rank(flags: list[bool]) -> list[bool]:
    """Element-wise OR over every rank (one all-reduce)."""
    tensor = torch.tensor([float(f) for f in flags])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def parameters_finite(model: torch.nn.Module | ModelChunks) -> bool:
    """True when every rank's parameters are finite (collective)."""
    (bad,) = _any_rank([not _all_finite(p for p in model.parameters())])
    return not bad


def _local_nonfinite_optimizer_tensor(optimizer: MegatronOptimizer, model: torch.nn.Module | ModelChunks) -> str | None:
    """The first non-finite tensor of this rank's optimizer (main weights, Adam moments), named by the
    model parameter it belongs to where megatron links them (``main_param``), else by group and index."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names[id(param)] = name
        main = getattr(param, "main_param", None)
        if main is not None:
            names[id(main)] = name
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        for group_index, group in enumerate(inner.param_groups):
            for index, param in enumerate(group["params"]):
                owner = names.get(id(param), f"group {group_index} parameter {index} {list(param.shape)}")
                tensors = {"main weight": param, **{k: v for k, v in inner.state.get(param, {}).items()}}
                for kind, value in tensors.items():
                    if torch.is_tensor(value) and value.is_floating_point() and not _all_finite([value]):
                        return f"{kind} of {owner}"
    return None


def optimizer_state_finite(optimizer: MegatronOptimizer, model: torch.nn.Module | ModelChunks) -> str | None:
    """Collective: None when every rank's optimizer state is finite, else the first bad tensor a rank found."""
    found = _local_nonfinite_optimizer_tensor(optimizer, model)
    (bad,) = _any_rank([found is not None])
    if not bad:
        return None
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return found
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return next(f"{name} (rank {rank})" for rank, name in enumerate(everyone) if name is not None)


@dataclass
class NonFiniteGuard:
    policy: str = "skip"
    max_consecutive: int = 3
    consecutive: int = 0
    skipped_in_step: int = 0

    def check(self, loss_values: Iterable[torch.Tensor], model: ModelChunks | DistributedDataParallel) -> str | None:
        """Collective: None when loss and gradients are finite on every rank, else what was not."""
        bad_loss, bad_grad = _any_rank([not _all_finite(loss_values), not _all_finite(local_gradient_tensors(model))])
        found = [name for name, bad in (("loss", bad_loss), ("gradients", bad_grad)) if bad]
        return " and ".join(found) + " non-finite" if found else None

    @staticmethod
    def after_step(stepped: bool, grad_norm: float | None) -> str | None:
        """What the optimizer itself reported: a skipped step (loss-scaled path) or a non-finite norm."""
        if not stepped:
            return "optimizer skipped the step (non-finite gradients)"
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            return f"gradient norm {float(grad_norm)}"
        return None

    def record(self, problem: str | None, where: str) -> None:
        """Count a finding (or a clean update); raise ``NonFiniteError`` when the run must stop."""
        if problem is None:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.skipped_in_step += 1
        advice = (
            "the latest checkpoint is untouched: resume it with a lower learning rate, e.g. "
            "checkpoint.resume=true optimizer.lr=<lower> checkpoint.resume_allow_changes=[optimizer.lr], "
            "or check the rewards and advantages of the failing step"
        )
        if self.policy == NonFinitePolicy.stop:
            raise NonFiniteError(f"{where}: {problem} (trainer.on_nonfinite=stop); {advice}")
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{where}: {problem}; {self.consecutive} consecutive updates skipped "
                f"(trainer.max_consecutive_nonfinite={self.max_consecutive}); {advice}"
            )

    def step_metrics(self) -> dict[str, float]:
        metrics = {
            "nonfinite/skipped_updates": float(self.skipped_in_step),
            "nonfinite/consecutive": float(self.consecutive),
        }
        self.skipped_in_step = 0
        return metrics
