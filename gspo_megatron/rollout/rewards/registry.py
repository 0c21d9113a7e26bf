"""Reward functions by name: the built-ins (``builtin.py``, registered in ``catalog.py``), user functions as
``import:pkg.module:function``.

Design decisions:
- One signature for every reward: ``fn(response_text, record: PromptRecord) -> RewardResult``.
- ``resolve_reward`` is the only lookup; it runs in the parent (to fail fast on a bad name) and again
  inside each worker process, which is why user functions are named by import path and not passed as
  objects (spawned workers can import a module; they cannot receive a lambda).
- A reward function may carry a ``warm_up`` attribute (a no-argument callable). Workers call it before
  they report ready, so slow imports (sympy for math-verify) never count against a sample's timeout.
"""

from __future__ import annotations

import importlib

from gspo_megatron.core.registry import UnknownNameError
from gspo_megatron.rollout.rewards import builtin  # noqa: F401  (registers the built-ins)
from gspo_megatron.rollout.rewards.catalog import REWARDS, TRIVIAL, RewardFn

IMPORT_PREFIX = "import:"


def is_trivial_reward(name: str) -> bool:
    return name in TRIVIAL


def available_rewards() -> list[str]:
    return REWARDS.names() + [f"{IMPORT_PREFIX}<package.module>:<function>"]


def _import_reward(spec: str) -> RewardFn:
    target = spec[len(IMPORT_PREFIX) :]
    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"reward {spec!r} must look like 'import:package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({error})") from error
    fn = getattr(module, function_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable {function_name!r}")
    return fn


def resolve_reward(name: str) -> RewardFn:
    if name.startswith(IMPORT_PREFIX):
        return _import_reward(name)
    try:
        return REWARDS.get(name)
    except UnknownNameError as error:
        raise UnknownNameError(f"{error}; or a user function as 'import:package.module:function'") from None
