"""The typed schema of a training run, composed from each component's own config dataclass.

Design decisions:
- Components own their config dataclasses (``algorithms/config.py``, ``shaping/config.py``, ...);
  this module only adds the sections that belong to the trainer and composes them into one
  ``TrainConfig``. Hydra validates YAML against it (unknown keys, wrong types fail at compose time).
- The rollout section names its engine (``embedded`` or ``sglang``) and carries the sampling
  parameters shared by both, plus each engine's own block.
- ``MISSING`` is used nowhere: every default runs the tiny model on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_megatron.algorithms.config import AlgorithmConfig
from gspo_megatron.config_node import ConfigChoice, ConfigNode
from gspo_megatron.data.config import TaskConfig, TokenizerConfig
from gspo_megatron.models.config import ExpertMLP, LayerSpec, MoEModelConfig, TokenDispatcher
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.rewards.config import RewardConfig
from gspo_megatron.rollout.config import EmbeddedConfig, RolloutEngineName, TruncatedRolloutConfig
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.routing.config import RoutingDiagnosticsConfig
from gspo_megatron.shaping.config import ShapingConfig
from gspo_megatron.trainer.nonfinite import NonFinitePolicy


class TrainerDtype(ConfigChoice):
    """``model.dtype``: the trainer's parameter dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class DecayStyle(ConfigChoice):
    """``optimizer.decay_style`` (megatron's OptimizerParamScheduler names)."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


@dataclass
class ModelSection(MoEModelConfig):
    preset: str | None = None  # documentation of where the numbers came from ("tiny", ...)
    hf_checkpoint: str | None = None  # a local HF Qwen3-MoE directory to start from; its config.json sets the shape
    layer_spec: LayerSpec = LayerSpec.auto
    token_dispatcher: TokenDispatcher = TokenDispatcher.alltoall  # MoE with EP or TP; same results either way
    expert_mlp: ExpertMLP = ExpertMLP.grouped
    dtype: TrainerDtype = TrainerDtype.float32  # bf16 needs a GPU
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

    def layout(self, world_size: int) -> ParallelLayout:
        return ParallelLayout(
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            etp=self.etp,
            cp=self.cp,
            sequence_parallel=self.sequence_parallel,
            world_size=world_size,
        )


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
    async_rollout: bool = False  # generate step k+1 while step k trains (trainer/async_rollout.py)
    max_staleness: int = 1  # policy versions a sample may lag in async mode: 0 (= synchronous) or 1
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    truncation: TruncatedRolloutConfig = field(default_factory=TruncatedRolloutConfig)


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
    clip_grad: float = 1.0


@dataclass
class TrainerSection(ConfigNode):
    steps: int = 200  # RL steps (one rollout each); the LR schedule spans all of them
    stop_after_steps: int | None = None  # end the process early (a time-boxed or preempted job); resume later
    prompts_per_step: int = 16
    updates_per_rollout: int = 2  # mini-batches (optimizer steps) per rollout: ratio != 1 after the first
    micro_batch_size: int = 32  # sequences per micro-batch per data-parallel rank
    # token budget per micro-batch per data-parallel rank: rows sorted by length, each micro-batch
    # padded to its own longest row (trainer/micro_batches.py); replaces micro_batch_size. null: off
    micro_batch_tokens: int | None = None
    seed: int = 1234
    eval_every: int = 10  # 0: never
    eval_prompts: int = 64
    eval_samples: int = 1  # k: > 1 adds mean@k and pass@k (set rollout.eval_temperature > 0)
    recompute_activations: bool = False
    on_nonfinite: NonFinitePolicy = NonFinitePolicy.skip  # drop the update, or end the run
    max_consecutive_nonfinite: int = 3  # skipped updates in a row that end the run with a diagnosis


@dataclass
class CheckpointSection(ConfigNode):
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    resume: str = "false"  # false | true (a checkpoint must exist) | auto (resume if there is one)
    overwrite: bool = False  # a fresh run may take over a run_dir holding another run's files
    resume_allow_changes: list[str] = field(default_factory=list)  # keys (or "section.") that may differ
    save_on_signal: bool = True  # SIGTERM/SIGINT: finish the step, save, exit 128+signal
    export_hf: bool = False  # write the policy as a HF checkpoint to <run>/hf_export/ at the end
    export_hf_every: int = 0  # also every N steps (0: only at the end); each export replaces the last


@dataclass
class LoggingSection(ConfigNode):
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "gspo-megatron"
    progress: bool = True


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
    routing: RoutingDiagnosticsConfig = field(default_factory=RoutingDiagnosticsConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)


def to_train_config(cfg: object) -> TrainConfig:
    """The composed Hydra config as a ``TrainConfig`` instance (each section's dataclass validates
    itself on the way); the one place that turns an OmegaConf tree into the typed schema."""
    from omegaconf import OmegaConf

    typed = OmegaConf.to_object(cfg)  # any OmegaConf container
    if not isinstance(typed, TrainConfig):
        raise TypeError(f"expected a config composed from the TrainConfig schema, got {type(typed).__name__}")
    return typed
