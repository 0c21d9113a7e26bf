"""The typed schema of a training run, composed from each role's own config sections.

Design decisions:
- Each role owns its sections: the rollout side ``rollout`` (``rollout/config.py``), ``task``,
  ``tokenizer``, ``reward`` and ``shaping``; the policy side ``model``, ``parallel`` and ``optimizer``
  (``policy/config.py``) and ``routing``; ``algorithm`` is ``algorithms/config.py``'s. This module adds
  the sections of the loop and the run (``trainer``, ``checkpoint``, ``logging``) and composes them all
  into one ``TrainConfig``. Hydra validates YAML against it (unknown keys, wrong types fail at compose
  time).
- ``MISSING`` is used nowhere: every default runs the tiny model on CPU.
- Each section refuses its own bad values in ``validate()``, which runs as ``to_train_config`` builds
  the typed tree (the entry point's first step, before anything is built or written) and names the
  key and the fix; rules between sections are ``config/validate.py``'s. Where 0 is a setting it is
  said beside the field (``optimizer.clip_grad=0``: no clipping; ``rollout.eval_temperature=0``:
  greedy). Training rollouts need ``rollout.temperature > 0``: their log-probs are
  ``log_softmax(logits / T)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_megatron.algorithms.config import OLD_LOG_PROB_SOURCES, AlgorithmConfig, OldLogProbSource
from gspo_megatron.config.known_keys import check_config_keys
from gspo_megatron.config.resume_check import validate_allow_list
from gspo_megatron.core.config_node import ConfigNode
from gspo_megatron.core.run_dir import resume_mode
from gspo_megatron.policy.config import ModelSection, OptimizerSection, ParallelSection
from gspo_megatron.policy.nonfinite import NonFinitePolicy
from gspo_megatron.policy.routing.config import RoutingConfig
from gspo_megatron.rollout.config import RolloutSection
from gspo_megatron.rollout.data.config import TaskConfig, TokenizerConfig
from gspo_megatron.rollout.rewards.config import RewardConfig
from gspo_megatron.rollout.shaping.config import ShapingConfig


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
    # compute each group's shared prompt once per micro-batch (its rows packed as prompt | response_1 | ...
    # with a mask and RoPE positions that give every token what it sees in its own row: the same log-probs
    # and gradients; contracts/shared_prefix.py). Refused where it cannot apply (config/validate.py)
    shared_prefix: bool = False
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
    # torch intra-op threads of each process; null: the rule (core/threads.py: the process's share of the
    # host's cores, halved while the embedded engine generates beside the trainer); OMP_NUM_THREADS wins
    cpu_threads: int | None = None

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
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(
                f"trainer.cpu_threads must be >= 1 or null (the rule in core/threads.py), got {self.cpu_threads}"
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
    signal_grace_s: float = 120.0  # after SIGTERM/SIGINT the step may run this long, then it is abandoned
    export_hf: bool = False  # write the policy as a HF checkpoint to <run>/hf_export/ at the end
    export_hf_every: int = 0  # also every N steps (0: only at the end); each export replaces the last

    def validate(self) -> None:

        for name, zero_means in (
            ("save_every", "only at the end"),
            ("keep_last", "keep all"),
            ("export_hf_every", "only at the end"),
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"checkpoint.{name} must be >= 0 (0: {zero_means}), got {getattr(self, name)}")
        if not self.signal_grace_s > 0:  # every wait has a bound: no "0 = forever"
            raise ValueError(
                f"checkpoint.signal_grace_s must be > 0 (seconds the step may run after SIGTERM/SIGINT), "
                f"got {self.signal_grace_s}"
            )
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
        """The most prompt tokens a row may have: prompt + response (or trajectory) must fit the model's context."""
        return self.rollout.prompt_budget(self.model.max_position_embeddings)


def to_train_config(cfg: object) -> TrainConfig:
    """The composed Hydra config as a ``TrainConfig`` instance (each section's dataclass validates
    itself on the way); the one place that turns an OmegaConf tree into the typed schema. A key the
    schema does not have (added with '+') is refused first, naming the closest (``config/known_keys.py``):
    ``to_object`` would set it as an attribute nothing reads."""
    from omegaconf import OmegaConf

    if OmegaConf.is_dict(cfg):
        check_config_keys(OmegaConf.to_container(cfg, resolve=False), TrainConfig)  # type: ignore[arg-type]
    typed = OmegaConf.to_object(cfg)  # any OmegaConf container
    if not isinstance(typed, TrainConfig):
        raise TypeError(f"expected a config composed from the TrainConfig schema, got {type(typed).__name__}")
    return typed
