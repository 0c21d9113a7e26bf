"""Reward functions by name: the built-ins (``builtin.py``, registered in ``catalog.py``), user functions as
``import:pkg.module:function``.

Design decisions:
- One signature for every reward: ``fn(response_text, record: PromptRecord) -> RewardResult``, or a plain
  float or bool as TRL users write them (converted by ``pool.as_reward_result``: correct when > 0 / True).
- ``resolve_reward`` is the only lookup; it runs in the parent (to fail fast on a bad name) and again
  inside each worker process, which is why user functions are named by import path and not passed as
  objects (spawned workers can import a module; they cannot receive a lambda).
- A reward function may carry a ``warm_up`` attribute (a no-argument callable). Workers call it before
  they report ready, so slow imports (sympy for math-verify) never count against a sample's timeout.
"""

from __future__ import annotations

from gspo_megatron.core.registry import IMPORT_PREFIX, UnknownNameError, import_function
from gspo_megatron.rollout.rewards import builtin  # noqa: F401  (registers the built-ins)
from gspo_megatron.rollout.rewards.catalog import REWARDS, TRIVIAL, RewardFn


def is_trivial_reward(name: str) -> bool:
    return name in TRIVIAL


def available_rewards() -> list[str]:
    return REWARDS.names() + [f"{IMPORT_PREFIX}<package.module>:<function>"]


def resolve_reward(name: str) -> RewardFn:
    if name.startswith(IMPORT_PREFIX):
        return import_function(name, "reward")
    try:
        return REWARDS.get(name)
    except UnknownNameError as error:
        raise UnknownNameError(f"{error}; or a user function as 'import:package.module:function'") from None
