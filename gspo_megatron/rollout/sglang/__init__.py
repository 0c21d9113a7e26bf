"""SGLang rollout engine: launcher, async HTTP client, /generate protocol, weight sync.

The engine is imported on first use (PEP 562 ``__getattr__``), not with the package: every run's
config schema reads ``SGLangConfig`` from here, and the engine's HTTP client (httpx, which pulls
click, rich and pygments) is start-up time the main job (``rollout=embedded``) never uses.
"""

from typing import TYPE_CHECKING

from gspo_megatron.rollout.sglang.config import SGLangConfig

if TYPE_CHECKING:
    from gspo_megatron.rollout.sglang.engine import SGLangEngine, WeightSyncError

__all__ = ["SGLangConfig", "SGLangEngine", "WeightSyncError"]
_FROM_ENGINE = ("SGLangEngine", "WeightSyncError")


def __getattr__(name: str) -> object:
    if name in _FROM_ENGINE:
        from gspo_megatron.rollout.sglang import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
