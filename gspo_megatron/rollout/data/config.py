"""Config schemas of the data layer: tokenizer, prompt dataset, task.

Design decisions:
- Plain dataclasses with defaults; ``validate()`` checks each one's own fields and names the field
  and the fix. Cross-section rules (context length vs model, reward name vs registry) are checked
  where both sides are known: ``build_task`` and ``RewardConfig.validate``.
- ``TaskConfig.dataset`` and ``TaskConfig.eval_dataset`` are only read by the dataset-backed tasks
  (``jsonl``, ``parquet``); a synthetic task refuses ``eval_dataset`` (its eval stream is ``eval_seed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_megatron.core.config_node import ConfigNode

TOKENIZER_KINDS = ("hf", "symbol")
DATASET_FORMATS = ("auto", "jsonl", "parquet")
BAD_UTF8_POLICIES = ("error", "skip")


@dataclass
class TokenizerConfig(ConfigNode):
    kind: str = "symbol"  # "symbol" (built-in, synthetic tasks) or "hf" (local directory)
    path: str | None = None  # local model/tokenizer directory or hub id for kind=hf (core/hub_checkpoints.py)

    def validate(self) -> None:
        if self.kind not in TOKENIZER_KINDS:
            raise ValueError(f"tokenizer.kind={self.kind!r} is unknown; valid: {list(TOKENIZER_KINDS)}")
        if self.kind == "hf" and not self.path:
            raise ValueError("tokenizer.kind=hf needs tokenizer.path (a local model directory)")


@dataclass
class DatasetConfig(ConfigNode):
    path: str | None = None  # local .jsonl or .parquet file
    format: str = "auto"  # auto: from the file suffix
    prompt_field: str = "prompt"  # dotted paths reach nested fields, e.g. "reward_model.ground_truth"
    answer_field: str = "answer"
    metadata_fields: list[str] = field(default_factory=list)  # copied into PromptRecord.metadata
    apply_chat_template: bool = True
    system_prompt: str | None = None  # prepended as a system message when rendering chat
    prompt_suffix: str = ""  # appended to text prompts, e.g. an instruction to box the answer
    max_prompt_tokens: int = 1024  # longer prompts are dropped (counted in stats)
    shuffle: bool = True
    seed: int = 0
    on_bad_utf8: str = "error"  # "error" (with line number) or "skip" (counted)

    def validate(self) -> None:
        # the path is required only by a dataset task: rollout/data/datasets.py checks it when it loads
        if self.format not in DATASET_FORMATS:
            raise ValueError(f"dataset.format={self.format!r} is unknown; valid: {list(DATASET_FORMATS)}")
        if self.on_bad_utf8 not in BAD_UTF8_POLICIES:
            raise ValueError(f"dataset.on_bad_utf8={self.on_bad_utf8!r} is unknown; valid: {list(BAD_UTF8_POLICIES)}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"dataset.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        for name in ("prompt_field", "answer_field"):
            if not getattr(self, name):
                raise ValueError(f"dataset.{name} must be a non-empty field name")


@dataclass
class TaskConfig(ConfigNode):
    name: str = "max_digit"  # a registered task; see gspo_megatron.rollout.data.tasks.available_tasks()
    seed: int = 0  # synthetic tasks: the record stream is a pure function of (seed, index)
    min_digits: int = 3  # synthetic tasks: digits per problem, drawn uniformly in [min, max]
    max_digits: int = 5
    eval_seed: int = 1_000_003  # synthetic held-out stream; must differ from seed
    reward: str | None = None  # reward function name; None: the task's default
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    # dataset tasks: a held-out file read like task.dataset (same fields, template, suffix), whose first
    # trainer.eval_prompts records are the evaluation; None: the first records of the training file
    eval_dataset: str | None = None

    def validate(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"task digits need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}"
            )
        if self.eval_seed == self.seed:
            raise ValueError("task.eval_seed must differ from task.seed, or eval problems repeat training ones")
