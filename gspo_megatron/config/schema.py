"""The typed schema of a training run, composed from each component's own config dataclass.

Design decisions:
- Components own their config dataclasses (``algorithms/config.py``, ``rollout/shaping/config.py``, ...);
  this module only adds the sections that belong to the trainer and composes them into one
  ``TrainConfig``. Hydra validates YAML against it (unknown keys, wrong types fail at compose time).
- The rollout section names its engine (``embedded`` or ``sglang``) and carries the sampling
  parameters shared by both, plus each engine's own block.
- ``MISSING`` is used nowhere: every default runs the tiny model on CPU.
- Each section refuses its own bad values in ``validate()``, which runs as ``to_train_config`` builds
  the typed tree (the entry point's first step, before anything is built or written) and names the
  key and the fix; rules between sections are ``config/validate.py``'s. Where 0 is a setting it is
  said beside the field (``optimizer.clip_grad=0``: no clipping; ``rollout.eval_temperature=0``:
  greedy). Training rollouts need ``rollout.temperature > 0``: their log-probs are
  ``log_softmax(logits / T)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gspo_megatron.algorithms.config import OLD_LOG_PROB_SOURCES, AlgorithmConfig, OldLogProbSource
from gspo_megatron.config.resume_check import validate_allow_list
from gspo_megatron.core.config_node import ConfigChoice, ConfigNode
from gspo_megatron.policy.models.config import ExpertMLP, LayerSpec, MoEModelConfig, TokenDispatcher
from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.policy.routing.config import RoutingConfig
from gspo_megatron.rollout.config import (
    PARTIAL_CONTINUE,
    EmbeddedConfig,
    PartialRollout,
    Placement,
    RolloutEngineName,
    TruncatedRolloutConfig,
    check_max_staleness,
)
from gspo_megatron.rollout.data.config import TaskConfig, TokenizerConfig
from gspo_megatron.rollout.rewards.config import RewardConfig
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.shaping.config import ShapingConfig


class NonFinitePolicy(ConfigChoice):
    """``trainer.on_nonfinite``: what a non-finite loss or gradient does (``policy/nonfinite.py``)."""

    skip = "skip"  # drop the update and go on (a streak of them still stops the run)
    stop = "stop"  # end the run


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
    hf_checkpoint: str | None = None  # a local HF directory (core/model_families.py); its config.json sets the shape
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


@dataclass
class RolloutSection(ConfigNode):
    engine: RolloutEngineName = RolloutEngineName.embedded
    group_size: int = 8  # responses per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8
    eval_temperature: float = 0.0
    truncated: bool = False  # dynamic truncated rollout (Step-GRPO), training rollouts only
    return_routed_experts: bool = False  # set automatically when R3 replay needs them
    async_rollout: bool = False  # generate step k+1 while step k trains (rollout/scheduler.py)
    # policy versions a sample may lag: async mode 0 (= synchronous) or 1; partial=continue >= 1
    max_staleness: int = 1
    # start over_sample x the step's groups, stop once the step's groups are complete (rollout/agents/partial.py)
    over_sample: float = 1.0
    partial: PartialRollout = PartialRollout.drop  # the groups not needed: drop | continue (into the next step)
    # separate | colocated: trainer and engine share the devices and take turns (loop/colocation.py)
    placement: Placement = Placement.separate
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    truncation: TruncatedRolloutConfig = field(default_factory=TruncatedRolloutConfig)

    def validate(self) -> None:
        # training samples must be drawn at T > 0: the trainer scores them with log_softmax(logits / T)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"rollout.temperature={self.temperature}: training rollouts need a finite temperature > 0 "
                "(the policy's log-probs are log_softmax(logits / T)); greedy decoding is for evaluation: "
                "rollout.eval_temperature=0"
            )
        if not (math.isfinite(self.eval_temperature) and self.eval_temperature >= 0):
            raise ValueError(f"rollout.eval_temperature={self.eval_temperature} must be >= 0 (0: greedy evaluation)")
        if not 0 < self.top_p <= 1:  # also refuses nan
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1] (1: no nucleus filtering)")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"rollout.top_k={self.top_k} must be >= 1, or -1 (off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.group_size}: group-relative advantages need >= 2 responses per prompt"
            )
        self._check_partial_rollouts()
        if self.placement == Placement.colocated and self.async_rollout:
            raise ValueError(
                "rollout.placement=colocated with rollout.async_rollout=true: colocated, the engine and the "
                "trainer take turns on the same devices, so generation cannot run beside training; set "
                "rollout.async_rollout=false or rollout.placement=separate"
            )

    def _check_partial_rollouts(self) -> None:
        if not (math.isfinite(self.over_sample) and self.over_sample >= 1.0):
            raise ValueError(f"rollout.over_sample={self.over_sample} must be >= 1 (1: no over-sampling)")
        carries = self.partial == PARTIAL_CONTINUE
        if carries and self.over_sample == 1.0:
            raise ValueError(
                "rollout.partial=continue carries the groups over-sampling started but did not need, and "
                "rollout.over_sample=1 starts none more; set rollout.over_sample > 1 (e.g. 1.5)"
            )
        if carries and not self.async_rollout:  # async with over-sampling is refused below
            if self.max_staleness < 1:
                raise ValueError(
                    f"rollout.max_staleness={self.max_staleness}: rollout.partial=continue trains samples started "
                    "on an older policy; set rollout.max_staleness >= 1 (the versions a token may lag)"
                )
        else:
            check_max_staleness(self.max_staleness)
        if self.over_sample == 1.0:
            return
        refused = {
            "rollout.async_rollout=true": self.async_rollout,
            "rollout.truncated=true": self.truncated,
        }
        for setting, on in refused.items():
            if on:
                raise ValueError(
                    f"rollout.over_sample={self.over_sample} with {setting}: over-sampling is built for "
                    f"synchronous rollouts without truncation; set rollout.over_sample=1 or drop {setting}"
                )


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


@dataclass
class TrainerSection(ConfigNode):
    steps: int = 200  # RL steps (one rollout each); the LR schedule spans all of them
    stop_after_steps: int | None = None  # end the process early (a time-boxed or preempted job); resume later
    prompts_per_step: int = 16
    updates_per_rollout: int = 2  # mini-batches (optimizer steps) per rollout: ratio != 1 after the first
    old_log_probs: OldLogProbSource = OldLogProbSource.trainer  # pi_old from a trainer pass or the engine's log-probs
    logprob_chunk_size: int | None = None  # tokens per chunk in vocab_parallel_log_probs; None: one
    micro_batch_size: int = 32  # sequences per micro-batch per data-parallel rank
    # token budget per micro-batch per data-parallel rank: rows sorted by length, each micro-batch
    # padded to its own longest row (contracts/token_budget.py); replaces micro_batch_size. null: off
    micro_batch_tokens: int | None = None
    seed: int = 1234
    eval_every: int = 10  # 0: never
    eval_prompts: int = 64
    eval_samples: int = 1  # k: > 1 adds mean@k and pass@k (set rollout.eval_temperature > 0)
    recompute_activations: bool = False
    # the KL reference's weights (algorithm.kl.coef > 0) in host memory between its forward passes,
    # brought to the device for each (policy/reference.py)
    reference_offload: bool = False
    on_nonfinite: NonFinitePolicy = NonFinitePolicy.skip  # drop the update, or end the run
    max_consecutive_nonfinite: int = 3  # skipped updates in a row that end the run with a diagnosis

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "updates_per_rollout", "micro_batch_size", "eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.old_log_probs not in OLD_LOG_PROB_SOURCES:
            raise ValueError(
                f"trainer.old_log_probs={self.old_log_probs!r} is unknown; valid: {', '.join(OLD_LOG_PROB_SOURCES)}"
            )
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ValueError(f"trainer.logprob_chunk_size must be >= 1 or null, got {self.logprob_chunk_size}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"trainer.micro_batch_tokens must be >= 1 or null (off), got {self.micro_batch_tokens}")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise ValueError(
                f"trainer.stop_after_steps must be >= 1 or null (run all trainer.steps), got {self.stop_after_steps}"
            )
        if self.eval_every < 0:
            raise ValueError(f"trainer.eval_every must be >= 0 (0: never), got {self.eval_every}")
        if self.eval_samples < 1:
            raise ValueError(f"trainer.eval_samples must be >= 1 (responses per eval prompt), got {self.eval_samples}")
        if self.max_consecutive_nonfinite < 1:
            raise ValueError(f"trainer.max_consecutive_nonfinite must be >= 1, got {self.max_consecutive_nonfinite}")
        if self.on_nonfinite not in tuple(NonFinitePolicy):  # Hydra refuses others; a Python caller may not
            raise ValueError(
                f"trainer.on_nonfinite={self.on_nonfinite!r} is unknown; valid: {', '.join(NonFinitePolicy)}"
            )


@dataclass
class CheckpointSection(ConfigNode):
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    resume: str = "false"  # false | true (a checkpoint must exist) | auto (resume if there is one)
    overwrite: bool = False  # a fresh run may take over a run_dir holding another run's files
    resume_allow_changes: list[str] = field(default_factory=list)  # keys (or "section.") that may differ
    allow_resume_without_config: bool = False  # resume a checkpoint that saved no config (nothing to check)
    save_on_signal: bool = True  # SIGTERM/SIGINT: finish the step, save, exit 128+signal
    export_hf: bool = False  # write the policy as a HF checkpoint to <run>/hf_export/ at the end
    export_hf_every: int = 0  # also every N steps (0: only at the end); each export replaces the last

    def validate(self) -> None:
        from gspo_megatron.run.run_dir_owner import resume_mode  # reviewed exception: test_import_layers.py

        for name, zero_means in (
            ("save_every", "only at the end"),
            ("keep_last", "keep all"),
            ("export_hf_every", "only at the end"),
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"checkpoint.{name} must be >= 0 (0: {zero_means}), got {getattr(self, name)}")
        try:  # each names the key
            resume_mode(self.resume)
            validate_allow_list(self.resume_allow_changes)
        except RuntimeError as error:  # ResumeConfigError; a RunDirError is a ValueError already
            raise ValueError(str(error)) from None


@dataclass
class LoggingSection(ConfigNode):
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "gspo-megatron"
    progress: bool = True
    # Draw the PNG charts at the end of a run (reward_curve.png, the routing report's figures: 1-3 s on
    # 2 cores). false keeps every number (metrics.jsonl, routing_report.json, the report's tables); a
    # sweep or a test that reads only numbers saves the drawing, and
    # ``python -m gspo_megatron.run.routing_report RUN_DIR`` draws the report's figures later.
    charts: bool = True


@dataclass
class TrainConfig(ConfigNode):
    run_dir: str | None = None  # None: Hydra's output directory
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    task: TaskConfig = field(default_factory=TaskConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def prompt_token_budget(self) -> int:
        """The most prompt tokens a row may have: prompt + response must fit the model's context."""
        return self.model.max_position_embeddings - self.rollout.max_new_tokens


def to_train_config(cfg: object) -> TrainConfig:
    """The composed Hydra config as a ``TrainConfig`` instance (each section's dataclass validates
    itself on the way); the one place that turns an OmegaConf tree into the typed schema."""
    from omegaconf import OmegaConf

    typed = OmegaConf.to_object(cfg)  # any OmegaConf container
    if not isinstance(typed, TrainConfig):
        raise TypeError(f"expected a config composed from the TrainConfig schema, got {type(typed).__name__}")
    return typed
