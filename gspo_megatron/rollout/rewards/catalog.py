"""The reward functions registered by name (``REWARDS``) and the decorator that registers one; the
built-ins (``builtin.py``) register through it, and ``registry.py`` resolves a name."""

from __future__ import annotations

from collections.abc import Callable

from gspo_megatron.core.registry import Registry
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.rewards.types import RewardResult

RewardFn = Callable[[str, PromptRecord], RewardResult]

REWARDS: Registry[RewardFn] = Registry("reward function")
TRIVIAL: set[str] = set()  # built-ins that are pure string checks: safe to call in the trainer process


def register_reward(name: str, *, trivial: bool = False):
    """Decorator: ``@register_reward("exact_match", trivial=True)``.

    ``trivial``: a pure-Python check that cannot hang or crash; by default (``reward.in_process``
    unset) only these run in the trainer process, every other verifier in workers with a timeout.
    """
    if trivial:
        TRIVIAL.add(name)
    return REWARDS.register(name)
