"""The one result type every reward function returns.

``reward`` is the task reward before any shaping; ``correct`` and ``format_ok`` are kept apart because
shapers weigh them separately (Step-GRPO's R = alpha * acc * (...) + (1 - alpha) * fmt).
``error`` is set when the verifier failed (exception, timeout, crash); the sample then scores 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RewardResult:
    reward: float
    correct: bool
    format_ok: bool
    error: Optional[str] = None

    @classmethod
    def failed(cls, error: str) -> "RewardResult":
        return cls(reward=0.0, correct=False, format_ok=False, error=error)
