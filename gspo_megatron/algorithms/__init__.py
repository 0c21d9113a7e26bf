"""Loss-head math: vocab-parallel log-probs, policy losses, advantages, parallel reductions.

Pure tensor functions; the trainer owns micro-batching and wires these into megatron-core's
forward-backward schedule. Formulas and papers are cited in each module.
"""

from gspo_megatron.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageContext,
    AdvantageOutput,
    group_relative,
)
from gspo_megatron.algorithms.config import AlgorithmConfig, make_advantage_context
from gspo_megatron.algorithms.logprobs import vocab_parallel_log_probs
from gspo_megatron.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossConfig,
    LossContext,
    PolicyLossOutput,
    get_policy_loss,
)
from gspo_megatron.algorithms.metrics import finalize_metrics, merge_metrics, token_mean_metric
from gspo_megatron.algorithms.reductions import (
    all_reduce_metrics,
    context_parallel_sequence_sum,
    context_parallel_sequence_sum_fn,
    local_sequence_sum,
)
from gspo_megatron.core.registry import Registry, UnknownNameError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "AdvantageContext",
    "AdvantageOutput",
    "AlgorithmConfig",
    "LossConfig",
    "LossContext",
    "PolicyLossOutput",
    "Registry",
    "UnknownNameError",
    "all_reduce_metrics",
    "context_parallel_sequence_sum",
    "context_parallel_sequence_sum_fn",
    "finalize_metrics",
    "get_policy_loss",
    "group_relative",
    "local_sequence_sum",
    "make_advantage_context",
    "merge_metrics",
    "token_mean_metric",
    "vocab_parallel_log_probs",
]
