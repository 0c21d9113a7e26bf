"""Data layer: tokenizers, prompt records, prompt datasets and tasks (see each module's docstring)."""

from gspo_megatron.rollout.data.config import DatasetConfig, TaskConfig, TokenizerConfig
from gspo_megatron.rollout.data.datasets import DatasetStats, PromptDataset
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.data.tasks import Task, available_tasks, build_task, register_task
from gspo_megatron.rollout.data.tokenizer import HFTokenizer, SymbolTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "DatasetConfig",
    "DatasetStats",
    "HFTokenizer",
    "PromptDataset",
    "PromptRecord",
    "SymbolTokenizer",
    "Task",
    "TaskConfig",
    "Tokenizer",
    "TokenizerConfig",
    "available_tasks",
    "build_task",
    "build_tokenizer",
    "register_task",
]
