"""The config's ``routing`` section: routing replay (``routing.replay``) and the routing diagnostics
(activation volatility, expert load).

Design decisions:
- The diagnostic kinds are a closed choice (``DiagnosticKind``): Hydra refuses a typo at compose
  time, and a direct construction fails with the list of valid names, not silently at step 500.
- The schedule is a pure function of the step (``is_due``), so every rank agrees on whether a
  diagnostic runs without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_megatron.core.config_node import ConfigChoice, ConfigNode
from gspo_megatron.policy.routing.replay import ReplayMode


# What each kind compares (the trainer decides where to call them; policy/routing/volatility.py computes):
#   update           -- same tokens, router top-k of the policy before vs after one optimizer step
#   rollout_vs_train -- experts the rollout engine routed to (SGLang routed_experts) vs the
#                       trainer's top-k for the same tokens (train/inference routing mismatch)
#   minibatch        -- consecutive mini-batch updates within one RL step (drift across updates)
#   ratio_decomposition -- the last update's importance ratio split into its routing part and its
#                       weight part (policy/routing/ratio_decomposition.py; two extra forward-only passes)
class DiagnosticKind(ConfigChoice):
    update = "update"
    rollout_vs_train = "rollout_vs_train"
    minibatch = "minibatch"
    ratio_decomposition = "ratio_decomposition"


DIAGNOSTIC_KINDS: tuple[str, ...] = tuple(DiagnosticKind)


def validate_kind(kind: str) -> str:
    """Return ``kind`` if it is a known diagnostic kind, else raise naming the valid ones."""
    if kind not in DIAGNOSTIC_KINDS:
        raise ValueError(f"unknown routing diagnostic kind {kind!r}; valid kinds: {', '.join(DIAGNOSTIC_KINDS)}")
    return kind


@dataclass
class RoutingConfig(ConfigNode):
    replay: ReplayMode = ReplayMode.none  # R2 (old_policy) / R3 (rollout); see gspo_megatron/policy/routing/replay.py
    # the diagnostics
    enabled: bool = True
    every_n_steps: int = 1  # run the diagnostics on steps where step % every_n_steps == 0
    kinds: list[DiagnosticKind] = field(
        default_factory=lambda: [DiagnosticKind.update, DiagnosticKind.rollout_vs_train]
    )

    def validate(self) -> None:
        if self.every_n_steps < 1:
            raise ValueError(
                f"routing diagnostics every_n_steps must be >= 1, got {self.every_n_steps} "
                "(set enabled: false to turn the diagnostics off)"
            )
        for kind in self.kinds:
            validate_kind(kind)
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"routing diagnostics kinds contain duplicates: {list(self.kinds)}")

    def is_due(self, step: int, kind: str) -> bool:
        """Whether diagnostic ``kind`` runs at ``step``."""
        validate_kind(kind)
        return self.enabled and kind in self.kinds and step % self.every_n_steps == 0
