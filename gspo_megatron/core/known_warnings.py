"""Third-party warnings reviewed as harmless here, filtered at the entry point; everything else shows.

Design decisions:
- One reviewed list, each entry with the reason it is harmless. ``train.py`` installs the filters
  before it imports anything that warns; ``tests/e2e/test_quiet_start.py`` runs the main job and
  fails on any warning that still reaches the screen, so a new one is either fixed at its source or
  reviewed and added here.
- Filters match the warning's category, the start of its message and the module that issues it, so
  the same text from elsewhere still shows.
- A warning that is harmless only without CUDA (``KNOWN_CPU_WARNINGS``) is filtered by the CPU start-up
  (``policy/cpu_bridges.py:apply_cpu_bridges``, which every rank calls), never on a GPU.
- Warnings we can remove at the source are removed there instead (megatron's deprecated default
  ``cuda_graph_scope="full"`` is overridden in ``policy/models/builder.py``; the embedded engine uses
  transformers' current cache argument).
- What the accelerator warnings meant is said once, in one line (``optional_accelerators_notice``).
- Some libraries say the same through ``logging`` at WARNING (megatron-core 0.19, torch's CUDA build
  on a machine without a GPU): those are reviewed the same way (``KNOWN_LOG_MESSAGES``), each filtered
  on the one logger that emits it.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    category: type[Warning]
    message: str  # regular expression matched at the start of the message
    module: str  # regular expression matched against the warning module's full name
    why: str


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        UserWarning,
        r"Transformer Engine and Apex are not installed",
        r"megatron\.",
        "megatron's optimizer and grad clipping fall back to torch; said once by optional_accelerators_notice",
    ),
    KnownWarning(
        UserWarning,
        r"Apex is not installed\. Falling back to Torch Norm",
        r"megatron\.",
        "megatron's layer specs fall back to torch's norm; said once by optional_accelerators_notice",
    ),
    KnownWarning(
        FutureWarning,
        r"`load_state_dict` is deprecated and will be removed in future versions",
        r"megatron\.core\.dist_checkpointing\.",
        "megatron 0.16's checkpoint loader calls torch's older load API (seen on resume); megatron's to change",
    ),
    KnownWarning(
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"torch\.distributed\.checkpoint\.",
        "megatron 0.16's distributed checkpoints are ShardedTensors (seen on resume); megatron's to change",
    ),
    KnownWarning(
        FutureWarning,
        r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
        r"torch\.distributed\.c10d_logger",
        "megatron's distributed optimizer calls torch's older collective name (seen on every rank of a "
        "multi-rank run); the same operation, megatron's to change",
    ),
    KnownWarning(
        FutureWarning,
        r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        r"torch\.distributed\.c10d_logger",
        "megatron's distributed optimizer calls torch's older collective name (seen on every rank of a "
        "multi-rank run); the same operation, megatron's to change",
    ),
    KnownWarning(
        UserWarning,
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to ",
        r"torch\.distributed\.checkpoint\.",
        "policy/checkpoint/reader.py loads with no_dist=True on purpose (each rank reads its own shards, as "
        "megatron >= 0.17 does; tools/convert_checkpoint.py too); torch warns at every such load, once per rank",
    ),
    KnownWarning(
        UserWarning,
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        r"megatron\.core\.optimizer\.optimizer",
        "megatron's zero_grad helper asks every parameter view of the distributed optimizer's shards "
        "whether it has a .grad (a view never has one; nothing is lost); megatron's to change",
    ),
    KnownWarning(
        UserWarning,
        r"MimoModelConfig is experimental",
        r"megatron\.core\.models\.mimo\.",
        "megatron-core 0.19 defines its multimodal config when the package is imported; never used here",
    ),
    KnownWarning(
        UserWarning,
        r"Failed to load image Python extension",
        r"torchvision\.",
        "a torchvision that does not match torch (transformers imports it if present); training never "
        "uses it, and launch/setup.sh does not install it",
    ),
)


# Reviewed as harmless only without CUDA: filtered by the CPU start-up (policy/cpu_bridges.py:apply_cpu_bridges, in
# every rank), so that on GPUs, where they can be acted on, they still show.
KNOWN_CPU_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        UserWarning,
        r"When using (sequence parallelism|async grad allreduce) it is recommended to set the environment "
        r"variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
        r"megatron\.core\.tensor_parallel\.layers",
        "megatron's advice for overlapping CUDA streams, said once per rank of a tp > 1 run (megatron-core 0.16 "
        "and later); without CUDA there is no stream to overlap and the variable changes nothing",
    ),
)


@dataclass(frozen=True)
class KnownLogMessage:
    logger: str  # the exact logger name that emits it
    message: str  # regular expression matched at the start of the formatted message
    why: str


KNOWN_LOG_MESSAGES: tuple[KnownLogMessage, ...] = (
    KnownLogMessage(
        "megatron.core.models.gpt.gpt_model",
        r"GPTModel IS DEPRECATED",
        "megatron-core 0.19 asks new code to build HybridModel; GPTModel is still built, fixed and tested "
        "there (docs/development.md, 'Tested versions'), and the move is megatron's next change for us to follow",
    ),
    KnownLogMessage(
        "megatron.core.dist_checkpointing.strategies.torch",
        r"MCore's async save is deprecated",
        "megatron-core 0.19's synchronous save runs through its own deprecated async path "
        "(TorchDistSaveShardedStrategy.save); the trainer asks for a synchronous save",
    ),
    KnownLogMessage(
        "torch.utils.cpp_extension",
        r"No CUDA runtime is found",
        "a CUDA build of torch on a machine without a GPU (what pip gives on Python 3.12 here); nothing compiles",
    ),
)


class _ReviewedLogFilter(logging.Filter):
    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self._patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(pattern.match(text) for pattern in self._patterns)


_ACCELERATORS = (("TransformerEngine", "transformer_engine"), ("Apex", "apex"))


def filter_known_warnings() -> None:
    """Hide the reviewed warnings in this process (and in processes that import the entry point)."""
    for known in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)
    by_logger: dict[str, list[str]] = {}
    for entry in KNOWN_LOG_MESSAGES:
        by_logger.setdefault(entry.logger, []).append(entry.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ReviewedLogFilter) for f in logger.filters):  # once per process
            logger.addFilter(_ReviewedLogFilter(patterns))


def filter_known_cpu_warnings() -> None:
    """Hide the warnings reviewed as harmless without CUDA (``KNOWN_CPU_WARNINGS``) in this process."""
    for known in KNOWN_CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)


def optional_accelerators_notice() -> str | None:
    """One line naming the absent optional accelerators and what that means; None if both are present."""
    absent = [name for name, module in _ACCELERATORS if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return (
        f"[gspo] {' and '.join(absent)} not installed: megatron uses torch's attention, norms and optimizer "
        "kernels instead (same results; on GPUs slower; `pip install -e .[te]` adds TransformerEngine)"
    )
