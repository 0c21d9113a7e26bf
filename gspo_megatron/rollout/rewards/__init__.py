"""Rewards: one-signature verifier functions (registry), and a pool that runs them with timeouts."""

from gspo_megatron.rollout.rewards.catalog import REWARDS, RewardFn, register_reward
from gspo_megatron.rollout.rewards.config import RewardConfig
from gspo_megatron.rollout.rewards.pool import PoolStats, RewardPool, call_reward
from gspo_megatron.rollout.rewards.registry import available_rewards, resolve_reward  # registers the built-ins
from gspo_megatron.rollout.rewards.types import RewardResult

__all__ = [
    "REWARDS",
    "PoolStats",
    "RewardConfig",
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "available_rewards",
    "call_reward",
    "register_reward",
    "resolve_reward",
]
