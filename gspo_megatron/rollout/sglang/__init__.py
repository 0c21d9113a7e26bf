"""SGLang rollout engine: launcher, async HTTP client, /generate protocol, weight sync."""

from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine, WeightSyncError

__all__ = ["SGLangConfig", "SGLangEngine", "WeightSyncError"]
