"""The one result type every reward function returns.

``reward`` is the task reward before any shaping; ``correct`` and ``format_ok`` are kept apart because
shapers weigh them separately (Step-GRPO's R = alpha * acc * (...) + (1 - alpha) * fmt).
``error`` is set when the verifier failed; the sample then scores 0, and ``failure`` names the kind
(one of ``FAILURE_KINDS``) so every kind is counted apart in the step's metrics.
``turn_rewards``, optional, is a multi-turn trajectory's reward per generated turn, beside its trajectory
reward (the verifier reads the turns in ``record.trajectory``): one real number per turn, in order. They are
logged per turn index (``agent/turn_reward/turn_<t>``) and enter the advantage only when
``algorithm.advantage.turn_reward_weight`` > 0 (``rollout/agents/turn_rewards.py`` states the rule).
"""

from __future__ import annotations

from dataclasses import dataclass

# verifier: the verifier itself reported an error; raised: it raised; bad_type: it returned something
# other than a real number, a bool, or a RewardResult of a real reward and bool (or 0/1) correct and
# format_ok, or per-turn rewards that are not one real number per turn of a trajectory; nonfinite: a NaN/inf
# reward or per-turn reward; timeout / died: its worker process hung past reward.timeout_s / died during the call.
FAILURE_KINDS = ("verifier", "raised", "bad_type", "nonfinite", "timeout", "died")


@dataclass(frozen=True)
class RewardResult:
    reward: float
    correct: bool
    format_ok: bool
    error: str | None = None
    failure: str | None = None  # one of FAILURE_KINDS when error is set
    turn_rewards: tuple[float, ...] | None = None  # a trajectory's reward per generated turn (None: none given)

    @classmethod
    def failed(cls, error: str, kind: str = "verifier") -> RewardResult:
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown reward failure kind {kind!r}; valid: {FAILURE_KINDS}")
        return cls(reward=0.0, correct=False, format_ok=False, error=error, failure=kind)
