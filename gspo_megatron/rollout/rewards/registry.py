"""Reward functions by name: built-ins registered here, user functions as ``import:pkg.module:function``.

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
from collections.abc import Callable

from gspo_megatron.core.registry import Registry, UnknownNameError
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.rewards.types import RewardResult

RewardFn = Callable[[str, PromptRecord], RewardResult]

REWARDS: Registry[RewardFn] = Registry("reward function")
IMPORT_PREFIX = "import:"
_TRIVIAL: set[str] = set()  # built-ins that are pure string checks: safe to call in the trainer process


def register_reward(name: str, *, trivial: bool = False):
    """Decorator: ``@register_reward("exact_match", trivial=True)``.

    ``trivial``: a pure-Python check that cannot hang or crash; by default (``reward.in_process``
    unset) only these run in the trainer process, every other verifier in workers with a timeout.
    """
    if trivial:
        _TRIVIAL.add(name)
    return REWARDS.register(name)


def is_trivial_reward(name: str) -> bool:
    import gspo_megatron.rollout.rewards.builtin  # noqa: F401  (registers the built-ins)

    return name in _TRIVIAL


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
    import gspo_megatron.rollout.rewards.builtin  # noqa: F401  (registers the built-ins)

    if name.startswith(IMPORT_PREFIX):
        return _import_reward(name)
    try:
        return REWARDS.get(name)
    except UnknownNameError as error:
        raise UnknownNameError(f"{error}; or a user function as 'import:package.module:function'") from None
