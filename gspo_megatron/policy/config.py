"""The policy side's config sections: ``model``, ``parallel`` and ``optimizer`` (``config/schema.py``
composes them with the other roles' sections into one ``TrainConfig``), and ``PolicySettings``, what
the policy is built from.

Each section refuses its own bad values in ``validate()``, naming the key and the fix; the rules
between sections are ``config/validate.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gspo_megatron.algorithms.config import AlgorithmConfig, OldLogProbSource
from gspo_megatron.core.config_node import ConfigChoice, ConfigNode
from gspo_megatron.policy.models.config import ExpertMLP, LayerSpec, MoEModelConfig, TokenDispatcher
from gspo_megatron.policy.nonfinite import NonFinitePolicy
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.policy.routing.config import RoutingConfig


class TrainerDtype(ConfigChoice):
    """``model.dtype``: the trainer's parameter dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class DecayStyle(ConfigChoice):
    """``optimizer.decay_style`` (megatron's OptimizerParamScheduler names)."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class StateDtype(ConfigChoice):
    """The precision-aware optimizer's state dtypes (megatron's ``main_params_dtype`` / ``exp_avg_dtype`` /
    ``exp_avg_sq_dtype``, TransformerEngine's FusedAdam)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


STATE_DTYPE_BYTES = {StateDtype.float32: 4, StateDtype.bfloat16: 2, StateDtype.float16: 2}


class DistributedOptimizerChoice(ConfigChoice):
    """``optimizer.distributed``: shard megatron's optimizer state over the data-parallel ranks.

    ``auto`` = on exactly when dp x cp > 1 (the ranks megatron shards the dense optimizer state over,
    ``policy/optimizer.py``); the same on CPU and GPU. The field itself is a ``str``: YAML and Hydra turn
    ``true``/``false`` into booleans, which OmegaConf's enum fields refuse; ``OptimizerSection.validate``
    maps the string to this choice.
    """

    auto = "auto"
    true = "true"
    false = "false"


@dataclass
class ModelSection(MoEModelConfig):
    preset: str | None = None  # documentation of where the numbers came from ("tiny", ...)
    hf_checkpoint: str | None = None  # local HF directory or hub id (core/hub_checkpoints.py); sets the shape
    layer_spec: LayerSpec = LayerSpec.auto
    token_dispatcher: TokenDispatcher = TokenDispatcher.alltoall  # MoE with EP or TP; same results either way
    expert_mlp: ExpertMLP = ExpertMLP.grouped
    dtype: TrainerDtype = TrainerDtype.float32  # bfloat16: bf16 weights, fp32 main weights and grads
    init_seed: int = 1234  # random init when no checkpoint is given
    init_std: float = 0.02


@dataclass
class ParallelSection(ConfigNode):
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    sequence_parallel: bool | None = None  # None: on exactly when tp > 1
    first_stage_layers: int | None = None  # decoder layers on pipeline rank 0; None: an even share
    last_stage_layers: int | None = None  # decoder layers on the last pipeline rank; None: an even share
    vpp: int = 1  # virtual pipeline chunks per pipeline rank (interleaved 1F1B; needs pp > 1)
    timeout_s: float = 600.0  # bound of every collective; a rank silent this long is named and the job stops

    def validate(self) -> None:
        if not self.timeout_s > 0:  # also refuses nan
            raise ValueError(f"parallel.timeout_s={self.timeout_s} must be > 0 seconds (e.g. parallel.timeout_s=600)")

    # the keys that are ParallelLayout fields (the rest, timeout_s, is how collectives are bounded)
    LAYOUT_KEYS = ("tp", "pp", "ep", "etp", "cp", "sequence_parallel", "first_stage_layers", "last_stage_layers", "vpp")

    def layout(self, world_size: int) -> ParallelLayout:
        return ParallelLayout(world_size=world_size, **{key: getattr(self, key) for key in self.LAYOUT_KEYS})

    @classmethod
    def from_layout(cls, layout: ParallelLayout) -> ParallelSection:
        return cls(**{key: getattr(layout, key) for key in cls.LAYOUT_KEYS})


def use_distributed_optimizer(choice: str, layout: ParallelLayout) -> bool:
    """``optimizer.distributed``: true/false as given; auto = on when the optimizer's data-parallel
    group has more than one rank.

    That group is megatron's, not our ``dp``: the DDP reduces the dense gradients over the dp x cp
    ranks (``dp_cp_group``; context-parallel ranks hold the same weights and see other tokens) and the
    distributed optimizer shards the dense state over the same ranks (``intra_dp_cp_group``), so
    cp=2 with dp=1 has two ranks to shard with. (Expert state is sharded over the expert-dp ranks;
    auto follows the dense group, which every layout has.)"""
    choice = DistributedOptimizerChoice(str(choice).lower())
    if choice == DistributedOptimizerChoice.auto:
        return layout.dp * layout.cp > 1
    return choice == DistributedOptimizerChoice.true


@dataclass
class OptimizerSection(ConfigNode):
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    decay_style: DecayStyle = DecayStyle.cosine
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm bound; 0: no clipping (megatron's convention)
    # auto | true | false: megatron's distributed optimizer (state sharded over data-parallel ranks);
    # auto = on when dp x cp > 1 (the ranks megatron shards the optimizer state over)
    distributed: str = "auto"
    # Adam on the host (megatron's HybridDeviceOptimizer; slime's --optimizer-cpu-offload): the
    # offload_fraction of this rank's optimizer parameters is stepped by torch's AdamW on fp32 host
    # copies, the rest on the device. Needs the distributed optimizer and bf16 weights (validate.py).
    cpu_offload: bool = False
    offload_fraction: float = 1.0
    # megatron's precision-aware optimizer (slime's --use-precision-aware-optimizer): the distributed
    # optimizer keeps no fp32 main shards of the bf16 weights; the optimizer holds the master weights
    # (with cpu_offload: HybridDeviceOptimizer's fp32 copies, on the host for what it offloads)
    precision_aware: bool = False
    # ... and its state: the master weights (float32 | float16) and Adam's two moments (float32 | bfloat16 |
    # float16), held by TransformerEngine's FusedAdam; anything but float32 needs precision_aware without
    # cpu_offload (the host AdamW keeps float32 state) -- config/validate.py
    main_params_dtype: StateDtype = StateDtype.float32
    exp_avg_dtype: StateDtype = StateDtype.float32
    exp_avg_sq_dtype: StateDtype = StateDtype.float32

    STATE_DTYPE_KEYS = ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")

    @property
    def reduced_state_dtypes(self) -> list[str]:
        """The state-dtype keys set to anything but float32."""
        return [key for key in self.STATE_DTYPE_KEYS if getattr(self, key) != StateDtype.float32]

    def validate(self) -> None:
        if self.main_params_dtype == StateDtype.bfloat16:
            raise ValueError(
                "optimizer.main_params_dtype=bfloat16 is not one megatron offers (its master weights are float32 "
                "or float16); set optimizer.main_params_dtype=float32"
            )
        if not 0.0 < self.offload_fraction <= 1.0:
            raise ValueError(
                f"optimizer.offload_fraction={self.offload_fraction} must be in (0, 1] (1: all of Adam on the host)"
            )
        for name in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"optimizer.{name}={getattr(self, name)} must be a finite number")
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"optimizer.min_lr={self.min_lr} must be in [0, optimizer.lr={self.lr}] (the LR decays from lr "
                "to min_lr); lower optimizer.min_lr or raise optimizer.lr"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps={self.warmup_steps} must be >= 0 (0: no warmup)")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay={self.weight_decay} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name}={getattr(self, name)} must be in [0, 1) (e.g. 0.9, 0.98)")
        if self.adam_eps <= 0:
            raise ValueError(f"optimizer.adam_eps={self.adam_eps} must be > 0 (e.g. 1e-8)")
        if self.clip_grad < 0:
            raise ValueError(f"optimizer.clip_grad={self.clip_grad} must be >= 0 (0: no clipping)")
        value = str(self.distributed).strip().lower()  # Hydra hands true/false over as 'True'/'False'
        if value not in tuple(DistributedOptimizerChoice):
            raise ValueError(
                f"optimizer.distributed={self.distributed!r} is not one of {', '.join(DistributedOptimizerChoice)}"
            )
        if not isinstance(self.distributed, DistributedOptimizerChoice):
            self.distributed = DistributedOptimizerChoice(value)


@dataclass(frozen=True)
class PolicySettings:
    """Everything the policy side is built from, resolved once from the whole config by the composition
    root (``loop/build.py:policy_settings``): the policy's own sections and the few values of other
    sections it reads. Not a config section: nothing here is a key of its own."""

    model: ModelSection
    parallel: ParallelSection
    optimizer: OptimizerSection
    algorithm: AlgorithmConfig  # the loss, the KL reference, pi_old's source (trainer.old_log_probs below)
    routing: RoutingConfig
    old_log_probs: OldLogProbSource  # trainer.old_log_probs
    seed: int  # trainer.seed
    total_updates: int  # trainer.steps x trainer.updates_per_rollout: the LR schedule's length
    updates_per_step: int  # trainer.updates_per_rollout
    temperature: float  # rollout.temperature: the policy's log-probs are log_softmax(logits / T)
    logprob_chunk_size: int | None  # trainer.logprob_chunk_size
    recompute_activations: bool  # trainer.recompute_activations
    reference_offload: bool  # trainer.reference_offload
    on_nonfinite: NonFinitePolicy  # trainer.on_nonfinite
    max_consecutive_nonfinite: int  # trainer.max_consecutive_nonfinite
    trajectory_turns: int = 0  # rollout.agent.max_turns when an agent runs (routing diagnosed per turn); else 0
